"""FIARSE round cost against the same clients' dense plain training in a bare loop, and the
round's logical against executed MACs.

    python benchmarks/fiarse_round_cost.py                    # cnn on synthetic 16x16 images, CPU
    python benchmarks/fiarse_round_cost.py --model resnet18 --image-size 32 --accelerator cuda
    python benchmarks/fiarse_round_cost.py --mask-table       # no training: ResNet-18 MACs per grouping

Time: for the same plans (cohort and kept fractions, the original's four sizes 1/64, 1/16,
1/4, 1 spread over the clients), a full FIARSE round (plan, mask family of the global
weights, routing with masks, threshold-masked local training through the LightningModule,
position-wise aggregation) against a bare loop that trains a dense copy of the global model
with plain SGD for the same steps on the same batches. Masking adds elementwise work per step
and the per-round sort of the magnitudes; an unstructured mask saves no arithmetic, so the
ratio is at least 1. Target: <= 1.15 (masking plus the round's machinery, the allowance of the
HAS-FL and ScaleFL round-cost scripts). On a loaded machine the ratio of the fastest rounds is
the steadier figure.

``--mask-table``: the CIFAR-100 ResNet-18 at initialization, logical MACs at the original's
model sizes for every threshold grouping, and the time to find those five thresholds.

MACs: per client, the kept fraction, the logical MACs of its masked model (kept weights only)
and the executed MACs (the dense model's, what the dense kernels run), per example forward.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F
from _timing import median
from fl_lightning.data import Synthetic

SIZES = (1 / 64, 1 / 16, 1 / 4, 1.0)
TARGET = 1.15  # the masked model executes the dense one: only masking and round machinery may add


def make_spec(args, out_dir: str):
    from fl_lightning.algorithms.supernet.fiarse import FIARSE
    from fl_lightning.config import (DataConfig, EvalConfig, FabricConfig, FederationConfig, LocalTrainConfig,
                                     PartitionConfig)
    from fl_lightning.federation.builder import RunSpec

    fractions = [SIZES[i % len(SIZES)] for i in range(args.clients)]
    return RunSpec(name="bench_fiarse", out_dir=out_dir, seed=0,
                   algorithm=FIARSE(fractions=fractions, eval_fractions=[1.0], recalibrate_bn=False),
                   data=DataConfig(dataset=Synthetic(num_train=4000, num_test=100,
                                                     image_size=args.image_size, channels=3)),
                   partition=PartitionConfig(method="iid", num_clients=args.clients),
                   model={"class_path": args.model},
                   train=LocalTrainConfig(steps=args.steps, batch_size=args.batch_size, lr=0.05, momentum=0.9),
                   federation=FederationConfig(rounds=args.rounds + 1, clients_per_round=args.clients),
                   eval=EvalConfig(every=10_000), fabric=FabricConfig(accelerator=args.accelerator, devices=1))


def federation(args, out_dir: str):
    from lightning.fabric import Fabric

    from fl_lightning.federation.loop import Federation
    from fl_lightning.federation.run_dir import RunDir

    spec = make_spec(args, out_dir)
    fed = Federation(Fabric(accelerator=args.accelerator, devices=1), spec, RunDir(spec.out_dir, spec.name))
    fed._open_outputs()
    return fed


def bare_round(fed, plan) -> None:
    """Every client of the plan trains a dense copy of the global model with plain SGD on the
    same batches (no mask, no aggregation)."""
    from fl_lightning.elastic.routing import load_routed_state
    from fl_lightning.runtime.seeding import client_generator

    ctx, alg = fed.ctx, fed.algorithm
    for task in plan.tasks:
        load_routed_state(alg.worker, alg.global_state, alg.worker_regions)
        model = alg.worker
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=plan.lr, momentum=ctx.train.momentum)
        for x, y in ctx.shards[task.client].steps(ctx.train.steps, client_generator(ctx.seed, plan.round_idx, task.client)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mask_table(threads: int) -> None:
    """Logical MACs of the initialized CIFAR-100 ResNet-18 at the original's sizes, per grouping."""
    from fl_lightning.elastic.magnitude_masks import GROUPINGS, MaskFamily, group_keys, layer_macs
    from fl_lightning.elastic.models.resnet import ResNet18
    from fl_lightning.federation.builder import MODEL_INIT
    from fl_lightning.runtime.seeding import derive_seed

    torch.manual_seed(derive_seed(0, MODEL_INIT))
    model = ResNet18(100, (3, 32, 32))
    macs = layer_macs(model, (3, 32, 32))
    print(f"ResNet-18 (CIFAR-100, 32x32, seed-0 initialization): executed {macs.executed('paper') / 1e6:.2f}M MACs "
          f"(paper convention), {macs.executed('fvcore') / 1e6:.2f}M (fvcore), {threads} CPU thread(s)")
    sizes = SIZES + (0.5,)
    print(f"{'grouping':>8}  " + "  ".join(f"{f'f={f:.4g}':>9}" for f in sorted(sizes)) + "  thresholds s")
    for grouping in GROUPINGS:
        start = time.perf_counter()
        family = MaskFamily(model.state_dict(), group_keys(model, grouping))
        thresholds = {f: family.thresholds(f) for f in sorted(sizes)}  # by selection, as a round does
        built = time.perf_counter() - start
        cells = [f"{macs.logical(family.kept(thresholds[f])) / 1e6:8.1f}M" for f in sorted(sizes)]
        print(f"{grouping:>8}  " + "  ".join(cells) + f"  {built:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn", choices=("cnn", "resnet18"))
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mask-table", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.mask_table:
        mask_table(args.threads)
        return
    with tempfile.TemporaryDirectory() as tmp:
        fed = federation(args, tmp)
        device = fed.fabric.device
        fed.run_round(0)  # warm-up
        full, bare = [], []
        for r in range(1, args.rounds + 1):
            plan = fed.algorithm.plan(r)
            sync(device)
            start = time.perf_counter()
            bare_round(fed, plan)
            sync(device)
            bare.append(time.perf_counter() - start)
            start = time.perf_counter()
            _, clients = fed.run_round(r)
            sync(device)
            full.append(time.perf_counter() - start)
        alg = fed.algorithm
        print(f"{args.model} at {args.image_size}x{args.image_size}, {args.clients} clients x {args.steps} steps of "
              f"batch {args.batch_size} on {device}")
        print(f"FIARSE round {median(full) * 1e3:.1f} ms, dense bare loop {median(bare) * 1e3:.1f} ms (medians); "
              f"ratio {median([f / b for f, b in zip(full, bare)]):.3f} (median of per-round ratios), "
              f"{min(full) / min(bare):.3f} (fastest rounds, what load cannot inflate); target <= {TARGET}")
        print(f"MACs per example forward ({alg.macs_convention} convention):")
        print(f"{'client':>6}  {'kept %':>7}  {'logical':>12}  {'executed':>12}  {'logical/executed':>16}")
        for row in clients:
            print(f"{row['client']:6d}  {100 * row['kept_fraction']:7.2f}  {row['logical_macs']:12,.0f}  "
                  f"{row['executed_macs']:12,.0f}  {row['logical_macs'] / row['executed_macs']:16.3f}")
        logical = sum(r["logical_macs"] for r in clients)
        executed = sum(r["executed_macs"] for r in clients)
        print(f"round total: logical {logical:,.0f}, executed {executed:,.0f} ({logical / executed:.3f})")


if __name__ == "__main__":
    main()
