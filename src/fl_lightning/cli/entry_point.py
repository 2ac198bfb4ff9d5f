"""``python -m fl_lightning`` and the ``fl-lightning`` script: parse, run, and end a refused
command in one line ``error: <key>: <problem>`` on stderr (exit status 2)."""

from __future__ import annotations

import sys
from typing import List, Optional

from fl_lightning.cli.parser import parse_command
from fl_lightning.errors import ConfigError, Interrupted, RunError


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        _, options, resolved = parse_command(argv)
        # the commands' modules import Lightning: loaded for an accepted command line, so that
        # reading configs with this package stays light
        from fl_lightning.cli.commands import run

        run(options, resolved)
    except ConfigError as error:
        return _fail(str(error))
    except Interrupted as error:
        return _fail(str(error), status=130)
    except RunError as error:
        return _fail(str(error), status=1)
    except KeyboardInterrupt:  # before the first round or after the last one
        return _fail("interrupted; run the same command again (with --resume auto once a checkpoint exists)",
                     status=130)
    return 0


def _fail(message: str, status: int = 2) -> int:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return status
