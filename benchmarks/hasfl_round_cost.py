"""HAS-FL round cost against its routed sub-models trained in a bare loop, and peak memory
against the number of clients.

    python benchmarks/hasfl_round_cost.py            # time ratio
    python benchmarks/hasfl_round_cost.py --memory   # 20 vs 1,000 clients

Time: for the same plans (cohort and widths chosen by HAS-FL), a full federation round
(plan, routing by extraction, local training through the LightningModule, aggregation,
estimation, monitoring) against a bare loop that extracts each plain sub-model and runs the
same number of SGD steps on the same batches. Target ratio <= 1.15.

Memory: peak resident memory of a process running HAS-FL rounds with 20 and with 1,000
clients and the same per-round work (10 clients, a fixed number of local steps on synthetic
data). Target ratio < 1.1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from fl_lightning.data import Synthetic


def make_spec(num_clients: int, out_dir: str, rounds: int = 6):
    from fl_lightning.algorithms import HASFL
    from fl_lightning.config import (DataConfig, EvalConfig, FabricConfig, FederationConfig, LocalTrainConfig,
                                     PartitionConfig)
    from fl_lightning.federation.builder import RunSpec

    return RunSpec(name=f"bench{num_clients}", out_dir=out_dir, seed=0,
                   algorithm=HASFL(t_warm=1, t_adapt=1, log_layers=False),
                   data=DataConfig(dataset=Synthetic(num_train=20000, num_test=200, image_size=16,
                                                     channels=3)),
                   partition=PartitionConfig(method="iid", num_clients=num_clients),
                   model={"class_path": "fl_lightning.elastic.models.CNN"},
                   train=LocalTrainConfig(steps=5, batch_size=16, lr=0.05),
                   federation=FederationConfig(rounds=rounds, clients_per_round=10),
                   eval=EvalConfig(every=1000), fabric=FabricConfig(accelerator="cpu", devices=1))


def federation(num_clients: int, out_dir: str):
    from lightning.fabric import Fabric

    from fl_lightning.federation.loop import Federation
    from fl_lightning.federation.run_dir import RunDir

    spec = make_spec(num_clients, out_dir)
    fabric = Fabric(accelerator="cpu", devices=1)
    fed = Federation(fabric, spec, RunDir(spec.out_dir, spec.name))
    fed._open_outputs()
    return fed


def bare_round(fed, plan) -> None:
    """The plan's sub-models as plain modules, trained with SGD on the same batches."""
    from fl_lightning.runtime.seeding import client_generator

    ctx = fed.ctx
    for task in plan.tasks:
        local = ctx.model.extract(task.spec).module
        opt = torch.optim.SGD(local.parameters(), lr=plan.lr)
        for x, y in ctx.shards[task.client].steps(ctx.train.steps, client_generator(ctx.seed, plan.round_idx, task.client)):
            opt.zero_grad()
            F.cross_entropy(local(x), y).backward()
            opt.step()


def time_ratio(rounds: int) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        fed = federation(20, tmp)
        fed.run_round(0)  # warm-up (and the end of HAS-FL's warm-up)
        full, bare = [], []
        for r in range(1, rounds + 1):
            plan = fed.algorithm.plan(r)
            start = time.perf_counter()
            bare_round(fed, plan)
            bare.append(time.perf_counter() - start)
            start = time.perf_counter()
            fed.run_round(r)
            full.append(time.perf_counter() - start)
        full.sort(), bare.sort()
        f, b = full[len(full) // 2], bare[len(bare) // 2]
        print(f"HAS-FL round {f * 1e3:.1f} ms, bare sub-model loop {b * 1e3:.1f} ms, ratio {f / b:.3f} (target <= 1.15)")


def peak_rss_mb(num_clients: int) -> float:
    code = ("import sys, resource, tempfile; sys.path.insert(0, 'benchmarks'); import torch; torch.set_num_threads(1);"
            "from hasfl_round_cost import federation\n"
            f"tmp = tempfile.mkdtemp(); fed = federation({num_clients}, tmp)\n"
            "for r in range(6): fed.run_round(r)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.memory:
        small, large = peak_rss_mb(20), peak_rss_mb(1000)
        print(f"peak RSS: 20 clients {small:.0f} MB, 1,000 clients {large:.0f} MB, ratio {large / small:.3f} (target < 1.1)")
    else:
        time_ratio(args.rounds)


if __name__ == "__main__":
    main()
