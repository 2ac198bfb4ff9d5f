"""What a plain ``fit`` gets from the machine by default (``fabric.devices`` / ``threads_per_rank`` auto).

Part 1 (always): the equal-work ResNet-sized round (ResNet-18 at width 0.25 on the MNIST subset,
20 iid clients, 10 per round, 1 local epoch of batch 32, SGD with momentum 0.9;
``configs/split/offline/mnist_subset/resnet18_narrow/fedavg.yaml`` with those overrides) run
through the command line at default settings, against a bare all-core PyTorch loop on the same
batches: one process per rank the default chose (one thread each), each training the same share
of the same clients, started together. Prints the steady-round ratio (target <= 1.10).

Part 2 (``--startup``): seconds from the command's start to round 0 (imports, checks, data,
model, rank launch: the "ready" line of ``fit``) for the offline configs, at defaults and with
one rank.

Part 3 (``--memory``): peak resident memory of the largest rank, against the per-rank estimate
that ``devices: auto`` uses, for the offline configs and the paper-scale FEAST supernet
(55.68M parameters, ``configs/feast_cifar100.yaml``'s model and algorithm on 32x32 synthetic
images with 100 classes, since CIFAR-100 cannot be downloaded here).

    python benchmarks/machine_defaults.py [--rounds 4] [--repeats 2] [--startup] [--memory]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _timing import median  # noqa: E402

from fl_lightning.data.federated import build_federated_data  # noqa: E402
from fl_lightning.federation.builder import RunSpec, build_global_model  # noqa: E402
from fl_lightning.federation.machine import GB, Machine  # noqa: E402
from fl_lightning.runtime.client_data import ClientData  # noqa: E402
from fl_lightning.runtime.seeding import balanced_share, client_generator, sample_clients  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESNET = "configs/split/offline/mnist_subset/resnet18_narrow/fedavg.yaml"
EQUAL_WORK = ["--model.width", "0.25", "--partition.method", "iid", "--partition.num_clients", "20",
              "--federation.clients_per_round", "10", "--train.epochs", "1", "--train.batch_size", "32",
              "--train.momentum", "0.9"]
# Run past the measured rounds without evaluating: no final evaluation, no checkpoint until the end.
NO_EVAL = ["--federation.rounds", "1000", "--eval.every", "1000", "--checkpoint_every", "1000"]
OFFLINE = ["configs/quickstart.yaml", "configs/fedavg_digits.yaml", RESNET]
FEAST_PAPER = ["configs/feast_cifar100.yaml", "--data.randaugment", "null",
               "--data.dataset", "{class_path: fl_lightning.data.Synthetic, init_args: {num_classes: 100, image_size: 32, "
               "channels: 3, num_train: 6000, num_test: 200}}",
               "--data.val_size", "200", "--data.calib_size", "100", "--partition.min_size", "1", "--train.steps", "2"]


def fit(args, out: str, name: str, measure_memory: bool = False) -> subprocess.CompletedProcess:
    """``python -m fl_lightning fit`` (in a wrapper reporting the largest process's peak RSS)."""
    command = [sys.executable, "-m", "fl_lightning", "fit", "--config", *args, "--out_dir", out, "--name", name]
    if measure_memory:
        wrapper = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
                   "print('maxrss_kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
                   "sys.exit(code)")
        command = [sys.executable, "-c", wrapper, *command]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"fit failed: {' '.join(command)}\n{done.stderr[-3000:]}")
    return done


