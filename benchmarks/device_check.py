"""The accelerator check behind ``benchmarks/device_check.sh``: one CUDA GPU against the CPU.

Prints one line per check (PASS, FAIL or INFO) and a last line with the count; exit status 0
when every check passed, 1 when one failed, 2 when there is no CUDA GPU to check (one line,
nothing run or written). At most 8 minutes on one H200 (each run has a time limit; a run left
without time is a FAIL line saying so).

1. ``quickstart-cuda-vs-cpu``: ``configs/quickstart.yaml`` (FEAST), 6 rounds, one CUDA rank
   against one CPU rank, same config and seed.
2. ``resnet18-cuda-vs-cpu``: the equal-work FedAvg round of ``machine_defaults.py`` (ResNet-18
   width 0.25, MNIST subset, 10 of 20 iid clients, 1 epoch of batch 32, momentum 0.9), 2 rounds.
3. ``bf16-mixed``: check 2 on CUDA with ``--fabric.precision bf16-mixed``: finite, and within
   ``BF16_POINTS`` of the float32 CUDA run.
4. ``round-time``: steady round time (median of rounds 1..5 of 6, ``round_seconds`` of
   ``metrics.jsonl``) of the equal-work round and of the quick start, CUDA at default settings
   (TF32 as PyTorch leaves it) beside one CPU rank.
5. ``gpu-utilization``: nvidia-smi's utilization.gpu sampled every 100 ms over the steady
   rounds of the equal-work run (from its first logged round to its end).
6. ``peak-memory``: ``torch.cuda.max_memory_allocated`` of the equal-work run and of the quick
   start, and nvidia-smi's largest memory.used (CUDA context included).

Tolerance of checks 1-2. The CPU and the GPU run the same float32 operations in other orders
(TF32 is switched off for these runs with NVIDIA_TF32_OVERRIDE=0, so both sides are float32
throughout). Two CPU runs that differ only in their intra-op thread count also sum in other
orders; their difference is what reordering alone does to this config after these rounds. So
the CPU runs twice (1 and 2 threads) and the GPU result must lie within 3 times that
difference of the 1-thread result, and in any case within one standard error of the test
accuracy (sqrt(p (1 - p) / n) over the n test examples: a difference below it is invisible to
any comparison the project makes), for the test loss 2 % of its value.

7. The main job's slice (``benchmarks/main_job_check.py``): FEAST CIFAR-100 with the 55.7M
   supernet on generated images, 2 rounds in float32 and bf16 through
   ``benchmarks/main_job_round.py`` (sync debug on, phase seconds), 2 ranks sharing the device
   (and 2 GPUs where present), and FEAST's training MACs per second against a dense loop of the
   largest cached variant.

    benchmarks/device_check.sh [--out DIR] [--accelerator cpu] [--cpu-smoke] [--checks all|compare|main-job]

``--accelerator cpu`` rehearses every check on the CPU (the "GPU" runs on the CPU; no
nvidia-smi): it shows that the pipeline runs, not that the GPU does. ``--cpu-smoke`` does the
same at small sizes (1 compared round, 2 clients of 2 steps, the main job's slice on a narrowed
supernet), so that every part runs end to end in minutes; ``--checks`` picks checks 1-6
(compare) or 7 (main-job).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ["configs/quickstart.yaml"]
RESNET = "configs/split/offline/mnist_subset/resnet18_narrow/fedavg.yaml"
# machine_defaults.py's equal-work round; bn pinned: the served statistics the round is timed with
EQUAL_WORK = [RESNET, "--model.width", "0.25", "--partition.method", "iid", "--partition.num_clients", "20",
              "--federation.clients_per_round", "10", "--train.epochs", "1", "--train.batch_size", "32",
              "--train.momentum", "0.9", "--algorithm.bn", "aggregated"]
COMPARED_ROUNDS = {"quickstart": 6, "resnet18": 2}
"""Rounds before the comparison: the quick start is near chance after 2 rounds, the ResNet well above."""
TIMED_ROUNDS = 6
SMOKE_ROUNDS = {"quickstart": 1, "resnet18": 1}
SMOKE_TIMED_ROUNDS = 2
SMOKE_SCALE = ["--federation.clients_per_round", "2", "--train.steps", "2"]
"""``--cpu-smoke``: 1 compared round, 2 timed, 2 clients of 2 steps each."""
CHECK_GROUPS = ("all", "compare", "main-job")
BF16_POINTS = 0.05
"""bf16 keeps 8 significant bits (each product is off by up to 2^-9 = 0.2 %); the issue's "within a
few points" of the float32 result, as 5 points of test accuracy after the same rounds."""
RUN_LIMIT_S = 150
TOTAL_LIMIT_S = 7.5 * 60
"""Every run stops by then (the script's promise is 8 minutes, start-up and the last lines included);
``--minutes`` scales both limits (a rehearsal on a slow CPU)."""
PEAK = ("import atexit, runpy, sys, torch\n"
        "atexit.register(lambda: print('peak_cuda_bytes', torch.cuda.max_memory_allocated() "
        "if torch.cuda.is_initialized() else 0, file=sys.stderr))\n"
        "sys.argv = ['fl_lightning', *sys.argv[1:]]\n"
        "runpy.run_module('fl_lightning', run_name='__main__', alter_sys=True)\n")


