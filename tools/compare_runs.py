"""Compare the figures of two sets of runs: every number of ``metrics.jsonl`` and
``clients.jsonl``, except wall times, must be identical.

Used to show that a change of code that should not change results did not:

    python tools/compare_runs.py runs/before runs/after        # folders holding run folders
    python tools/compare_runs.py runs/before/x runs/after/x    # or two run folders

Exits 1 naming the first differing figure of each run that differs, 0 when all agree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TIMES = ("seconds", "round_seconds", "client_seconds", "server_seconds", "client_seconds_max")


def figures(run: Path, name: str) -> list:
    path = run / name
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not k.split("/")[-1] in TIMES} for row in rows]


def first_difference(a: Path, b: Path):
    for name in ("metrics.jsonl", "clients.jsonl"):
        rows_a, rows_b = figures(a, name), figures(b, name)
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
        problem = first_difference(path, after[name])
        print(f"{name}: {'identical' if problem is None else problem}")
        failed += problem is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
