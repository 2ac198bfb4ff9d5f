"""The main job's slice of ``benchmarks/device_check.sh``: FEAST on CIFAR-100 as
``configs/feast_cifar100.yaml`` runs it (the 55.7M-parameter supernet, RandAugment(2, 6),
Mixup/CutMix, 10 clients a round), on generated 32x32 uint8 images written in CIFAR-100's
on-disk format, 2 rounds of the 4,000-round schedule. One line per check:

1. ``main-job-fp32``, ``main-job-bf16``: ``benchmarks/main_job_round.py --rounds 2`` in float32
   (with round 1's validation of every cached variant) and under ``bf16-mixed``. PASS when the
   run finishes with finite losses: on CUDA ``torch.cuda.set_sync_debug_mode("error")`` is on in
   every training step, so a host synchronisation there fails the run. The line holds the
   instrument's summary (dispatches per step, host syncs per client, main-process CPU per
   example, peak memory) and its phase seconds.
2. ``shared-device``: the same 2 rounds as ``fit`` with 2 ranks on the one device
   (``--fabric.ranks_per_device 2``: gloo between them). On a CPU its model must equal the
   1-rank run's bit for bit (the rank-invariant round); on a GPU, whose kernels need not be
   deterministic, the largest difference is shown. Round 1's time beside the 1-rank run's.
3. ``two-gpus`` (2 or more GPUs): 2 ranks, one per GPU (NCCL), round 1's time.
4. ``main-job-throughput``: training MACs per second of FEAST's round 1 (``sum/train_macs``
   over ``round_seconds`` of ``metrics.jsonl``; kappa = 3 times the forward MACs of every
   variant trained on every batch) against a plain dense training loop of the largest cached
   variant, extracted as a static network, on the same device, batch 64, SGD with momentum,
   same precision (3 x its forward MACs x 64 per step), per precision.

``smoke`` shrinks every size (a narrowed supernet with a searched cache, 1,500 / 200 images, 2
clients of 2 steps) so that the whole slice runs on a CPU in a minute: it shows the slice runs,
not what a GPU does.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/feast_cifar100.yaml"
ROUNDS = 2
DENSE_BATCH = 64
DENSE_STEPS, DENSE_WARMUP = 20, 5
FULL_DATA = (50_000, 10_000)
SMOKE_DATA = (1_500, 200)
SMOKE = ["--data.val_size", "100", "--data.calib_size", "50", "--partition.num_clients", "10",
         "--federation.clients_per_round", "2", "--train.steps", "2", "--train.batch_size", "8",
         "--model.init_args.width_scale", "0.25", "--model.init_args.max_extra_blocks", "1",
         "--model.init_args.divisor", "2", "--algorithm.init_args.cache", "null",
         "--algorithm.init_args.search.population", "8", "--algorithm.init_args.search.generations", "2",
         "--algorithm.init_args.search.segments", "[[2000000, 18000000, 3, 0.25], [800000, 800000, 1, 0.40]]",
         "--partition.budgets.b_min", "800000", "--partition.budgets.b_max", "48000000",
         "--partition.budgets.b_cap", "18000000"]
"""The narrowed supernet of configs/quickstart.yaml on 32x32 CIFAR-100 inputs, its budgets and
search segments scaled by the 4x MACs of the larger image; a cache searched at start-up."""
SUMMARY = re.compile(r"^dispatches/step (\S+) \(before (\S+), ratio (\S+)\); host syncs/client (\S+); "
                     r"main-process CPU/example (\S+) ms; peak memory (\S+) GB$")
PHASE_ROW = re.compile(r"^(\S.*?)\s+(-?[0-9.]+)\s+(-?[0-9.]+)\s+(\d+)$")
FIT_SCHEDULE = ["--stop_after", str(ROUNDS)]
"""The instrument's schedule for a plain fit: the config's rounds and evaluation, stopped after 2."""


def run_main_job_checks(out: Path, accelerator: str, smoke: bool, run_command: Callable, fit: Callable,
                        say: Callable[[str], str]) -> List[str]:
    """The slice's checks; ``run_command`` and ``fit`` run a process within the device check's
    time limits (``device_check.py``)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from main_job_round import write_cifar

    data = out / "main_job_data"
    write_cifar(data, "cifar100", *(SMOKE_DATA if smoke else FULL_DATA))
    scale = [*(SMOKE if smoke else []), "--data.root", str(data), "--data.download", "false",
             "--data.dataset.init_args.skip_integrity_check", "true", "--fabric.accelerator", accelerator]
    lines = []
    runs = {}
    for precision, extra in (("fp32", ["--eval.every", str(ROUNDS)]), ("bf16", ["--fabric.precision", "bf16-mixed"])):
        folder = out / f"main_{precision}"
        command = [sys.executable, str(ROOT / "benchmarks" / "main_job_round.py"), "--config", CONFIG,
                   "--rounds", str(ROUNDS), "--out", str(folder), *scale, *extra]
        runs[precision] = run_command(command, folder / "main_job_round", stdout=subprocess.PIPE)
        lines.append(say(instrument_line(f"main-job-{precision}", runs[precision])))
    config = [CONFIG, *scale]
    shared = fit(config, out, "main_shared", ["--fabric.devices", "1", "--fabric.ranks_per_device", "2"], ROUNDS,
                 schedule=FIT_SCHEDULE, data_root=data)
    lines.append(say(shared_line(shared, runs["fp32"], accelerator)))
    gpus = gpu_count() if accelerator == "cuda" else 0
    if gpus >= 2:
        two = fit(config, out, "main_two_gpus", ["--fabric.devices", "2"], ROUNDS, schedule=FIT_SCHEDULE,
                  data_root=data)
        lines.append(say(two_gpus_line(two, runs["fp32"])))
    lines.append(say(throughput_line(runs, config, accelerator)))
    return lines


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ------------------------------------------------------------------------------------------
# Lines
# ------------------------------------------------------------------------------------------

