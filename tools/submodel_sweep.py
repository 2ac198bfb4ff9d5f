"""Run every config of a folder over several seeds (the sub-model policies, the split-FL
methods, ...); every config of a seed shares its partition and caps (both are drawn from the
run seed). Random-budget reads the same seed's HAS-FL run for
its matched budget trace, so HAS-FL runs first.

    python tools/submodel_sweep.py --configs configs/submodel/offline/digits --seeds 0 1 2 \\
        --out runs/submodel/digits [--policies hasfl uniform ...] [-- extra fit arguments]

Runs land in ``<out>/<policy>_s<seed>``; a finished run (summary.json present) is skipped.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from fl_lightning.tool_parser import ToolParser

ORDER = ["hasfl", "hasfl_nocov", "heterofl", "fedrolex", "fjord", "uniform", "random_budget", "fedavg", "fedprox", "scaffold"]


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", required=True, help="folder of <policy>.yaml")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--policies", nargs="+", default=None)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: extra arguments for fit")
    args = parser.parse_args(argv)
    extra = [a for a in args.extra if a != "--"]
    available = {p.stem for p in Path(args.configs).glob("*.yaml")}
    # known sub-model policies in dependency order, then any other config of the folder
    known = [p for p in ORDER if p in available] + sorted(available - set(ORDER))
    policies = [p for p in known if args.policies is None or p in args.policies]
    failed = 0
    for seed in args.seeds:
        for policy in policies:
            name = f"{policy}_s{seed}"
            if (Path(args.out) / name / "summary.json").exists():
                continue
            cmd = [sys.executable, "-m", "fl_lightning", "fit", "--config", str(Path(args.configs) / f"{policy}.yaml"),
                   "--seed", str(seed), "--name", name, "--out_dir", args.out, *extra]
            if policy == "random_budget":
                trace = Path(args.out) / f"hasfl_s{seed}"
                if (trace / "metrics.jsonl").exists():
                    cmd += ["--algorithm.budget_from", str(trace)]
            print(" ".join(cmd), flush=True)
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, env=os.environ)
            failed += done.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
