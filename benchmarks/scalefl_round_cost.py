"""ScaleFL round cost against the same clients' plain training of their served single-exit models.

    python benchmarks/scalefl_round_cost.py                 # 16x16 synthetic images, width 0.25
    python benchmarks/scalefl_round_cost.py --image-size 32 --rounds 3

For the same plans (cohort and levels chosen by ScaleFL's largest-affordable rule), a full
federation round (plan, routing by extraction, every exit's cross-entropy plus the early-exit
self-distillation through the LightningModule, sparse aggregation) against a bare loop that
extracts each client's level and runs the same number of SGD steps on the same batches with
cross-entropy on its single final exit (``forward``, the served model).

The exits' extra work is their pooling and linear layers, so the expected cost ratio is their
MAC share: sum over the cohort of steps x all-exit MACs / steps x served MACs (fvcore). The
report prints both, and a third timing that separates the two sources of extra time: the
same bare loop with ScaleFL's all-exit loss (the exits' own cost, MACs plus the loss terms).
Target: round / bare single-exit <= MAC ratio x 1.15 (the loss terms, the backward through the
exit heads and the round's machinery, as ``hasfl_round_cost.py``'s 1.15, are what the 15% allows
for). Timings on a shared machine are noisy; the per-round ratios' median is reported.
Budgets are spread from half the level-1 cost to 1.5x the level-4 cost, so the cohorts mix
every level and the fallback.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F
from _timing import median
from fl_lightning.data import Synthetic
from fl_lightning.elastic.models import ScaleFLResNet18


def make_spec(out_dir: str, image_size: int, width: float, rounds: int, steps: int, b_min: float, b_max: float):
    from fl_lightning.algorithms.supernet.scalefl import ScaleFL
    from fl_lightning.config import (BudgetConfig, DataConfig, EvalConfig, FabricConfig, FederationConfig,
                                     LocalTrainConfig, PartitionConfig)
    from fl_lightning.federation.builder import RunSpec

    return RunSpec(name="bench_scalefl", out_dir=out_dir, seed=0,
                   algorithm=ScaleFL(kd_start=0.0, recalibrate=False),  # distillation on in every timed round
                   data=DataConfig(dataset=Synthetic(num_train=4000, num_test=100,
                                                     image_size=image_size, channels=3)),
                   partition=PartitionConfig(method="iid", num_clients=20,
                                             budgets=BudgetConfig(b_min=b_min, b_max=b_max, b_cap=b_max)),
                   model={"class_path": "fl_lightning.elastic.models.ScaleFLResNet18", "init_args": {"width": width}},
                   train=LocalTrainConfig(steps=steps, batch_size=16, lr=0.05, momentum=0.9),
                   federation=FederationConfig(rounds=rounds, clients_per_round=10),
                   eval=EvalConfig(every=1000), fabric=FabricConfig(accelerator="cpu", devices=1))


def level_macs(image_size: int, width: float) -> list:
    from fl_lightning.algorithms.supernet.scalefl import LEVELS
    from fl_lightning.elastic.macs import spec_macs
    from fl_lightning.elastic.models import build_model
    from fl_lightning.elastic.models.scalefl_resnet import DepthWidthSpec

    model = build_model(ScaleFLResNet18, 10, (3, image_size, image_size), width=width)
    return [spec_macs(model, DepthWidthSpec(b, w), (3, image_size, image_size)) for b, w in LEVELS]


def federation(out_dir: str, args):
    from lightning.fabric import Fabric

    from fl_lightning.federation.loop import Federation
    from fl_lightning.federation.run_dir import RunDir

    macs = level_macs(args.image_size, args.width)
    spec = make_spec(out_dir, args.image_size, args.width, args.rounds + 1, args.steps, 0.5 * macs[0], 1.5 * macs[-1])
    fabric = Fabric(accelerator="cpu", devices=1)
    fed = Federation(fabric, spec, RunDir(spec.out_dir, spec.name))
    fed._open_outputs()
    return fed


def bare_round(fed, plan, exits: bool = False) -> None:
    """Each client's level, extracted and trained with SGD on the same batches: cross-entropy on
    its single served exit, or (``exits``) ScaleFL's loss on all its exits, without the round's
    machinery (LightningModule, Fabric, aggregation)."""
    from fl_lightning.modules.scalefl_client import scalefl_loss
    from fl_lightning.runtime.seeding import client_generator

    ctx, algorithm = fed.ctx, fed.algorithm
    for task in plan.tasks:
        local = ctx.model.extract(task.spec).module
        opt = torch.optim.SGD(local.parameters(), lr=plan.lr, momentum=ctx.train.momentum)
        generator = client_generator(ctx.seed, plan.round_idx, task.client)
        for x, y in ctx.shards[task.client].steps(ctx.train.steps, generator):
            opt.zero_grad()
            if exits:
                loss = scalefl_loss(local.forward_exits(x), y, algorithm.kd_gamma, algorithm.kd_temperature)
            else:
                loss = F.cross_entropy(local(x), y)
            loss.backward()
            opt.step()


def mac_ratio(fed, plan) -> float:
    algorithm = fed.algorithm
    levels = [task.choice.level - 1 for task in plan.tasks]
    return sum(algorithm.costs[k]["train_macs"] for k in levels) / sum(algorithm.level_macs[k] for k in levels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (after one warm-up round)")
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--width", type=float, default=0.25, help="substrate width multiplier")
    parser.add_argument("--steps", type=int, default=5, help="local steps per client")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        fed = federation(tmp, args)
        fed.run_round(0)  # warm-up
        times = {"full": [], "bare": [], "exits": []}
        expected = []
        for r in range(1, args.rounds + 1):
            plan = fed.algorithm.plan(r)
            expected.append(mac_ratio(fed, plan))
            for name, run in (("bare", lambda: bare_round(fed, plan)), ("exits", lambda: bare_round(fed, plan, True)),
                              ("full", lambda: fed.run_round(r))):
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)

        ratio = median([f / b for f, b in zip(times["full"], times["bare"])])
        exits = median([e / b for e, b in zip(times["exits"], times["bare"])])
        mac = sum(expected) / len(expected)
        print(f"medians over {args.rounds} rounds: ScaleFL round {median(times['full']) * 1e3:.1f} ms, bare single-exit "
              f"loop {median(times['bare']) * 1e3:.1f} ms, bare all-exit ScaleFL-loss loop "
              f"{median(times['exits']) * 1e3:.1f} ms")
        print(f"all-exit/served MAC ratio {mac:.4f}; bare all-exit / single-exit {exits:.3f}; "
              f"ScaleFL round / bare single-exit {ratio:.3f} (target <= {1.15 * mac:.3f}: "
              f"{'met' if ratio <= 1.15 * mac else 'NOT met'})")


if __name__ == "__main__":
    main()
