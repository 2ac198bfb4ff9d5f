"""The round accumulator's memory and the bytes each round's reduction sends, for a config.

    python benchmarks/reduction_bytes.py [--config configs/feast_cifar100.yaml] [--rounds 20] [fit overrides...]

Builds the run as ``fit`` does on one CPU rank (CIFAR configs read generated files in the real
format, as ``benchmarks/main_job_round.py`` writes them), then for each of the first rounds
plans it and routes every client of the cohort (the regions a client's update will cover),
without training. Prints:

- the accumulator's memory: float64 value and count sums of every floating-point global tensor
  (``elastic/aggregation.py``), held by every rank whatever the round touches;
- bytes per reduction before (every accumulator, as the reduction sent it until it sent only the
  touched blocks) and now (per global tensor the leading block holding every region the round's
  cohort covers, ``runtime/round_state.py``): mean, smallest and largest over the rounds, and
  the ratio of the means. Both in float64, as the all-reduce sends them; on one rank nothing is
  sent, these are the figures of a run on several.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

MB = 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/feast_cifar100.yaml")
    parser.add_argument("--rounds", type=int, default=20)
    options, overrides = parser.parse_known_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="reduction_bytes_") as scratch:
        print(measure(options, overrides, Path(scratch)))
    return 0


def measure(options, overrides, scratch: Path) -> str:
    from lightning.fabric import Fabric

    from fl_lightning.cli import parse_command
    from fl_lightning.elastic.aggregation import aggregated_keys
    from fl_lightning.federation.builder import build_context
    from fl_lightning.runtime.round_state import leading_block, union
    from main_job_round import CIFAR_LAYOUTS, accepts_skip_option, dataset_name, write_cifar

    _, args, _ = parse_command(["fit", "--config", options.config, *overrides])
    name = dataset_name(args.data.dataset)
    if name in CIFAR_LAYOUTS and not any(o.startswith("--data.root") for o in overrides):
        write_cifar(scratch / "data", name)
        extra = ["--data.root", str(scratch / "data")]
        if accepts_skip_option(args.data.dataset):
            extra += ["--data.dataset.init_args.skip_integrity_check", "true"]
        _, args, _ = parse_command(["fit", "--config", options.config, *overrides, *extra])
    spec = replace(args, name="reduction_bytes", out_dir=str(scratch / "runs"))  # fit's arguments are its RunSpec
    ctx = build_context(spec, Fabric(accelerator="cpu", devices=1))
    algorithm = spec.algorithm  # set up on ctx by build_context
    state = ctx.model.state_dict()
    keys = aggregated_keys(state)
    whole = sum(state[k].numel() for k in keys)
    before, now = [], []
    for round_idx in range(options.rounds):
        plan = algorithm.plan(round_idx)
        blocks = {}
        for task in plan.tasks:
            for key, region in algorithm.route(task, plan).regions.values():
                blocks[key] = union(blocks.get(key), leading_block(region))
        touched = sum(torch.Size(blocks[k]).numel() for k in keys if k in blocks)
        before.append(2 * 8 * whole)
        now.append(2 * 8 * touched)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return (f"reduction_bytes: {options.config}, rounds 0-{options.rounds - 1} of its plan, "
            f"{args.federation.clients_per_round} clients a round\n"
            f"accumulator memory per rank: {whole / 1e6:.2f}M floating-point positions x (value + count) x 8 B = "
            f"{2 * 8 * whole / MB:.0f} MB\n"
            f"bytes per reduction: before {mean(before) / MB:.0f} MB; now mean {mean(now) / MB:.0f} MB (smallest "
            f"{min(now) / MB:.0f}, largest {max(now) / MB:.0f}); ratio now/before {mean(now) / mean(before):.3f}")


if __name__ == "__main__":
    sys.exit(main())
