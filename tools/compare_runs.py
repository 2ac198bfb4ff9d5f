"""Compare the figures of two sets of runs: every number of ``metrics.jsonl`` and
``clients.jsonl``, except wall times, and every entry of the checkpoints (``last.ckpt``,
``best.ckpt``: model, method state, round) must be identical.

Used to show that a change of code that should not change results did not (the runs come
from ``tools/record_runs.py``, once with the old checkout and once with the new):

    python tools/compare_runs.py runs/before runs/after        # folders holding run folders
    python tools/compare_runs.py runs/before/x runs/after/x    # or two run folders
    python tools/compare_runs.py runs/before runs/after --ignore test_global_acc
    python tools/compare_runs.py runs/before runs/after --renamed model_bytes=model_bytes_down,model_bytes_up

``--ignore`` leaves out keys (per client, their ``sum/`` round totals, and checkpoint entries
of that name) whose meaning a change altered on purpose or that it added; ``--renamed OLD=NEW[,NEW...]`` says a figure kept
its value under new names: the old runs' ``OLD`` is compared with each ``NEW`` of the new runs.
Name both in the change's notes.

Exits 1 naming the first differing figure of each run that differs, 0 when all agree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.tool_parser import ToolParser

TIMES = ("seconds", "round_seconds", "client_seconds", "server_seconds", "client_seconds_max")


def figures(run: Path, name: str, ignored=(), renamed=None) -> list:
    """The rows of ``run/name`` without wall times and ignored keys, with ``renamed``
    (``{old: [new, ...]}``) keys under their new names."""
    path = run / name
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    left_out = set(TIMES) | set(ignored)
    return [{k: v for k, v in renamed_keys(row, renamed or {}).items() if k.split("/")[-1] not in left_out}
            for row in rows]


def renamed_keys(row: dict, renamed: dict) -> dict:
    out = {}
    for key, value in row.items():
        prefix, _, last = key.rpartition("/")  # a round total keeps its sum/ prefix
        for new in renamed.get(last, [last]):
            out[f"{prefix}/{new}" if prefix else new] = value
    return out


def rename_map(pairs) -> dict:
    out = {}
    for pair in pairs:
        old, sep, new = pair.partition("=")
        if not sep or not old or not all(new.split(",")):
            raise ValueError(f"--renamed: expected OLD=NEW[,NEW...], got {pair!r}")
        out[old] = new.split(",")
    return out


def first_difference(a: Path, b: Path, ignored=(), renamed=None):
    for name in ("metrics.jsonl", "clients.jsonl"):
        rows_a, rows_b = figures(a, name, ignored, renamed), figures(b, name, ignored)
        if len(rows_a) != len(rows_b):
            return f"{name}: {len(rows_a)} rows against {len(rows_b)}"
        for i, (ra, rb) in enumerate(zip(rows_a, rows_b)):
            for key in sorted(set(ra) | set(rb)):
                if ra.get(key) != rb.get(key):
                    return f"{name} row {i}: {key} {ra.get(key)!r} against {rb.get(key)!r}"
    return None


def first_entry_difference(a, b, where: str = "", ignored=()):
    """The first key path at which two checkpoint entries differ (tensors by dtype, shape and
    every bit; plain values by ``==``), or None; mapping keys named in ``ignored`` (an option a
    change added, say) are left out at any depth."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted((set(a) | set(b)) - set(ignored), key=str):
            if key not in a or key not in b:
                return f"{where}{key} only in {'the first' if key in a else 'the second'}"
            found = first_entry_difference(a[key], b[key], f"{where}{key}/", ignored)
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_entry_difference(x, y, f"{where}{i}/", ignored)
            if found:
                return found
        return None
    key = where.rstrip("/") or "(top)"
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return None if same else key
    return None if type(a) is type(b) and a == b else key


def by_class_name(state: dict) -> dict:
    """``state`` with its method record's class path cut to the class name: a checkpoint loads
    into the method of that name wherever its module lives (``federation/provenance.py``), so a
    method moved to another module writes the same checkpoint."""
    method = state.get("method")
    if isinstance(method, dict) and isinstance(method.get("class_path"), str):
        state = {**state, "method": {**method, "class_path": method["class_path"].rsplit(".", 1)[-1]}}
    return state


def checkpoint_difference(a: Path, b: Path, ignored=()):
    """The first differing entry of the two runs' ``last.ckpt`` and ``best.ckpt`` (tensors by
    dtype, shape and every bit; keys in ``ignored`` left out), or None."""
    for name in ("last.ckpt", "best.ckpt"):
        pa, pb = a / "checkpoints" / name, b / "checkpoints" / name
        if pa.exists() != pb.exists():
            return f"{name} only in {a.name if pa.exists() else b.name}"
        if pa.exists():
            found = first_entry_difference(by_class_name(load_checkpoint(pa)), by_class_name(load_checkpoint(pb)),
                                           ignored=ignored)
            if found:
                return f"{name}: {found}"
    return None


def runs(folder: Path) -> dict:
    if (folder / "metrics.jsonl").exists():
        return {folder.name: folder}
    return {p.name: p for p in sorted(folder.iterdir()) if (p / "metrics.jsonl").exists()}


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--ignore", nargs="+", default=[], metavar="KEY",
                        help="keys to leave out of the comparison (redefined or added on purpose)")
    parser.add_argument("--renamed", nargs="+", default=[], metavar="OLD=NEW[,NEW...]",
                        help="figures that kept their values under new names")
    parser.add_argument("--figures-only", action="store_true",
                        help="compare the figures only, not the checkpoints' entries")
    args = parser.parse_args(argv)
    try:
        renamed = rename_map(args.renamed)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
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
        problem = first_difference(path, after[name], args.ignore, renamed)
        if problem is None and not args.figures_only:
            problem = checkpoint_difference(path, after[name], args.ignore)
        print(f"{name}: {'identical' if problem is None else problem}")
        failed += problem is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