def round_seconds(run: Path) -> list:
    return [json.loads(line)["round_seconds"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def ranks_of(stderr: str) -> int:
    return int(re.search(r"fit: (\d+) rank\(s\)", stderr).group(1))


# -- part 1: the bare all-core loop --------------------------------------------------------------
def _bare_rank(rank: int, world: int, spec: RunSpec, rounds: int, barrier, results) -> None:
    torch.set_num_threads(1)
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    model = build_global_model(spec, fed)
    t = spec.train
    for r in range(rounds):
        cohort = sample_clients(spec.seed, r, spec.partition.num_clients, spec.federation.clients_per_round)
        batches = []
        sizes = [len(fed.clients[c]) for c in cohort]  # the loop's default split: by examples
        for c in balanced_share(cohort, sizes, rank, world):  # materialized outside the timed region
            data = ClientData(fed.bundle.train, fed.clients[c], t.batch_size)
            batches.append(list(data.epoch(client_generator(spec.seed, r, c))))
        barrier.wait()
        start = time.perf_counter()
        for client_batches in batches:
            opt = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum)
            for x, y in client_batches:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        results.put((r, rank, start, time.perf_counter()))


def bare_round_seconds(spec: RunSpec, world: int, rounds: int) -> list:
    """Per round: from the common start to the last rank's end, ``world`` forked processes."""
    context = mp.get_context("fork")
    barrier, results = context.Barrier(world), context.Queue()
    procs = [context.Process(target=_bare_rank, args=(rank, world, spec, rounds, barrier, results))
             for rank in range(world)]
    for p in procs:
        p.start()
    spans = {}
    for _ in range(world * rounds):
        r, _, start, end = results.get()
        lo, hi = spans.get(r, (start, end))
        spans[r] = (min(lo, start), max(hi, end))
    for p in procs:
        p.join()
    return [spans[r][1] - spans[r][0] for r in range(rounds)]


def equal_work_spec(out: str) -> RunSpec:
    """The round's RunSpec exactly as ``fit`` parses the config and overrides."""
    from fl_lightning.cli import parse_command

    _, spec, _ = parse_command(["fit", "--config", str(ROOT / RESNET), *EQUAL_WORK, "--data.root", str(ROOT / "data")])
    spec.name, spec.out_dir = "bare", out
    return spec


def part_equal_work(out: str, rounds: int, repeats: int) -> None:
    spec = equal_work_spec(out)
    fed_times, bare_times, ranks = [], [], 1
    for rep in range(repeats):  # interleaved, so that machine noise hits both alike
        done = fit([RESNET, *EQUAL_WORK, *NO_EVAL, "--stop_after", str(rounds)], out, f"default{rep}")
        ranks = ranks_of(done.stderr)
        fed_times += round_seconds(Path(out) / f"default{rep}")[1:]
        bare_times += bare_round_seconds(spec, ranks, rounds)[1:]
    fed, bare = median(fed_times), median(bare_times)
    print("equal-work round (ResNet-18 x0.25, MNIST subset, 10 of 20 iid clients, 1 epoch of 32, momentum 0.9):")
    print(f"  fit at defaults ({ranks} rank(s) x 1 thread): {fed:.3f} s   bare loop ({ranks} process(es) x 1 thread, "
          f"same clients and batches): {bare:.3f} s")
    print(f"  default/bare ratio: {fed / bare:.3f}  (target <= 1.10)")


# -- part 2: start-up ------------------------------------------------------------------------------
def import_floor() -> float:
    """Seconds a bare interpreter takes to import the dependencies every run needs (torch,
    torchvision, Lightning Fabric): the part of start-up this project cannot shorten."""
    begin = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, torchvision, lightning.fabric"], check=True)
    return time.perf_counter() - begin


def part_startup(out: str) -> None:
    print("start-up to round 0 (the 'ready' line; imports, checks, launch, data, model, algorithm set-up),")
    print("each beside the dependencies' bare import time measured just before it:")
    for config in OFFLINE:
        for label, extra in (("default", []), ("1 rank", ["--fabric.devices", "1"])):
            name = f"start{abs(hash((config, label)))}"
            floor = import_floor()
            done = fit([config, *NO_EVAL, "--stop_after", "1", *extra], out, name)
            ready = re.search(r"ready for round 0 after ([0-9.]+) s.*", done.stderr)
            above = float(ready.group(1)) - floor
            print(f"  {config} [{label}, {ranks_of(done.stderr)} rank(s)]: {ready.group(0)}; "
                  f"bare imports {floor:.1f} s, the project's own share {above:.1f} s")


# -- part 3: memory ----------------------------------------------------------------------------------
def part_memory(out: str) -> None:
    print("peak resident memory of the largest rank vs the per-rank estimate of devices: auto:")
    machine = Machine.probe()
    cases = [(c, [c]) for c in OFFLINE] + [("FEAST paper supernet (55.68M) on synthetic 32x32x100", FEAST_PAPER)]
    for label, args in cases:
        for extra in ([], ["--fabric.devices", "1"]):
            name = f"mem{abs(hash((label, tuple(extra))))}"
            done = fit([*args, *NO_EVAL, "--stop_after", "1", *extra], out, name, measure_memory=True)
            peak = int(re.search(r"maxrss_kb (\d+)", done.stderr).group(1)) * 1024
            line = re.search(r"fit: .*", done.stderr).group(0)
            estimate = re.search(r"about ([\d.]+) GB per rank", line).group(1)
            ranks = ranks_of(done.stderr)
            print(f"  {label} [{ranks} rank(s)]: peak {peak / GB:.2f} GB per rank, {ranks * peak / GB:.2f} GB for "
                  f"{ranks}; estimate {estimate} GB per rank; {machine.memory / GB:.1f} GB available")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds per measurement (the first is warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating repetitions of part 1")
    parser.add_argument("--startup", action="store_true", help="also part 2: start-up of the offline configs")
    parser.add_argument("--memory", action="store_true", help="also part 3: peak memory per rank")
    parser.add_argument("--skip-round", action="store_true", help="skip part 1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        if not args.skip_round:
            part_equal_work(out, args.rounds, args.repeats)
        if args.startup:
            part_startup(out)
        if args.memory:
            part_memory(out)


if __name__ == "__main__":
    main()