def instrument_line(label: str, run) -> str:
    """The instrument's summary and phase seconds; FAIL when it did not finish or a loss is not finite."""
    if run.error:
        return f"FAIL {label}: did not finish ({run.error})"
    summary = next((line for line in reversed(run.stdout.splitlines()) if SUMMARY.match(line)), None)
    if summary is None:
        return f"FAIL {label}: the instrument printed no summary line ({last_words(run.stdout)})"
    losses = [row.get("train_loss") for row in run.rows]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in losses):
        return f"FAIL {label}: non-finite training loss {losses}"
    phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phase_seconds(run.stdout))
    return (f"PASS {label}: {ROUNDS} rounds, round seconds {', '.join(f'{s:.2f}' for s in run.round_seconds)}; "
            f"{summary}; phases: {phases}")


def phase_seconds(stdout: str) -> List[tuple]:
    """(phase, wall seconds) from the instrument's phase table."""
    rows, inside = [], False
    for line in stdout.splitlines():
        if line.startswith("phase "):
            inside = True
            continue
        match = PHASE_ROW.match(line) if inside else None
        if inside and match is None:
            break
        if match:
            rows.append((match.group(1), float(match.group(2))))
    return rows


def last_words(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def model_difference(a: Path, b: Path) -> float:
    """The largest absolute difference between two checkpoints' model tensors."""
    import torch

    first = torch.load(a, map_location="cpu", weights_only=False)["model"]
    second = torch.load(b, map_location="cpu", weights_only=False)["model"]
    if first.keys() != second.keys():
        return math.inf
    return max(((first[k].double() - second[k].double()).abs().max().item() for k in first if first[k].numel()),
               default=0.0)


def shared_line(shared, alone, accelerator: str) -> str:
    label = "shared-device"
    for run, words in ((shared, "2 ranks on one device"), (alone, "the 1-rank run")):
        if run.error:
            return f"FAIL {label}: {words} did not finish ({run.error})"
    checkpoint = Path("checkpoints") / "last.ckpt"
    difference = model_difference(alone.folder / checkpoint, shared.folder / checkpoint)
    times = (f"round 1 {shared.round_seconds[-1]:.2f} s with 2 ranks on one {accelerator} device vs "
             f"{alone.round_seconds[-1]:.2f} s with 1 rank")
    if accelerator == "cpu":
        verdict = "PASS" if difference == 0.0 else "FAIL"
        return f"{verdict} {label}: model after {ROUNDS} rounds equal to the 1-rank model's (largest difference " \
               f"{difference:.3g}, must be 0); {times}"
    return (f"INFO {label}: model after {ROUNDS} rounds, largest difference from the 1-rank model {difference:.3g} "
            f"(GPU kernels need not be deterministic); {times}")


def two_gpus_line(two, alone) -> str:
    if two.error or alone.error:
        return f"FAIL two-gpus: did not finish ({two.error or alone.error})"
    return (f"INFO two-gpus: round 1 {two.round_seconds[-1]:.2f} s with 2 ranks on 2 GPUs vs "
            f"{alone.round_seconds[-1]:.2f} s with 1 rank")


def throughput_line(runs: dict, config: List[str], accelerator: str) -> str:
    label = "main-job-throughput"
    parts = []
    for precision, run in runs.items():
        if run.error:
            return f"FAIL {label}: the {precision} run did not finish ({run.error})"
        last = run.rows[-1]
        feast = last["sum/train_macs"] / last["round_seconds"]
        cache = run.folder / "cache.json"
        dense, variant = dense_rate(config, cache, accelerator, precision)
        parts.append(f"{precision}: FEAST round 1 {rate(feast)} vs dense loop {rate(dense)}, ratio {feast / dense:.3f}")
    return f"INFO {label}: training MACs per second, largest cached variant {variant} as the dense loop " \
           f"(batch {DENSE_BATCH}); " + "; ".join(parts)


def rate(macs_per_second: float) -> str:
    for unit, scale in (("TMAC/s", 1e12), ("GMAC/s", 1e9)):
        if macs_per_second >= scale:
            return f"{macs_per_second / scale:.3f} {unit}"
    return f"{macs_per_second / 1e6:.3f} MMAC/s"


# ------------------------------------------------------------------------------------------
# The dense reference loop
# ------------------------------------------------------------------------------------------

def dense_rate(config: List[str], cache_path: Path, accelerator: str, precision: str) -> tuple:
    """(training MACs per second, its MACs in words) of a plain training loop of the largest
    variant of the run's cache: the static network ``extract`` makes, SGD with the config's
    momentum and weight decay, random inputs of the data's shape, batch 64; timed over
    ``DENSE_STEPS`` steps after ``DENSE_WARMUP``; one CPU thread on a CPU, as fit's rank."""
    import torch
    import torch.nn.functional as F

    from fl_lightning.cli import parse_command
    from fl_lightning.elastic.models import build_model
    from fl_lightning.elastic.search.cache import VariantCache

    _, args, _ = parse_command(["fit", "--config", str(ROOT / config[0]), *config[1:]])
    cache = VariantCache.load(cache_path)
    device = torch.device("cuda" if accelerator == "cuda" else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as fit's one CPU rank (threads_per_rank auto)
    largest = max(range(len(cache.macs)), key=lambda j: cache.macs[j])
    supernet = build_model(args.model, cache.num_classes, tuple(cache.input_shape))
    model = supernet.extract(cache.specs[largest]).module.to(device).train()
    del supernet
    t = args.train
    optimizer = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    inputs = torch.randn(DENSE_BATCH, *cache.input_shape, device=device)
    targets = torch.randint(cache.num_classes, (DENSE_BATCH,), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step():
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = F.cross_entropy(model(inputs).float(), targets)
        loss.backward()
        optimizer.step()

    for _ in range(DENSE_WARMUP):
        step()
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    started = time.perf_counter()
    for _ in range(DENSE_STEPS):
        step()
    synchronize()
    seconds = time.perf_counter() - started
    macs = cache.macs[largest]
    return 3 * macs * DENSE_BATCH * DENSE_STEPS / seconds, f"{macs / 1e6:.1f}M MACs"
