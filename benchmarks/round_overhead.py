"""Cost of the federation machinery around local training, and client-level parallelism.

Part 1 times federated rounds of 10 clients (small CNN, 16/32/64 channels by default, 32x32
synthetic images, 48 examples per client, 5 local epochs of batch 16) and, in the same process, a bare PyTorch loop
doing the same forward and backward passes and SGD steps on the same batches. It prints the
ratio (target: at most 1.10).

Part 2 runs the same rounds through the CLI with 2 CPU ranks of one thread each and with
1 rank of two threads, and prints the speed-up of the former (target: at least 1.3).

    python benchmarks/round_overhead.py [--rounds 6] [--channels 16 32 64] [--skip-ranks]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fl_lightning.algorithms import FedAvg
from fl_lightning.config import (DataConfig, EvalConfig, FabricConfig, FederationConfig, LocalTrainConfig,
                                 PartitionConfig)
from fl_lightning.data import Synthetic
from fl_lightning.data.federated import build_federated_data
from fl_lightning.runtime.client_data import ClientData
from fl_lightning.federation.builder import RunSpec, build_global_model
from fl_lightning.federation.loop import run_fit
from fl_lightning.runtime.seeding import client_generator, sample_clients

CLIENTS, EXAMPLES_PER_CLIENT, EPOCHS, BATCH = 10, 48, 5, 16
# The registry's width-elastic CNN; --channels picks its size. The smaller it is, the worse a
# second thread helps each convolution, and the more client-level parallelism gains.
MODEL = {"class_path": "fl_lightning.elastic.models.CNN", "init_args": {"channels": [16, 32, 64]}}
DATA = DataConfig(dataset=Synthetic(num_classes=10, image_size=32, channels=3,
                                    num_train=CLIENTS * EXAMPLES_PER_CLIENT, num_test=200))
PARTITION = PartitionConfig(method="iid", num_clients=CLIENTS)
TRAIN = LocalTrainConfig(epochs=EPOCHS, batch_size=BATCH, lr=0.05, momentum=0.9)


def make_spec(out_dir: str, rounds: int, name: str, threads: int = 1) -> RunSpec:
    return RunSpec(name=name, out_dir=out_dir, seed=0, data=DATA, partition=PARTITION,
                   model=MODEL, train=TRAIN,
                   federation=FederationConfig(rounds=rounds, clients_per_round=CLIENTS),
                   eval=EvalConfig(every=10**6), fabric=FabricConfig(accelerator="cpu", threads_per_rank=threads),
                   algorithm=FedAvg(), checkpoint_every=10**6)


def round_seconds(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["round_seconds"] for r in rows]


def bare_round_seconds(spec: RunSpec, rounds: int) -> list[float]:
    """The same clients, batches, passes and SGD steps with no federation around them."""
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    model = build_global_model(spec, fed)
    times = []
    for r in range(rounds):
        cohort = sample_clients(spec.seed, r, CLIENTS, CLIENTS)
        batches = {}
        for c in cohort:  # materialized outside the timed region
            data = ClientData(fed.bundle.train, fed.clients[c], BATCH)
            gen = client_generator(spec.seed, r, c)
            batches[c] = [b for _ in range(EPOCHS) for b in data.epoch(gen)]
        start = time.perf_counter()
        for c in cohort:
            opt = torch.optim.SGD(model.parameters(), lr=TRAIN.lr, momentum=TRAIN.momentum)
            for x, y in batches[c]:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        times.append(time.perf_counter() - start)
    return times


def cli_round_seconds(out_dir: str, name: str, devices: int, threads: int, rounds: int) -> list[float]:
    args = [sys.executable, "-m", "fl_lightning", "fit", "--name", name, "--out_dir", out_dir,
            "--data.dataset", json.dumps({"class_path": "fl_lightning.data.Synthetic", "init_args": DATA.dataset.options()}),
            "--partition.method", "iid", "--partition.num_clients", str(CLIENTS),
            "--model", json.dumps(MODEL), "--train.epochs", str(EPOCHS), "--train.batch_size", str(BATCH),
            "--train.momentum", "0.9", "--federation.rounds", str(rounds),
            "--federation.clients_per_round", str(CLIENTS), "--eval.every", str(10**6),
            "--checkpoint_every", str(10**6), "--fabric.accelerator", "cpu",
            "--fabric.devices", str(devices), "--fabric.threads_per_rank", str(threads)]
    if devices > 1:
        args += ["--fabric.strategy", "ddp"]
    subprocess.run(args, check=True, capture_output=True)
    return round_seconds(Path(out_dir) / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds per measurement (the first is warm-up)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for part 1")
    parser.add_argument("--skip-ranks", action="store_true", help="skip part 2 (multi-process)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repetitions of part 2")
    parser.add_argument("--channels", type=int, nargs=3, default=[16, 32, 64], help="CNN channels per stage")
    args = parser.parse_args()
    MODEL["init_args"]["channels"] = args.channels
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as out:
        fed_times, bare_times = [], []
        # Interleave the two so that machine noise hits both alike.
        for rep in range(2):
            run_fit(make_spec(out, args.rounds, f"fl{rep}", args.threads))
            fed_times += round_seconds(Path(out) / f"fl{rep}")[1:]
            bare_times += bare_round_seconds(make_spec(out, args.rounds, "bare"), args.rounds)[1:]
        fed, bare = statistics.median(fed_times), statistics.median(bare_times)
        print(f"federated round: {fed * 1e3:.1f} ms   bare loop: {bare * 1e3:.1f} ms   "
              f"(cnn {args.channels}, {CLIENTS} clients x {EXAMPLES_PER_CLIENT} examples x {EPOCHS} epochs, batch {BATCH}, "
              f"{args.threads} threads)")
        print(f"round/bare ratio: {fed / bare:.3f}  (target <= 1.10)")
        if args.skip_ranks:
            return
        # Alternate the two set-ups a few times; thread scheduling makes single runs noisy.
        one_times, two_times = [], []
        for rep in range(args.repeats):
            one_times += cli_round_seconds(out, f"one_rank{rep}", 1, 2, args.rounds)[1:]
            two_times += cli_round_seconds(out, f"two_ranks{rep}", 2, 1, args.rounds)[1:]
        one, two = statistics.median(one_times), statistics.median(two_times)
        print(f"1 rank x 2 threads: {one * 1e3:.1f} ms/round   2 ranks x 1 thread: {two * 1e3:.1f} ms/round")
        print(f"client-parallel speed-up: {one / two:.2f}x  (target >= 1.3)")


if __name__ == "__main__":
    main()
