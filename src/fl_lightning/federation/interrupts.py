"""Ctrl-C with forked CPU ranks: one line from rank 0, whichever process the signal reached.

A terminal sends SIGINT to every process of the job (the launcher and its ranks); ``kill -INT``
reaches the launcher only. So the launcher passes the signal on to its ranks and waits for
rank 0's one-line answer; each rank takes the first SIGINT as its interrupt and ignores any
copy of it. A rank blocked in a collective learns of its peers' exit only from the collective's
failure, so any error on a rank after its interrupt is the interrupt too. A second Ctrl-C at
the launcher stops the ranks at once.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from contextlib import contextmanager

_requested = False


def requested() -> bool:
    """True on a rank once it has taken its interrupt."""
    return _requested


def take_once_on_rank() -> None:
    """Install, on a forked rank, the handler that raises KeyboardInterrupt for the first SIGINT
    only (the terminal's copy and the launcher's copy are one interrupt)."""
    global _requested
    _requested = False

    def interrupt(signum, frame):
        global _requested
        if _requested:
            return
        _requested = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)


@contextmanager
def forwarded_to_ranks():
    """While the launcher waits for its forked ranks, SIGINT goes on to them; a second one
    terminates them and interrupts the launcher itself."""
    launcher = os.getpid()
    received = 0

    def forward(signum, frame):
        nonlocal received
        if os.getpid() != launcher:  # a rank that has not yet installed its own handler
            raise KeyboardInterrupt
        received += 1
        for rank in multiprocessing.active_children():
            try:
                os.kill(rank.pid, signal.SIGINT if received == 1 else signal.SIGTERM)
            except ProcessLookupError:  # it has just ended
                pass
        if received > 1:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, forward)
    try:
        yield lambda: received > 0
    finally:
        signal.signal(signal.SIGINT, previous)
