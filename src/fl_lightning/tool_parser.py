"""The argument parser of the scripts under ``tools/``: argparse, except that a bad argument is
reported on one line (``tool.py: error: KEY: problem``, exit status 2), as the CLI reports a bad
config, without the usage block (``--help`` still prints it)."""

import argparse
from pathlib import Path


class ToolParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def existing_run(text: str) -> Path:
    """Argument type of a run folder (or a folder of runs): a path that does not exist is refused
    with the option's name before any table is read."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no run at {path}")
    return path