@dataclass
class Run:
    """One ``fit``: where it wrote, how it ended, and what it measured."""

    folder: Path
    code: int
    stderr: str
    seconds: float
    samples: List[tuple] = field(default_factory=list)
    """(utilization %, memory MiB) from nvidia-smi over the steady rounds."""
    memory_peak_mib: Optional[float] = None
    stdout: str = ""

    @property
    def error(self) -> Optional[str]:
        if self.code == 0:
            return None
        lines = [line for line in self.stderr.splitlines() if line.startswith("error:")]
        return lines[-1] if lines else f"exit status {self.code}: {last_line(self.stderr)}"

    @property
    def final(self) -> dict:
        return json.loads((self.folder / "summary.json").read_text())["final"]

    @property
    def rows(self) -> List[dict]:
        """The rows of ``metrics.jsonl``, one per round."""
        return [json.loads(line) for line in (self.folder / "metrics.jsonl").read_text().splitlines()]

    @property
    def round_seconds(self) -> List[float]:
        return [row["round_seconds"] for row in self.rows]

    @property
    def peak_cuda_bytes(self) -> Optional[int]:
        for line in self.stderr.splitlines():
            if line.startswith("peak_cuda_bytes "):
                return int(line.split()[1])
        return None


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


DEADLINE = [time.perf_counter() + TOTAL_LIMIT_S]
SCALE = [1.0]


def fit(config: List[str], out: Path, name: str, device: List[str], rounds: int, timed: bool = False,
        env: Optional[dict] = None, smi: Optional[str] = None, schedule: Optional[List[str]] = None,
        data_root: Optional[Path] = None) -> Run:
    """``python -m fl_lightning fit`` (through a wrapper that reports torch's peak CUDA memory);
    ``timed``: no evaluation, for steady round times; ``schedule``: these rounds and evaluation
    options instead; ``smi``: sample nvidia-smi meanwhile."""
    if schedule is None:
        schedule = (["--eval.every", "1000", "--checkpoint_every", "1000", "--federation.rounds", "1000",
                     "--stop_after", str(rounds)] if timed else
                    ["--federation.rounds", str(rounds), "--eval.every", str(rounds)])
    command = [sys.executable, "-c", PEAK, "fit", "--config", config[0], *config[1:], *schedule, *device,
               "--data.root", str(data_root or ROOT / "data"), "--out_dir", str(out), "--name", name]
    return run_command(command, out / name, env, smi)


