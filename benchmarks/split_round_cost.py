"""A split round against the same batches through the unsplit model in a bare loop, and the
bytes counted at the cut against the tensors' sizes.

    python benchmarks/split_round_cost.py                    # SplitFed V1, ResNet-18 (width 0.25)
    python benchmarks/split_round_cost.py --method fedsga    # FedSGA (prompts, harmonizer, probes)
    python benchmarks/split_round_cost.py --model vit

The federation round (plan, loading each client's front and server's back, split training
through the cut with two optimizers, descriptors, aggregation) is timed against a bare loop
that trains one copy of the whole model with SGD on the same clients' batches. Target ratio
<= 1.15 for SplitFed and for FedSGA (static cut, on its shared server model, with prompts
trained by the whole server loss (``prompt_gradient: all``, the default), the harmonizer on the
prediction path, probes and descriptors): both run on the split engine of ``modules/split.py``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F
from fl_lightning.data import Synthetic

MODELS = {
    "resnet": ("fl_lightning.elastic.models.ResNet18", {"width": 0.25}, "layer2.1"),
    "vit": ("fl_lightning.elastic.models.ViT", {"patch_size": 4, "embed_dim": 96, "depth": 6, "num_heads": 3}, "block2"),
}


def make_spec(method: str, model: str, out_dir: str, prompt_gradient: str = "all"):
    from fl_lightning.algorithms import FedSGA, SplitFed
    from fl_lightning.config import (DataConfig, EvalConfig, FabricConfig, FederationConfig, LocalTrainConfig,
                                     PartitionConfig)
    from fl_lightning.federation.builder import RunSpec

    class_path, init_args, cut = MODELS[model]
    algorithm = (SplitFed(cut=cut) if method == "splitfed"
                 else FedSGA(split_strategy="static", prompt_gradient=prompt_gradient))
    return RunSpec(name=f"bench_{method}", out_dir=out_dir, seed=0, algorithm=algorithm,
                   data=DataConfig(dataset=Synthetic(num_train=4000, num_test=200, image_size=32)),
                   partition=PartitionConfig(method="iid", num_clients=10),
                   model={"class_path": class_path, "init_args": init_args},
                   train=LocalTrainConfig(steps=4, batch_size=32, lr=0.05, momentum=0.9),
                   federation=FederationConfig(rounds=100, clients_per_round=4),
                   eval=EvalConfig(every=1000), fabric=FabricConfig(accelerator="cpu", devices=1, threads_per_rank=1))


def federation(method: str, model: str, out_dir: str, prompt_gradient: str = "all"):
    from lightning.fabric import Fabric

    from fl_lightning.federation.loop import Federation
    from fl_lightning.federation.run_dir import RunDir

    spec = make_spec(method, model, out_dir, prompt_gradient)
    fed = Federation(Fabric(accelerator="cpu", devices=1), spec, RunDir(spec.out_dir, spec.name))
    fed._open_outputs()
    return fed


def bare_round(fed, plan, model) -> None:
    """The same clients' batches through one unsplit model with SGD (no federation work)."""
    from fl_lightning.runtime.seeding import client_generator

    ctx = fed.ctx
    for task in plan.tasks:
        opt = torch.optim.SGD(model.parameters(), lr=plan.lr, momentum=ctx.train.momentum)
        for x, y in ctx.shards[task.client].steps(ctx.train.steps, client_generator(ctx.seed, plan.round_idx, task.client)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()


def check_bytes(fed, clients) -> None:
    """Bytes logged at the cut against the activation's size at that cut."""
    ctx = fed.ctx
    cuts = {task.client: task.cut for task in fed.algorithm.plan(0).tasks}
    for row in clients:
        front, _ = ctx.model.split(cuts[row["client"]])
        x, y = next(ctx.shards[row["client"]].epoch(torch.Generator().manual_seed(0)))
        per_example = front(x[:1]).numel() * 4
        examples = ctx.train.steps * ctx.train.batch_size
        expected_down = examples * per_example
        print(f"  client {row['client']}: cut bytes down {row['cut_bytes_down']:,} (activations: {expected_down:,}), "
              f"up {row['cut_bytes_up']:,} (with int64 labels: {expected_down + examples * 8:,})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["splitfed", "fedsga"], default="splitfed")
    parser.add_argument("--model", choices=list(MODELS), default="resnet")
    parser.add_argument("--rounds", type=int, default=15,
                        help="paired rounds (bare loop, then the federation round); the medians are compared")
    parser.add_argument("--prompt-gradient", choices=["task", "all"], default="all",
                        help="FedSGA: keep the alignment gradient from the prompt (one more front backward) or not")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        fed = federation(args.method, args.model, tmp, args.prompt_gradient)
        reference = fed.ctx.make_model()
        _, clients = fed.run_round(0)  # warm-up
        full, bare = [], []
        for r in range(1, args.rounds + 1):
            plan = fed.algorithm.plan(r)
            start = time.perf_counter()
            bare_round(fed, plan, reference)
            bare.append(time.perf_counter() - start)
            start = time.perf_counter()
            fed.run_round(r)
            full.append(time.perf_counter() - start)
        full.sort(), bare.sort()
        f, b = full[len(full) // 2], bare[len(bare) // 2]
        print(f"{args.method} ({args.model}) round {f * 1e3:.1f} ms, unsplit bare loop {b * 1e3:.1f} ms, "
              f"ratio {f / b:.3f} (target <= 1.15)")
        check_bytes(fed, clients)


if __name__ == "__main__":
    main()
