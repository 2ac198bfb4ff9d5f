"""How many ranks and threads a run takes when its config leaves that to the machine (``auto``).

``fabric.devices: auto`` (the default) means, for ``fit`` from the command line:

- on CPU, one rank per physical core this process may run on (per ``threads_per_rank`` cores
  when that is set above 1, so that ranks x threads fit the cores), never more than the cohort
  (``federation.clients_per_round``: a rank without a client only waits), and no more than fit
  in the available memory (each rank holds the data, the global model and its training state);
- on a GPU node, every visible GPU (again at most the cohort);
- under a launcher that started the ranks itself (torchrun, SLURM's srun), its count per node
  (``LOCAL_WORLD_SIZE``, ``SLURM_NTASKS_PER_NODE``), so that every node agrees;
- one rank for sequential-client methods (their whole cohort trains on rank 0), for
  ``evaluate`` and ``extract``, and for a run started from Python (``run_fit`` on a RunSpec):
  Fabric starts ranks by re-running the command line, which only ``python -m fl_lightning``
  can safely have done to it.

``threads_per_rank: auto`` is 1 (results do not depend on the rank count), except for
sequential-client methods on CPU, which take every physical core on their one rank, whatever
``devices`` is, so that their results do not depend on it either.

The per-rank memory figure is an estimate of what a rank holds at its peak, counted from the
config on the meta device (no memory, about a second for the 55.7M-parameter supernet):
the data, the global model, the float64 accumulator, the client's model, gradients and
momentum, and the activations of its costliest pass (``federation/memory.py``); an explicit
``devices`` that would not fit is refused in one line before anything is loaded.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Tuple

from fl_lightning.config import DataConfig, FabricConfig
from fl_lightning.errors import ConfigError

PLACEMENT_ENV = "FL_LIGHTNING_PLACEMENT"
"""Set by rank 0 for the ranks it starts, so that they take its placement instead of probing
a machine on which rank 0 already holds memory."""

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
    from fl_lightning.federation.memory import shapes_model

    return sum(t.numel() for t in shapes_model(model, classes, input_shape).state_dict().values())


@dataclass(frozen=True)
class Footprint:
    """Estimated peak host memory of one rank: what it holds then (``federation/memory.py``
    derives each term)."""

    parameters: int
    """Parameters and buffers of the global model (for the placement line)."""
    data_bytes: int
    holdings: Optional[Any] = field(default=None, compare=False)
    """``memory.Holdings``; None: a float32 model of ``parameters`` with its client state and
    accumulator, no activations (a footprint given by hand)."""
    model: Any = field(default=None, compare=False)
    """The model section and its (classes, input shape), to name the option that makes it large."""

    @property
    def per_rank(self) -> int:
        return self._holdings().total

    def _holdings(self):
        from fl_lightning.federation.memory import Holdings

        if self.holdings is not None:
            return self.holdings
        float32 = 4 * self.parameters
        return Holdings(self.data_bytes, float32, 2 * float32, 3 * float32, 0)

    @property
    def model_share(self) -> int:
        """Bytes of the terms that grow with the model (all but the data and the base)."""
        h = self._holdings()
        return h.total - h.data - self._base()

    @staticmethod
    def _base() -> int:
        from fl_lightning.federation.memory import RANK_BASE_BYTES

        return RANK_BASE_BYTES

    def model_key(self) -> str:
        """The config key to blame for the model's size (``model.<option>`` where one option
        makes it large)."""
        if self.model is None:
            return "model"
        from fl_lightning.federation.memory import inflating_option

        return inflating_option(*self.model)

    @classmethod
    def of(cls, model, data: DataConfig, batch_size: Optional[int] = None, algorithm: Any = None) -> "Footprint":
        """The footprint of a run of ``model`` on ``data``; with the training ``batch_size`` and
        the ``algorithm``, its client state and activations as that method trains."""
        from fl_lightning.federation.memory import Holdings, shapes_model

        classes, shape, data_bytes = dataset_facts(data)
        built = shapes_model(model, classes, shape)
        parameters = sum(t.numel() for t in built.state_dict().values())
        holdings = Holdings.of(built, data_bytes, shape, batch_size, algorithm)
        return cls(parameters, data_bytes, holdings, (model, classes, shape))


@dataclass(frozen=True)
class Placement:
    devices: int
    threads: Optional[int]
    line: str
    """One line for the start-up: what the run takes and why."""
    strategy: Optional[str] = None
    """A strategy replacing ``auto`` (ddp_fork for several CPU ranks), else None."""
    per_device: int = 1
    """Ranks on each device (``fabric.ranks_per_device``)."""

    @property
    def ranks(self) -> int:
        """Ranks this node runs."""
        return self.devices * self.per_device

    def apply(self, fabric: FabricConfig) -> FabricConfig:
        return replace(fabric, devices=self.devices, threads_per_rank=self.threads,
                       strategy=self.strategy or fabric.strategy)


@dataclass(frozen=True)
class Launcher:
    """A launcher that started this process and its peers (torchrun, SLURM's srun): it, not this
    process, decides how many ranks each node runs, so every node takes the same count from it."""

    name: str
    ranks_per_node: int
    nodes: int
    source: str
    """The variable the rank count came from."""

    @classmethod
    def of(cls, environ=None) -> Optional["Launcher"]:
        """The launcher named by the environment (as Lightning Fabric detects it), else None."""
        env = os.environ if environ is None else environ
        if "TORCHELASTIC_RUN_ID" in env and "LOCAL_WORLD_SIZE" in env:  # torchrun
            local = int(env["LOCAL_WORLD_SIZE"])
            return cls("torchrun", local, max(1, int(env.get("WORLD_SIZE", local)) // local), "LOCAL_WORLD_SIZE")
        if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):  # srun
            nodes = _leading_int(env.get("SLURM_NNODES")) or 1
            per_node = _leading_int(env.get("SLURM_NTASKS_PER_NODE"))
            source = "SLURM_NTASKS_PER_NODE"
            if per_node is None:
                per_node, source = max(1, int(env["SLURM_NTASKS"]) // nodes), "SLURM_NTASKS / SLURM_NNODES"
            return cls("srun", per_node, nodes, source)
        return None


def _leading_int(text: Optional[str]) -> Optional[int]:
    """SLURM's counts may read ``2(x3)`` (2 on each of 3 nodes): the leading number."""
    digits = "".join(itertools.takewhile(str.isdigit, text or ""))
    return int(digits) if digits else None


def uses_gpu(fabric: FabricConfig, machine: Machine) -> bool:
    return fabric.accelerator in ("cuda", "gpu") and machine.gpus > 0 or (fabric.accelerator == "auto"
                                                                            and machine.gpus > 0)


def resolve_threads(threads, sequential: bool, on_gpu: bool, cores: int) -> Optional[int]:
    """``threads_per_rank`` as a number (or None: Lightning's rule)."""
    if threads != "auto":
        return threads
    return cores if sequential and not on_gpu else 1


def place(fabric: FabricConfig, cohort: int, sequential: bool, footprint: Footprint, machine: Machine,
          launchable: bool = True, launcher: Optional[Launcher] = None) -> Placement:
    """Ranks and threads per rank for ``fit``; refuses (ConfigError) when they would not fit.

    ``cohort`` is the largest number of clients a round trains; ``launchable`` is False when
    Fabric cannot start ranks by re-running the command line (a run started from Python);
    ``launcher``: the torchrun or srun that started the ranks (they are not this process's to
    choose).
    """
    if launcher is not None:
        return _place_launched(fabric, sequential, footprint, machine, launcher)
    gpu = uses_gpu(fabric, machine)
    threads = resolve_threads(fabric.threads_per_rank, sequential, gpu, machine.cores)
    per_rank = footprint.per_rank
    budget = machine.memory
    need = f"about {per_rank / GB:.2f} GB per rank ({footprint.parameters / 1e6:.2f}M parameters, " \
           f"{footprint.data_bytes / GB:.2f} GB of data)"
    have = f"{budget / GB:.1f} GB available" if budget is not None else "available memory unknown"
    fits = budget // per_rank if budget is not None else None
    per_device = fabric.ranks_per_device
    if fabric.devices != "auto":
        devices = int(fabric.devices)
        host_ranks = 1 if gpu else devices * per_device  # a GPU rank's model lives on its GPU
        if fits is not None and host_ranks > fits:
            fewer = f"use --fabric.devices {fits} or fewer" if fits >= 1 else "a smaller model or dataset"
            raise ConfigError("fabric.devices", f"{host_ranks} rank(s) need {need}, {host_ranks * per_rank / GB:.1f} "
                                                f"GB in all, but {have}; {fewer}")
        why = "as configured"
    else:
        if sequential:
            devices, why = 1, "auto: sequential-client method, its cohort trains on one rank"
        elif not launchable:
            devices, why = 1, "auto: started from Python, not the command line"
        elif gpu:  # devices enough for the cohort, per_device clients on each
            devices = max(1, min(machine.gpus, -(-cohort // per_device)))
            why = f"auto: {machine.gpus} GPU(s), cohort {cohort}"
        else:
            # ranks x threads fit the cores: more would only take turns on them
            per_rank = threads if threads is not None else 1
            devices = max(1, min(machine.cores // per_rank, cohort))
            why = f"auto: {machine.cores} physical core(s)"
            why += f" / {per_rank} thread(s) per rank" if per_rank > 1 else ""
            why += f", cohort {cohort}"
            if fits is not None and fits < devices:
                devices = max(1, fits)
                why += f", lowered to {devices} by memory"
            devices = max(1, devices // per_device)  # ranks, not devices, fill the cores
        if not gpu and fits is not None and fits < 1:  # no rank count helps: the model or data is too big
            key = footprint.model_key() if footprint.model_share >= footprint.data_bytes else "data.dataset"
            raise ConfigError(key, f"one rank needs {need}, but {have}")
    # Several CPU ranks on one node are forked from this process once it has imported and
    # checked everything: re-running the command per rank (Fabric's ddp launcher) would repeat
    # several seconds of imports before the first round. The ranks compute exactly as under ddp.
    strategy = None
    if (fabric.strategy == "auto" and not gpu and devices * per_device > 1 and fabric.num_nodes == 1
            and fabric.accelerator in ("auto", "cpu") and can_fork()):
        strategy = "ddp_fork"
    where = "gpu" if gpu else "cpu"
    thread_words = "" if gpu else f" x {threads if threads is not None else 'cores/ranks'} thread(s)"
    busy = devices * per_device * threads if not gpu and not sequential and threads is not None else 0
    if busy > machine.cores:  # explicit devices, or more threads per rank than cores: they take turns
        why += f"; oversubscribed: {busy} threads on {machine.cores} physical core(s)"
    if per_device > 1:
        why += f"; {per_device} ranks on each of {devices} device(s)"
    line = f"fit: {devices * per_device} rank(s){thread_words} on {where} ({why}; {need}, {have})"
    return Placement(devices, threads, line, strategy, per_device)


def _place_launched(fabric: FabricConfig, sequential: bool, footprint: Footprint, machine: Machine,
                    launcher: Launcher) -> Placement:
    """The ranks a launcher started: ``devices: auto`` is its count per node, on every node alike;
    a ``devices`` or ``num_nodes`` that disagrees with it is refused."""
    started = f"{launcher.name} started {launcher.ranks_per_node} rank(s) on each of {launcher.nodes} node(s)"
    if fabric.num_nodes != launcher.nodes:
        raise ConfigError("fabric.num_nodes", f"{fabric.num_nodes}, but {started}; set --fabric.num_nodes "
                                              f"{launcher.nodes}")
    per_device = fabric.ranks_per_device
    if launcher.ranks_per_node % per_device:
        raise ConfigError("fabric.ranks_per_device", f"{per_device}, but {started} ({launcher.source}), not a "
                                                     f"multiple of it")
    devices = launcher.ranks_per_node // per_device
    if fabric.devices != "auto" and int(fabric.devices) != devices:
        raise ConfigError("fabric.devices", f"{fabric.devices} device(s) x {per_device} rank(s) per node, but "
                                            f"{started} ({launcher.source}); set --fabric.devices {devices} or auto")
    fixed = replace(fabric, devices=devices, strategy=fabric.strategy)
    placed = place(fixed, launcher.ranks_per_node, sequential, footprint, machine, launchable=False)
    why = f"auto: {started} ({launcher.source})" if fabric.devices == "auto" else f"as configured; {started}"
    line = placed.line.replace("(as configured", f"({why}", 1)
    return Placement(placed.devices, placed.threads, line, None, per_device)  # never forked: the launcher started them


def can_fork() -> bool:
    import multiprocessing

    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def launched_by_command_line() -> bool:
    """True in ``python -m fl_lightning``: Fabric can start the other ranks by re-running it."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec is not None and spec.name in ("fl_lightning.__main__", "fl_lightning")


def placement_for(fabric: FabricConfig, model, data: DataConfig, cohort: int,
                  sequential: bool, batch_size: Optional[int] = None, algorithm: Any = None) -> Placement:
    """``place`` on this machine; a rank started by rank 0 takes rank 0's placement.
    ``batch_size`` and ``algorithm`` let the memory estimate count the client's training state
    and activations as that method trains (``Footprint.of``)."""
    inherited = os.environ.get(PLACEMENT_ENV)
    if inherited and os.environ.get("LOCAL_RANK", "0") != "0":
        devices, threads = json.loads(inherited)
        return Placement(devices, threads, "")
    launcher = Launcher.of()
    lightning_nodes = all(name in os.environ for name in ("MASTER_ADDR", "NODE_RANK"))  # Fabric's own multi-node
    if fabric.num_nodes > 1 and launcher is None and not lightning_nodes:  # the other nodes would be waited for
        raise ConfigError("fabric.num_nodes", f"{fabric.num_nodes} nodes, but no launcher started this process as "
                                              "one of them: start every node with torchrun or srun, or set "
                                              "MASTER_ADDR, MASTER_PORT and NODE_RANK on each (docs/runtime.md, "
                                              "Several nodes)")
    machine = Machine.probe()
    return place(fabric, cohort, sequential, Footprint.of(model, data, batch_size, algorithm), machine,
                 launched_by_command_line(), launcher)


def hand_down(placement: Placement) -> None:
    """Make ``placement`` the one of the ranks this process is about to start."""
    os.environ[PLACEMENT_ENV] = json.dumps([placement.devices, placement.threads])


def process_age() -> float:
    """Seconds since this interpreter began running ``python -m fl_lightning`` (its ``__main__``
    records the moment before any import of its own), else since this module was imported. Not
    the process's age: ``bash -c "pip install ... && python -m ..."`` runs Python in the shell's
    process, which started with the install."""
    started = getattr(sys.modules.get("__main__"), "STARTED", None)
    return time.perf_counter() - (started if isinstance(started, float) else _IMPORTED)


_IMPORTED = time.perf_counter()
