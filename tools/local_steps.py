"""How much local work a study gives a client: local steps per client per round and in all.

    python tools/local_steps.py runs/submodel/mnist_subset [more run folders or roots ...]

Each argument is one run folder (``clients.jsonl`` inside) or a root of ``<method>_s<seed>``
runs. Per method (or run) it prints the rounds, clients per round, the local steps of one client
in one round (mean, and the range over client-rounds), the steps of the whole run summed over
every client-round (mean over seeds), and the mean client shard (examples) of the client-rounds. A step is
one optimizer step on one mini-batch (the ``steps`` of each client row: epochs times the shard's
batches, or the configured ``train.steps``); a split client's step is one batch through both
halves. The regime a result was measured in, beside the paper's (docs/results/*.md).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from fl_lightning.tool_parser import ToolParser, existing_run


def client_rows(run: Path) -> list:
    return [json.loads(line) for line in (run / "clients.jsonl").read_text().splitlines() if line.strip()]


def run_work(run: Path) -> dict:
    """The local work of one run, from its client rows."""
    rows = [r for r in client_rows(run) if "steps" in r]
    if not rows:
        raise SystemExit(f"local_steps.py: error: {run}: no client row logs its steps")
    steps = np.array([r["steps"] for r in rows], dtype=np.float64)
    rounds = len({r["round"] for r in rows})
    samples = np.array([r.get("samples", np.nan) for r in rows], dtype=np.float64)
    return {"rounds": rounds, "clients_per_round": len(rows) / rounds, "mean": float(steps.mean()),
            "min": float(steps.min()), "max": float(steps.max()), "total": float(steps.sum()),
            "samples": float(np.nanmean(samples)) if np.isfinite(samples).any() else float("nan")}


def groups(paths) -> dict:
    """method (or run name) -> list of run folders; with several roots, ``root/method``."""
    out = defaultdict(list)
    for path in paths:
        if (path / "clients.jsonl").exists():
            out[path.name].append(path)
            continue
        prefix = f"{path.name}/" if len(paths) > 1 else ""
        for folder in sorted(path.iterdir()):
            match = re.fullmatch(r"(.+)_s(\d+)", folder.name)
            if match and (folder / "clients.jsonl").exists():
                out[prefix + match.group(1)].append(folder)
    return out


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=existing_run, help="run folders or roots of <method>_s<seed> runs")
    args = parser.parse_args(argv)
    found = groups(args.runs)
    if not found:
        parser.error("runs: no run with a clients.jsonl found")
    print("| method | runs | rounds | clients/round | steps per client-round (mean, range) | "
          "steps of the run (all clients) | client shard (examples) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for method, runs in found.items():
        work = [run_work(r) for r in runs]
        mean = {k: float(np.mean([w[k] for w in work])) for k in work[0]}
        print(f"| {method} | {len(work)} | {mean['rounds']:.0f} | {mean['clients_per_round']:.1f} | "
              f"{mean['mean']:.1f} ({min(w['min'] for w in work):.0f}-{max(w['max'] for w in work):.0f}) | "
              f"{mean['total']:,.0f} | {mean['samples']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