def run_command(command: List[str], folder: Path, env: Optional[dict] = None, smi: Optional[str] = None,
                stdout=subprocess.DEVNULL) -> Run:
    """``command`` in the checkout's root within its share of the time limit; a run that writes
    into ``folder``. ``stdout``: where its standard output goes (kept in ``Run.stdout`` when PIPE)."""
    started = time.perf_counter()
    limit = min(RUN_LIMIT_S * SCALE[0], DEADLINE[0] - started)
    if limit < 10:
        return Run(folder, 1, "error: no time left for this run within the 8 minutes", 0.0)
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=stdout,
                               stderr=subprocess.PIPE, text=True)
    sampler = Sampler(smi, folder / "metrics.jsonl") if smi else None
    try:
        output, stderr = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        process.kill()
        output, stderr = process.communicate()
        stderr += f"\nerror: the run was stopped after {limit:.0f} s"
    run = Run(folder, process.returncode, stderr, time.perf_counter() - started, stdout=output or "")
    if sampler is not None:
        run.samples, run.memory_peak_mib = sampler.stop()
    return run


class Sampler:
    """nvidia-smi every 100 ms in a thread: memory.used from the start, utilization.gpu once the
    run has logged its first round (the steady rounds)."""

    def __init__(self, smi: str, metrics: Path):
        self.metrics, self.samples, self.peak = metrics, [], 0.0
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        self.process = subprocess.Popen([smi, "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                                         "-i", gpu, "-lms", "100"], stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            sample = parse_smi(line)
            if sample is None:
                continue
            self.peak = max(self.peak, sample[1])
            if self.metrics.is_file() and self.metrics.stat().st_size > 0:
                self.samples.append(sample)

    def stop(self) -> tuple:
        self.process.terminate()
        self.process.wait()
        self.thread.join(timeout=5)
        return self.samples, self.peak


def parse_smi(line: str) -> Optional[tuple]:
    """(utilization %, memory MiB) from a line of ``nvidia-smi --format=csv,noheader,nounits``."""
    parts = [p.strip() for p in line.split(",")]
    try:
        return float(parts[0]), float(parts[1])
    except (IndexError, ValueError):
        return None


def steady(seconds: List[float]) -> float:
    """Median round time without round 0 (warm-up: kernels chosen, caches filled)."""
    return statistics.median(seconds[1:] if len(seconds) > 1 else seconds)


def accuracy_tolerance(cpu: float, cpu_other: float, n: int) -> float:
    """3 times the CPU's own reordering spread, at least one standard error of the accuracy."""
    return max(3 * abs(cpu_other - cpu), math.sqrt(max(cpu * (1 - cpu), 1e-12) / n))


def loss_tolerance(cpu: float, cpu_other: float) -> float:
    return max(3 * abs(cpu_other - cpu), 0.02 * abs(cpu))


def finite(metrics: dict) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in metrics.values())


def compare(label: str, device: Run, cpu: Run, cpu_other: Run, n_test: int, rounds: int) -> str:
    """One line: the device's final test accuracy (and loss, where the method reports one)
    against the CPU's, with the tolerances."""
    for run in (device, cpu, cpu_other):
        if run.error:
            return f"FAIL {label}: {run.folder.name} did not finish ({run.error})"
    d, c, o = device.final, cpu.final, cpu_other.final
    if not finite(d):
        return f"FAIL {label}: non-finite metrics on the device {d}"
    tol = accuracy_tolerance(c["test_acc"], o["test_acc"], n_test)
    ok = abs(d["test_acc"] - c["test_acc"]) <= tol
    words = (f"test_acc {d['test_acc']:.4f} vs cpu {c['test_acc']:.4f} (2 threads {o['test_acc']:.4f}; "
             f"tolerance {tol:.4f})")
    if all("test_loss" in m for m in (d, c, o)):
        loss_tol = loss_tolerance(c["test_loss"], o["test_loss"])
        ok = ok and abs(d["test_loss"] - c["test_loss"]) <= loss_tol
        words += (f", test_loss {d['test_loss']:.4f} vs cpu {c['test_loss']:.4f} (2 threads {o['test_loss']:.4f}; "
                  f"tolerance {loss_tol:.4f})")
    return f"{'PASS' if ok else 'FAIL'} {label}: {words}, after {rounds} rounds on {n_test} test examples"


def test_examples(config: List[str]) -> int:
    """The size of the config's test set, as fit loads it."""
    from fl_lightning.cli import parse_command

    _, args, _ = parse_command(["fit", "--config", str(ROOT / config[0]), *config[1:],
                                "--data.root", str(ROOT / "data")])
    return len(args.data.source().load(args.data.root, args.data.download, False).test)


def no_cuda() -> Optional[str]:
    """Why CUDA cannot be checked here, or None."""
    try:
        import torch
    except ImportError as error:
        return f"torch cannot be imported ({error})"
    if not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA"
        return (f"no CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, built for {built}); "
                "run it on a machine with one")
    return None


def main(argv: Optional[List[str]] = None) -> int:
    sys.path.insert(0, str(ROOT / "src"))
    try:
        from fl_lightning.tool_parser import ToolParser
    except ImportError as error:
        print(f"device_check: fl_lightning cannot be imported ({error}); install the project first", file=sys.stderr)
        return 2
    parser = ToolParser(prog="device_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--accelerator", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: rehearse the checks without a GPU")
    parser.add_argument("--minutes", type=float, default=TOTAL_LIMIT_S / 60,
                        help="time limit of all runs together (each run's scales with it)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="every check on the CPU at small sizes: shows that each part runs end to end")
    parser.add_argument("--checks", choices=CHECK_GROUPS, default="all",
                        help="compare: the CUDA-vs-CPU comparisons, timings and memory; main-job: the main job's "
                             "slice (benchmarks/main_job_check.py); all: both")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.accelerator = "cpu"
    if not args.minutes > 0:
        print(f"device_check: error: minutes: must be > 0, got {args.minutes}", file=sys.stderr)
        return 2
    SCALE[0] = args.minutes * 60 / TOTAL_LIMIT_S
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        print(f"device_check: error: out: {args.out} is a file, not a folder", file=sys.stderr)
        return 2
    if args.accelerator == "cuda":
        problem = no_cuda()
        if problem:
            print(f"device_check: {problem}", file=sys.stderr)
            return 2
    started = time.perf_counter()
    out = args.out or Path(tempfile.mkdtemp(prefix="device_check-"))
    out.mkdir(parents=True, exist_ok=True)
    lines = run_checks(out, args.accelerator, args.cpu_smoke, args.checks)
    failed = sum(line.startswith("FAIL") for line in lines)
    print(f"device_check: {len(lines) - failed} of {len(lines)} checks passed in {time.perf_counter() - started:.0f} s "
          f"(runs in {out})", flush=True)
    if args.out is None and not failed:
        shutil.rmtree(out, ignore_errors=True)
    return 1 if failed else 0


def say(line: str) -> str:
    print(line, flush=True)
    return line


def run_checks(out: Path, accelerator: str, smoke: bool = False, checks: str = "all") -> List[str]:
    """Every check of ``checks`` (see ``CHECK_GROUPS``), one line each; ``smoke``: at small sizes."""
    DEADLINE[0] = time.perf_counter() + TOTAL_LIMIT_S * SCALE[0]
    lines: List[str] = []
    if checks in ("all", "compare"):
        lines += comparison_checks(out, accelerator, smoke)
    if checks in ("all", "main-job"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from main_job_check import run_main_job_checks

        lines += run_main_job_checks(out, accelerator, smoke, run_command, fit, say)
    return lines


def comparison_checks(out: Path, accelerator: str, smoke: bool = False) -> List[str]:
    """Checks 1-6 of the module's doc."""
    device = ["--fabric.accelerator", accelerator, "--fabric.devices", "1"]
    cpu = ["--fabric.accelerator", "cpu", "--fabric.devices", "1"]
    exact = {"NVIDIA_TF32_OVERRIDE": "0"}  # float32 on both sides (cuDNN and cuBLAS honour it)
    smi = shutil.which("nvidia-smi") if accelerator == "cuda" else None
    configs = {"quickstart": QUICKSTART, "resnet18": EQUAL_WORK}
    rounds, timed_rounds = (SMOKE_ROUNDS, SMOKE_TIMED_ROUNDS) if smoke else (COMPARED_ROUNDS, TIMED_ROUNDS)
    if smoke:
        configs = {key: [*config, *SMOKE_SCALE] for key, config in configs.items()}
    lines: List[str] = []
    compared = {}
    for label in ("quickstart-cuda-vs-cpu", "resnet18-cuda-vs-cpu"):
        key = label.split("-")[0]
        runs = [fit(configs[key], out, f"{key}_{name}", extra, rounds[key], env=exact)
                for name, extra in (("device", device), ("cpu1", [*cpu, "--fabric.threads_per_rank", "1"]),
                                    ("cpu2", [*cpu, "--fabric.threads_per_rank", "2"]))]
        compared[key] = runs
        lines.append(say(compare(label, *runs, test_examples(configs[key]), rounds[key])))
    bf16 = fit(configs["resnet18"], out, "resnet18_bf16", [*device, "--fabric.precision", "bf16-mixed"],
               rounds["resnet18"])
    lines.append(say(bf16_line(bf16, compared["resnet18"][0])))
    timed = {key: fit(configs[key], out, f"{key}_timed", device, timed_rounds, timed=True, smi=smi)
             for key in ("resnet18", "quickstart")}
    cpu_timed = {key: runs[1] for key, runs in compared.items()}
    lines.append(say(round_time_line(timed, cpu_timed, accelerator, timed_rounds)))
    lines.append(say(utilization_line(timed["resnet18"], smi, timed_rounds)))
    lines.append(say(memory_line(timed)))
    return lines


def bf16_line(bf16: Run, fp32: Run) -> str:
    if bf16.error or fp32.error:
        return f"FAIL bf16-mixed: {(bf16.error or fp32.error)}"
    b, f = bf16.final, fp32.final
    ok = finite(b) and abs(b["test_acc"] - f["test_acc"]) <= BF16_POINTS
    return (f"{'PASS' if ok else 'FAIL'} bf16-mixed: equal-work config, test_acc {b['test_acc']:.4f} vs float32 "
            f"{f['test_acc']:.4f} (at most {BF16_POINTS * 100:.0f} points apart), test_loss {b['test_loss']:.4f} vs "
            f"{f['test_loss']:.4f}, {'finite' if finite(b) else 'NOT finite'}")


def round_time_line(timed: dict, cpu: dict, accelerator: str, timed_rounds: int = TIMED_ROUNDS) -> str:
    parts = []
    for key, label in (("resnet18", "equal-work FedAvg round"), ("quickstart", "quick start round")):
        run = timed[key]
        if run.error:
            return f"FAIL round-time: {label} did not finish ({run.error})"
        on_cpu = f"{steady(cpu[key].round_seconds):.3f} s" if not cpu[key].error else "n/a"
        parts.append(f"{label} {steady(run.round_seconds):.3f} s on {accelerator} (median of rounds 1-"
                     f"{timed_rounds - 1}), {on_cpu} on one CPU thread")
    return "INFO round-time: " + "; ".join(parts)


def utilization_line(run: Run, smi: Optional[str], timed_rounds: int = TIMED_ROUNDS) -> str:
    if run.error:
        return f"FAIL gpu-utilization: the equal-work run did not finish ({run.error})"
    if not smi:
        return "INFO gpu-utilization: n/a (no nvidia-smi)"
    if not run.samples:
        return "INFO gpu-utilization: n/a (no nvidia-smi sample during the steady rounds)"
    used = [u for u, _ in run.samples]
    return (f"INFO gpu-utilization: equal-work rounds 1-{timed_rounds - 1}: mean {statistics.mean(used):.0f} %, "
            f"median {statistics.median(used):.0f} %, max {max(used):.0f} % over {len(used)} samples of 100 ms")


def memory_line(timed: dict) -> str:
    parts = []
    for key, label in (("resnet18", "equal-work"), ("quickstart", "quick start")):
        run = timed[key]
        if run.error:
            return f"FAIL peak-memory: {label} did not finish ({run.error})"
        peak = run.peak_cuda_bytes
        allocated = f"{peak / 2**20:.0f} MiB allocated by torch" if peak else "torch: n/a"
        smi = f", {run.memory_peak_mib:.0f} MiB used (nvidia-smi)" if run.memory_peak_mib else ""
        parts.append(f"{label} {allocated}{smi}")
    return "INFO peak-memory: " + "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
