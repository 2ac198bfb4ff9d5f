"""How many ranks and threads a run takes when its config leaves that to the machine (``auto``).

``fabric.devices: auto`` (the default) means, for ``fit`` from the command line:

- on CPU, one rank per physical core this process may run on, never more than the cohort
  (``federation.clients_per_round``: a rank without a client only waits), and no more than fit
  in the available memory (each rank holds the data, the global model and its training state);
- on a GPU node, every visible GPU (again at most the cohort);
- one rank for sequential-client methods (their whole cohort trains on rank 0), for
  ``evaluate`` and ``extract``, and for a run started from Python (``run_fit`` on a RunSpec):
  Fabric starts ranks by re-running the command line, which only ``python -m fl_lightning``
  can safely have done to it.

``threads_per_rank: auto`` is 1 (results do not depend on the rank count), except for
sequential-client methods on CPU, which take every physical core on their one rank, whatever
``devices`` is, so that their results do not depend on it either.

The per-rank memory figure is an estimate from the model's parameter count (built on the meta
device: no memory, no time) and the dataset's size, with the constants measured by
``benchmarks/machine_defaults.py --memory``; an explicit ``devices`` that would not fit is
refused in one line before anything is loaded.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from fl_lightning.config import DataConfig, FabricConfig
from fl_lightning.errors import ConfigError

PLACEMENT_ENV = "FL_LIGHTNING_PLACEMENT"
"""Set by rank 0 for the ranks it starts, so that they take its placement instead of probing
a machine on which rank 0 already holds memory."""

# Measured by benchmarks/machine_defaults.py --memory (peak RSS of the largest CPU rank, one
# round): a rank with a small model and dataset peaks at 0.93-1.06 GB (Python, torch and
# Lightning's libraries, the loop), and the paper-scale FEAST supernet (55.7M parameters and
# buffers, 76 MB of data) at 4.27 GB, i.e. about 57 bytes per parameter (the global model, the
# reusable worker, gradients, momentum, routed envelopes, float64 value and count accumulators,
# the all-reduce buffer). Rounded up, so that the estimate stays above what was measured.
RANK_BASE_BYTES = 2**30
BYTES_PER_PARAMETER = 64
GB = 2**30

@dataclass(frozen=True)
class Machine:
    cores: int
    """Physical cores this process may run on."""
    memory: Optional[int]
    """Bytes available to new processes (MemAvailable, or the cgroup's limit if lower); None
    when unknown."""
    gpus: int
    """Visible CUDA GPUs."""

    @classmethod
    def probe(cls) -> "Machine":
        import torch

        return cls(physical_cores(), available_memory(), torch.cuda.device_count() if torch.cuda.is_available() else 0)


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads of one core count
    once), from the affinity mask and /sys's topology; the logical count where that is unknown."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topology}/physical_package_id") as package, open(f"{topology}/core_id") as core:
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def available_memory() -> Optional[int]:
    """MemAvailable from /proc/meminfo, lowered to what the cgroup (v2 or v1) still allows."""
    found = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    found = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as limit, open(usage_file) as usage:
                text = limit.read().strip()
                if text != "max" and int(text) < 2**60:
                    room = int(text) - int(usage.read().strip())
                    found = room if found is None else min(found, room)
            break
        except (OSError, ValueError):
            continue
    return found


def dataset_facts(data: DataConfig) -> Tuple[int, tuple, int]:
    """(classes, input shape, bytes of the examples a rank holds) of ``data``, estimated (each
    dataset class states its own: ``DatasetSource.footprint``)."""
    return data.source().footprint()


def parameter_count(model, classes: int, input_shape: tuple) -> int:
    """Parameters and buffers of the global model, built on the meta device (no memory)."""
    import torch

    from fl_lightning.elastic.models import build_model

    with torch.device("meta"):
        built = build_model(model, classes, input_shape)
    return sum(t.numel() for t in built.state_dict().values())


@dataclass(frozen=True)
class Footprint:
    """Estimated peak host memory of one rank."""

    parameters: int
    data_bytes: int

    @property
    def per_rank(self) -> int:
        return RANK_BASE_BYTES + BYTES_PER_PARAMETER * self.parameters + self.data_bytes

    @classmethod
    def of(cls, model, data: DataConfig) -> "Footprint":
        classes, shape, data_bytes = dataset_facts(data)
        return cls(parameter_count(model, classes, shape), data_bytes)


@dataclass(frozen=True)
class Placement:
    devices: int
    threads: Optional[int]
    line: str
    """One line for the start-up: what the run takes and why."""
    strategy: Optional[str] = None
    """A strategy replacing ``auto`` (ddp_fork for several CPU ranks), else None."""

    def apply(self, fabric: FabricConfig) -> FabricConfig:
        return replace(fabric, devices=self.devices, threads_per_rank=self.threads,
                       strategy=self.strategy or fabric.strategy)


def uses_gpu(fabric: FabricConfig, machine: Machine) -> bool:
    return fabric.accelerator in ("cuda", "gpu") and machine.gpus > 0 or (fabric.accelerator == "auto"
                                                                            and machine.gpus > 0)


def resolve_threads(threads, sequential: bool, on_gpu: bool, cores: int) -> Optional[int]:
    """``threads_per_rank`` as a number (or None: Lightning's rule)."""
    if threads != "auto":
        return threads
    return cores if sequential and not on_gpu else 1


def place(fabric: FabricConfig, cohort: int, sequential: bool, footprint: Footprint, machine: Machine,
          launchable: bool = True) -> Placement:
    """Ranks and threads per rank for ``fit``; refuses (ConfigError) when they would not fit.

    ``cohort`` is the largest number of clients a round trains; ``launchable`` is False when
    Fabric cannot start ranks by re-running the command line (a run started from Python).
    """
    gpu = uses_gpu(fabric, machine)
    threads = resolve_threads(fabric.threads_per_rank, sequential, gpu, machine.cores)
    per_rank = footprint.per_rank
    budget = machine.memory
    need = f"about {per_rank / GB:.2f} GB per rank ({footprint.parameters / 1e6:.2f}M parameters, " \
           f"{footprint.data_bytes / GB:.2f} GB of data)"
    have = f"{budget / GB:.1f} GB available" if budget is not None else "available memory unknown"
    fits = budget // per_rank if budget is not None else None
    if fabric.devices != "auto":
        devices = int(fabric.devices)
        host_ranks = 1 if gpu else devices  # a GPU rank's model lives on its GPU
        if fits is not None and host_ranks > fits:
            fewer = f"use --fabric.devices {fits} or fewer" if fits >= 1 else "a smaller model or dataset"
            raise ConfigError("fabric.devices", f"{devices} rank(s) need {need}, {host_ranks * per_rank / GB:.1f} GB "
                                                f"in all, but {have}; {fewer}")
        why = "as configured"
    else:
        if sequential:
            devices, why = 1, "auto: sequential-client method, its cohort trains on one rank"
        elif not launchable:
            devices, why = 1, "auto: started from Python, not the command line"
        elif gpu:
            devices, why = max(1, min(machine.gpus, cohort)), f"auto: {machine.gpus} GPU(s), cohort {cohort}"
        else:
            devices = max(1, min(machine.cores, cohort))
            why = f"auto: {machine.cores} physical core(s), cohort {cohort}"
            if fits is not None and fits < devices:
                devices = max(1, fits)
                why += f", lowered to {devices} by memory"
        if not gpu and fits is not None and fits < 1:  # no rank count helps: the model or data is too big
            key = "model" if BYTES_PER_PARAMETER * footprint.parameters >= footprint.data_bytes else "data.dataset"
            raise ConfigError(key, f"one rank needs {need}, but {have}")
    # Several CPU ranks on one node are forked from this process once it has imported and
    # checked everything: re-running the command per rank (Fabric's ddp launcher) would repeat
    # several seconds of imports before the first round. The ranks compute exactly as under ddp.
    strategy = None
    if (fabric.strategy == "auto" and not gpu and devices > 1 and fabric.num_nodes == 1
            and fabric.accelerator in ("auto", "cpu") and can_fork()):
        strategy = "ddp_fork"
    where = "gpu" if gpu else "cpu"
    thread_words = "" if gpu else f" x {threads if threads is not None else 'cores/ranks'} thread(s)"
    line = f"fit: {devices} rank(s){thread_words} on {where} ({why}; {need}, {have})"
    return Placement(devices, threads, line, strategy)


def can_fork() -> bool:
    import multiprocessing

    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def launched_by_command_line() -> bool:
    """True in ``python -m fl_lightning``: Fabric can start the other ranks by re-running it."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec is not None and spec.name in ("fl_lightning.__main__", "fl_lightning")


def placement_for(fabric: FabricConfig, model, data: DataConfig, cohort: int,
                  sequential: bool) -> Placement:
    """``place`` on this machine; a rank started by rank 0 takes rank 0's placement."""
    inherited = os.environ.get(PLACEMENT_ENV)
    if inherited and os.environ.get("LOCAL_RANK", "0") != "0":
        devices, threads = json.loads(inherited)
        return Placement(devices, threads, "")
    machine = Machine.probe()
    return place(fabric, cohort, sequential, Footprint.of(model, data), machine, launched_by_command_line())


def hand_down(placement: Placement) -> None:
    """Make ``placement`` the one of the ranks this process is about to start."""
    os.environ[PLACEMENT_ENV] = json.dumps([placement.devices, placement.threads])


def process_age() -> float:
    """Seconds since this process started (from /proc; since first import where unavailable)."""
    try:
        with open("/proc/self/stat") as stat:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            up = float(uptime.read().split()[0])
        return max(0.0, up - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()
