"""Every width of saved sub-model runs, each scored with statistics of its own.

    python tools/width_evaluation.py runs/submodel/mnist_e5 --policies fjord hasfl uniform \\
        [--widths 0.25 0.5 0.75 1.0] [--checkpoint last] [--split test]

Each argument is a run folder or a root of ``<policy>_s<seed>`` runs. Each run is reopened at its
checkpoint (the last model by default: the figure the study's "final" columns report) and the
leading sub-model of every width is scored on the split with the run's served-statistics protocol
(under ``bn: sbn``, one pass over the clients' data per width): the sub-model option
``eval_widths`` applied after the fact (``docs/submodel.md``), as FjORD's authors report every
width. Prints, per policy, mean ± std over seeds of each width's accuracy, and per seed.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from fl_lightning.tool_parser import ToolParser, existing_run


def runs_of(paths, policies) -> dict:
    """policy -> {seed: run folder}."""
    out = defaultdict(dict)
    for path in paths:
        folders = [path] if (path / "config.yaml").exists() else sorted(path.iterdir())
        for folder in folders:
            match = re.fullmatch(r"(.+)_s(\d+)", folder.name)
            if match and (folder / "summary.json").exists() and (policies is None or match.group(1) in policies):
                out[match.group(1)][int(match.group(2))] = folder
    return out


def width_figures(run: Path, widths, checkpoint: str, split: str) -> dict:
    """``{width: accuracy}`` of one saved run, each width with its own statistics."""
    from fl_lightning.config import FabricConfig
    from fl_lightning.cli.saved_runs import open_saved_run

    saved = open_saved_run(run, checkpoint, FabricConfig(accelerator="cpu", devices=1, threads_per_rank=1))
    algorithm = saved.spec.algorithm
    algorithm.eval_widths = list(widths)
    figures = algorithm.evaluate_widths(split, saved.spec.eval.batch_size)
    return {w: figures[f"acc_w{w:g}"] for w in widths}


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=existing_run)
    parser.add_argument("--policies", nargs="+", default=None)
    parser.add_argument("--widths", nargs="+", type=float, default=[0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--checkpoint", default="last", help="last, best or a path")
    parser.add_argument("--split", default="test", choices=["test", "val"])
    args = parser.parse_args(argv)
    found = runs_of(args.runs, args.policies)
    if not found:
        parser.error("runs: no finished run found")
    per_seed = {p: {s: width_figures(r, args.widths, args.checkpoint, args.split) for s, r in sorted(seeds.items())}
                for p, seeds in found.items()}
    head = " | ".join(f"width {w:g}" for w in args.widths)
    print(f"{args.split} accuracy (%) of each width with its own statistics, {args.checkpoint} checkpoint, "
          f"mean ± std over seeds:\n")
    print(f"| policy | seeds | {head} |")
    print("| --- | --- | " + " | ".join("---" for _ in args.widths) + " |")
    for policy, seeds in per_seed.items():
        cells = []
        for w in args.widths:
            v = 100 * np.array([f[w] for f in seeds.values()])
            cells.append(f"{v.mean():.1f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.1f}")
        print(f"| {policy} | {len(seeds)} | {' | '.join(cells)} |")
    print(f"\nPer seed:\n\n| policy | seed | {head} |")
    print("| --- | --- | " + " | ".join("---" for _ in args.widths) + " |")
    for policy, seeds in per_seed.items():
        for seed, f in seeds.items():
            print(f"| {policy} | {seed} | " + " | ".join(f"{100 * f[w]:.1f}" for w in args.widths) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
