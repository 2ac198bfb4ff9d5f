"""Compare the figures of two sets of runs: every number of ``metrics.jsonl`` and
``clients.jsonl``, except wall times, must be identical.

Used to show that a change of code that should not change results did not (the runs come
from ``tools/record_runs.py``, once with the old checkout and once with the new):

    python tools/compare_runs.py runs/before runs/after        # folders holding run folders
    python tools/compare_runs.py runs/before/x runs/after/x    # or two run folders
    python tools/compare_runs.py runs/before runs/after --ignore model_bytes model_bytes_up

``--ignore`` leaves out keys (per client, and their ``sum/`` round totals) whose name or
meaning a change altered on purpose; name them in the change's notes.

Exits 1 naming the first differing figure of each run that differs, 0 when all agree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TIMES = ("seconds", "round_seconds", "client_seconds", "server_seconds", "client_seconds_max")


def figures(run: Path, name: str, ignored=()) -> list:
    path = run / name
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    left_out = set(TIMES) | set(ignored)
    return [{k: v for k, v in row.items() if k.split("/")[-1] not in left_out} for row in rows]


def first_difference(a: Path, b: Path, ignored=()):
    for name in ("metrics.jsonl", "clients.jsonl"):
        rows_a, rows_b = figures(a, name, ignored), figures(b, name, ignored)
        if len(rows_a) != len(rows_b):
            return f"{name}: {len(rows_a)} rows against {len(rows_b)}"
        for i, (ra, rb) in enumerate(zip(rows_a, rows_b)):
            for key in sorted(set(ra) | set(rb)):
                if ra.get(key) != rb.get(key):
                    return f"{name} row {i}: {key} {ra.get(key)!r} against {rb.get(key)!r}"
    return None


def runs(folder: Path) -> dict:
    if (folder / "metrics.jsonl").exists():
        return {folder.name: folder}
    return {p.name: p for p in sorted(folder.iterdir()) if (p / "metrics.jsonl").exists()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--ignore", nargs="+", default=[], metavar="KEY",
                        help="keys to leave out of the comparison (renamed or redefined on purpose)")
    args = parser.parse_args(argv)
    for key in ("before", "after"):
        if not getattr(args, key).is_dir():
            print(f"error: {key}: {getattr(args, key)} is not a folder", file=sys.stderr)
            return 2
    before, after = runs(args.before), runs(args.after)
    if not before:
        print(f"error: no run folder under {args.before}", file=sys.stderr)
        return 2
    failed = 0
    for name, path in before.items():
        if name not in after:
            print(f"{name}: missing from {args.after}")
            failed += 1
            continue
        problem = first_difference(path, after[name], args.ignore)
        print(f"{name}: {'identical' if problem is None else problem}")
        failed += problem is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
