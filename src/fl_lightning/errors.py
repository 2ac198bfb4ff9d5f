"""The errors the CLI turns into one-line messages: ConfigError (exit 2), RunError (exit 1) and
Interrupted (exit 130, as a shell reports Ctrl-C)."""


class ConfigError(ValueError):
    """A bad configuration value or input, detected before any work starts.

    The message names the offending key first, e.g. ``data.alpha: must be > 0, got -1``.
    """

    def __init__(self, key: str, problem: str):
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}")

    def __reduce__(self):
        # Pickled with its two arguments, so it crosses process boundaries (spawned ranks) intact.
        return (type(self), (self.key, self.problem))


class RunError(RuntimeError):
    """A run that cannot go on (every client of a round diverged): one line, exit status 1."""


class Interrupted(RunError):
    """Ctrl-C (SIGINT) during a run: one line saying what the last checkpoint holds, exit status 130."""
