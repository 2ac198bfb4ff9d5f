"""``python -m fl_lightning``: the command line."""

import time

STARTED = time.perf_counter()
"""When this interpreter began running the command, before any import of its own: the start-up
line counts from here (``federation.machine.process_age``)."""

import sys  # noqa: E402 (after the clock is read)

from fl_lightning.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
