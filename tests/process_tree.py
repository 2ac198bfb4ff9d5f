"""The processes below a process (Linux /proc), for tests that must stop every rank they started."""

from pathlib import Path


def descendants(pid: int) -> list:
    """The processes below ``pid``, each followed by its own, deepest last."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return [p for child in found for p in [child, *descendants(child)]]
