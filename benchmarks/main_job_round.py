"""A run of any config at its real size, measured phase by phase: the main job's instrument.

    python benchmarks/main_job_round.py --config CONFIG [--rounds N] [--profile-steps K] [--profile-from S]
        [--before-src DIR] [--data-dir DIR] [--out DIR] [fit overrides...]

Runs ``fit`` in this process on one rank for N rounds (default 1; ``--stop_after N``: the
config's learning-rate schedule, evaluation and checkpoint cadence stay those of the real run,
and the last of the N rounds writes ``last.ckpt``) into a temporary folder (``--out`` keeps it;
its ``main_job_round.log`` holds what the run printed). Fit overrides scale the run and are
printed as what was scaled: ``--federation.clients_per_round 2``, ``--train.steps 4`` (steps
per client instead of its epochs), ``--eval.every 1`` with ``--data.val_size 500`` to time an
evaluation. A config on CIFAR-10 or CIFAR-100 reads generated data written in the dataset's
real on-disk format (``cifar-10-batches-py`` / ``cifar-100-python`` pickles: 50,000 / 10,000
images of uniform random pixels, balanced labels; kept in ``--data-dir``) through the dataset's
``skip_integrity_check`` option, unless ``--data.root`` is given; other datasets are read as the
config says.

It prints, per phase (start-up parts; data and augmentation; forward and backward, which holds
the optimizer step and clipping; routing; client set-up; commit; reduction; recalibration;
evaluation; checkpoint; other), wall seconds, CPU seconds of this process and host
synchronisations; a phase's nested phases are charged to themselves only. Then:

- dispatched operations per training step: the top-level ATen operators (issued from Python or
  by the autograd engine, not nested inside another operator) that ``torch.profiler`` records
  inside the steps (not while the next batch is made), averaged over K steps (default 3) of the
  first client that trains two or more, from its second step on (the first also creates the
  optimizer's state); ``--profile-from S`` starts at step S of the first client that reaches
  it (a later step: FEAST's client has then met more of its widths). Counted in a child process (this script with ``--dispatch-only``), so
  the profiler's time and memory (1-1.4 GB for the main job) stay out of this run's figures;
  ``--profile-steps 0`` counts nothing.
- host synchronisations per client: reads of a tensor's values on the host
  (``runtime/host_syncs.py``: ``item``, ``float``/``int``/``bool``, ``tolist``, ``cpu``,
  ``numpy``) during a client's round (routing, training, commit), its data phase left out
  (on a GPU its index work stays on the host); those inside the training steps are shown apart.
  On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is on inside the steps, so a sync there
  fails the run.
- main-process CPU per training example: CPU seconds of this process while the loop waits for
  the next batch (data and augmentation), per example trained.
- peak memory: the process's peak resident set, the phase that reached it and the resident set
  when round 1 began (and CUDA's peak allocation on a GPU), against the placement's per-rank
  estimate (``federation/memory.py``).

The last line reads

    dispatches/step D (before B, ratio R); host syncs/client S; main-process CPU/example E ms; peak memory M GB

where B is the same dispatch count under the code of commit 1748ab3: recomputed in this run by
``--before-src DIR`` (the ``src`` folder of ``git worktree add /tmp/pin_before 1748ab3``), else
the figure recorded below when the config and overrides match one recorded, else "n/a". GB are
2^30 bytes. Timings on a shared machine vary; the counts do not.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import multiprocessing as mp
import os
import pickle
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
GB = 2**30
PINNED = "1748ab3"

# Dispatched operations per step of the code at PINNED, measured by this script with
# --before-src /tmp/pin_before/src on 2026-12-06 (CPU, torch 2.14.1): (config, overrides) -> figure.
RECORDED_BEFORE: Dict[tuple, float] = {  # (config, overrides, --gpu-defaults) -> figure
    ("configs/feast_cifar100.yaml", ("--federation.clients_per_round", "2", "--train.steps", "4"), False): 5905.0,
    ("configs/quickstart.yaml", (), False): 1615.0,
    ("configs/feast_mnist_subset.yaml", ("--train.steps", "4"), False): 1738.0,
    # the same with --gpu-defaults (2026-12-07)
    ("configs/feast_cifar100.yaml", ("--federation.clients_per_round", "2", "--train.steps", "4"), True): 4977.0,
    ("configs/quickstart.yaml", (), True): 1359.0,
    ("configs/feast_mnist_subset.yaml", ("--train.steps", "4"), True): 1482.0,
}

DISPATCH_LINE = re.compile(r"^dispatches/step ([0-9.]+)")
CLIENT_PHASES = ("client set-up", "routing", "forward and backward", "commit")
STEP_WINDOW = "main_job_round: training step"
PHASE_ORDER = ("data and augmentation", "forward and backward", "routing", "client set-up", "commit", "reduction",
               "recalibration", "evaluation", "checkpoint", "other")


class DispatchesMeasured(BaseException):
    """Ends a ``--dispatch-only`` run once its steps are profiled (not an Exception: the loop's
    handlers let it through)."""


# ------------------------------------------------------------------------------------------
# Generated data in the real on-disk format
# ------------------------------------------------------------------------------------------

CIFAR_LAYOUTS = {  # dataset name -> (folder, training files, test file, meta file, label key, meta key)
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], "test_batch", "batches.meta",
                "labels", "label_names"),
    "cifar100": ("cifar-100-python", ["train"], "test", "meta", "fine_labels", "fine_label_names"),
}


def write_cifar(root: Path, name: str, train: int = 50_000, test: int = 10_000, seed: int = 0) -> None:
    """``root/<folder>/...``: CIFAR-10 or CIFAR-100 python pickles of uniform random pixels and
    balanced shuffled labels, as the release lays them out (kept when already written)."""
    folder, train_files, test_file, meta_file, label_key, meta_key = CIFAR_LAYOUTS[name]
    base = root / folder
    if (base / meta_file).is_file():
        return
    base.mkdir(parents=True, exist_ok=True)
    classes = 10 if name == "cifar10" else 100
    rng = np.random.default_rng(seed)

    def batch(n: int) -> dict:
        labels = rng.permutation(np.arange(n) % classes).tolist()
        entry = {"batch_label": b"generated", label_key: labels, "filenames": [b"generated.png"] * n,
                 "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8)}
        if name == "cifar100":
            entry["coarse_labels"] = [c // 5 for c in labels]
        return entry

    per_file = train // len(train_files)
    for file in train_files:
        _dump(base / file, batch(per_file))
    _dump(base / test_file, batch(test))
    meta = {meta_key: [f"class_{c}" for c in range(classes)]}
    if name == "cifar100":
        meta["coarse_label_names"] = [f"superclass_{c}" for c in range(20)]
    _dump(base / meta_file, meta)  # last: its presence means the folder is complete


def _dump(path: Path, obj) -> None:
    with open(path, "wb") as handle:
        pickle.dump(obj, handle, protocol=2)


def generated_in_child(root: Path, name: str) -> float:
    """Write the files in a forked process (its memory stays out of this one's peak); seconds."""
    started = time.perf_counter()
    child = mp.get_context("fork").Process(target=write_cifar, args=(root, name))
    child.start()
    child.join()
    if child.exitcode != 0:
        sys.exit(f"main_job_round: writing generated {name} files under {root} failed")
    return time.perf_counter() - started


# ------------------------------------------------------------------------------------------
# Phases: exclusive wall and CPU seconds, host synchronisations
# ------------------------------------------------------------------------------------------

@dataclass
class Phase:
    seconds: float = 0.0
    cpu: float = 0.0
    syncs: int = 0


class Phases:
    """A stack of named phases; time is charged to the innermost one only."""

    def __init__(self):
        self.totals: Dict[str, Phase] = defaultdict(Phase)
        self.stack: List[str] = []
        self._mark = (time.perf_counter(), time.process_time())
        self.peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "start-up")

    def _charge(self) -> None:
        now = (time.perf_counter(), time.process_time())
        if self.stack:
            phase = self.totals[self.stack[-1]]
            phase.seconds += now[0] - self._mark[0]
            phase.cpu += now[1] - self._mark[1]
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            if peak > self.peak[0]:  # the phase in which the resident set last grew past its peak
                self.peak = (peak, self.stack[-1])
        self._mark = now

    def push(self, name: str) -> None:
        self._charge()
        self.stack.append(name)

    def pop(self) -> None:
        self._charge()
        self.stack.pop()

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.push(name)
        try:
            yield
        finally:
            self.pop()

    @property
    def current(self) -> Optional[str]:
        return self.stack[-1] if self.stack else None


def in_phase(phases: Phases, name: str, function, only_inside: bool = False):
    """``function`` whose calls are charged to phase ``name`` (``only_inside``: only when some
    phase is already open, i.e. during the rounds)."""
    def wrapper(*args, **kwargs):
        if only_inside and phases.current is None:
            return function(*args, **kwargs)
        with phases(name):
            return function(*args, **kwargs)
    return wrapper


def timed_iterator(phases: Phases, name: str, iterator, on_item=None):
    """``iterator`` whose ``next`` calls are charged to phase ``name``."""
    while True:
        with phases(name):
            try:
                item = next(iterator)
            except StopIteration:
                return
        if on_item is not None:
            on_item(item)
        yield item


def host_syncs_module():
    """``fl_lightning.runtime.host_syncs``, from this checkout's file when the code measured is
    an older checkout's (``--before-src``) that lacks it."""
    try:
        from fl_lightning.runtime import host_syncs
    except ImportError:
        import importlib.util

        path = ROOT / "src" / "fl_lightning" / "runtime" / "host_syncs.py"
        spec = importlib.util.spec_from_file_location("main_job_round_host_syncs", path)
        host_syncs = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(host_syncs)
    return host_syncs


class SyncCounter:
    """Host synchronisations per phase, and those inside training steps by where they happen."""

    def __init__(self, phases: Phases):
        self.phases = phases
        self.in_steps = 0
        self.stepping = False
        self.where: Counter = Counter()
        self.counter = host_syncs_module().HostSyncs(on_sync=self._count, skip_files=(__file__,))

    def _count(self, where: str) -> None:
        phase = self.phases.current
        if phase is None:
            return
        self.phases.totals[phase].syncs += 1
        if self.stepping:
            self.in_steps += 1
            self.where[where] += 1


# ------------------------------------------------------------------------------------------
# Training steps: data, the step window, dispatch profiling
# ------------------------------------------------------------------------------------------

class Steps:
    """Follows the batches of each client fit: examples, the step window (between handing out a
    batch and asking for the next), and the profiled steps."""

    def __init__(self, phases: Phases, syncs: SyncCounter, profile_steps: int, stop_after_profile: bool,
                 profile_from: int = 2):
        self.phases, self.syncs = phases, syncs
        self.profile_steps, self.stop_after_profile = profile_steps, stop_after_profile
        self.profile_from = profile_from
        self.steps = self.examples = self.clients = 0
        self.profiler = None
        self.profiled: Optional[Counter] = None  # operator name -> count over the profiled steps
        self.profiled_steps = 0
        self.profiled_client: Optional[str] = None
        self._fit_step, self._open, self._label = 0, False, ""
        self.cuda_sync_check = torch.cuda.is_available()

    def batches(self, iterator):
        while True:
            self._end_step()
            with self.phases("data and augmentation"):
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
            self.steps += 1
            self.examples += _batch_size(batch)
            self._begin_step()
            yield batch

    def new_fit(self, label: str) -> None:
        self._fit_step = 0
        self._label = label

    def end_fit(self) -> None:
        """After a client's training: a profile still open ends with the steps it holds."""
        self._end_step()
        if self.profiler is not None:
            self._finish_profile()

    def _begin_step(self) -> None:
        self._fit_step += 1
        self._open = True
        if self.profiled is None and self.profiler is None and self._fit_step == self.profile_from and self.profile_steps > 0:
            from torch.profiler import ProfilerActivity, profile

            self.phases.push("profiled steps")
            self.profiler = profile(activities=[ProfilerActivity.CPU])
            self.profiler.__enter__()
            self.profiled_client = self._label
        if self.profiler is not None:
            self._window = torch.autograd.profiler.record_function(STEP_WINDOW)
            self._window.__enter__()
        self.syncs.stepping = True
        if self.cuda_sync_check:
            torch.cuda.set_sync_debug_mode("error")

    def _end_step(self) -> None:
        if not self._open:
            return
        self._open = False
        if self.cuda_sync_check:
            torch.cuda.set_sync_debug_mode("default")
        self.syncs.stepping = False
        if self.profiler is not None:
            self._window.__exit__(None, None, None)
            self.profiled_steps += 1
            if self.profiled_steps == self.profile_steps:
                self._finish_profile()

    def _finish_profile(self) -> None:
        self.profiler.__exit__(None, None, None)
        self.profiled = top_level_operators(self.profiler.events())
        self.profiler = None
        self.phases.pop()
        if self.stop_after_profile:
            raise DispatchesMeasured()


def top_level_operators(events) -> Counter:
    """ATen operators inside a step window and not nested inside another ATen operator, by name."""
    counts: Counter = Counter()
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None and parent.name != STEP_WINDOW:
            nested |= parent.name.startswith("aten::")
            parent = parent.cpu_parent
        if parent is not None and not nested:
            counts[event.name] += 1
    return counts


def _batch_size(batch) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    return int(first.shape[0]) if hasattr(first, "shape") else 0


class TimedData:
    """A client's data whose batch iterators go through :meth:`Steps.batches`."""

    def __init__(self, data, steps: Steps):
        self._data, self._steps = data, steps

    def __len__(self) -> int:
        return len(self._data)

    def __getattr__(self, name: str):
        attr = getattr(self._data, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            out = attr(*args, **kwargs)
            return self._steps.batches(out) if hasattr(out, "__next__") else out
        return call


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------

@dataclass
class Watched:
    """What the instrument saw of the run besides its phases."""

    federation: object = None
    ready: tuple = ()
    """(resident bytes, peak resident bytes) when the round loop began."""


def instrument(phases: Phases, steps: Steps, algorithm) -> Watched:
    """Charge the run's parts to phases (patches of this process only)."""
    import fl_lightning.algorithms.client as client_module
    import fl_lightning.federation.loop as loop
    from fl_lightning.runtime.calibration import ServerCalibration
    from fl_lightning.runtime.round_state import RoundAccumulator

    train_locally = client_module.train_locally

    def measured_training(fabric, module, data, cfg, generator, *args, **kwargs):
        steps.new_fit(f"{type(module).__name__}")
        with phases("forward and backward"):
            try:
                return train_locally(fabric, module, TimedData(data, steps), cfg, generator, *args, **kwargs)
            finally:
                steps.end_fit()

    client_module.train_locally = measured_training
    fit_cohort = algorithm.fit_cohort

    def measured_cohort(plan, owned):
        def count(_):
            steps.clients += 1
        return timed_iterator(phases, "client set-up", iter(fit_cohort(plan, owned)), count)

    algorithm.fit_cohort = measured_cohort
    for name, phase in (("route", "routing"), ("commit", "commit"), ("finish_round", "reduction")):
        setattr(algorithm, name, in_phase(phases, phase, getattr(algorithm, name)))
    RoundAccumulator.reduce = in_phase(phases, "reduction", RoundAccumulator.reduce)
    ServerCalibration.recalibrate = in_phase(phases, "recalibration", ServerCalibration.recalibrate)
    ServerCalibration.batches = in_phase(phases, "recalibration", ServerCalibration.batches)
    loop.save_checkpoint = in_phase(phases, "checkpoint", loop.save_checkpoint, only_inside=True)
    loop.Federation.evaluate_round = in_phase(phases, "evaluation", loop.Federation.evaluate_round)
    loop.Federation.run_round = in_phase(phases, "other", loop.Federation.run_round)
    loop.Federation.write_round = in_phase(phases, "other", loop.Federation.write_round)
    run = loop.Federation.run
    watched = Watched()

    def remembered_run(self):
        watched.federation = self
        watched.ready = (resident_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return run(self)

    loop.Federation.run = remembered_run
    return watched


def resident_bytes() -> int:
    """This process's resident set now (Linux's /proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def dataset_name(dataset) -> Optional[str]:
    return getattr(dataset, "name", None)


def accepts_skip_option(dataset) -> bool:
    return "skip_integrity_check" in inspect.signature(type(dataset).__init__).parameters


def parse_fit(config: str, overrides: List[str]):
    from fl_lightning.cli import parse_command

    _, args, resolved = parse_command(["fit", "--config", config, *overrides])
    return args, resolved


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the fit config to run")
    parser.add_argument("--rounds", type=int, default=1, help="rounds to run (--stop_after)")
    parser.add_argument("--profile-steps", type=int, default=3,
                        help="training steps whose operators are counted (0: no count, no child process)")
    parser.add_argument("--profile-from", type=step_number, default=2,
                        help="the client's step the count starts at (default 2, the first after the optimizer's state is made)")
    parser.add_argument("--before-src", help="src folder of a checkout of the pinned commit: recompute 'before'")
    parser.add_argument("--data-dir", help="where generated data is written (default: a temporary folder)")
    parser.add_argument("--out", help="keep the run folder here (default: a temporary folder)")
    parser.add_argument("--gpu-defaults", action="store_true",
                        help="count dispatches (before and after) with the multi-tensor SGD step and gradient "
                             "clipping PyTorch chooses by itself for CUDA tensors (on the CPU it steps tensor by "
                             "tensor), so the ratio is the one a GPU sees")
    parser.add_argument("--dispatch-only", action="store_true",
                        help="profile the steps, print their dispatch count and stop (run by the instrument)")
    options, overrides = parser.parse_known_args(argv)
    if any(o.startswith("--stop_after") or o.startswith("--out_dir") or o.startswith("--name") for o in overrides):
        sys.exit("main_job_round: --stop_after, --out_dir and --name are set by the instrument (use --rounds, --out)")
    from fl_lightning.errors import ConfigError

    with tempfile.TemporaryDirectory(prefix="main_job_round_") as scratch:
        try:
            return measure(options, overrides, Path(scratch))
        except ConfigError as error:
            print(f"main_job_round: {error}", file=sys.stderr)
            return 2


def step_number(text: str) -> int:
    """A client's step number for ``--profile-from``: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a step number of at least 1, got {value}")
    return value


def use_gpu_defaults() -> None:
    """PyTorch's choices for CUDA tensors on the CPU: ``torch.optim.SGD`` and
    ``torch.nn.utils.clip_grad_norm_`` with ``foreach`` (one multi-tensor kernel per step, not
    one per tensor) when the caller leaves it unset."""
    import torch.nn.utils as nn_utils

    sgd_init, clip = torch.optim.SGD.__init__, nn_utils.clip_grad_norm_

    def sgd(self, params, *args, foreach=None, **kwargs):
        sgd_init(self, params, *args, foreach=True if foreach is None else foreach, **kwargs)

    def clipped(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        return clip(parameters, max_norm, norm_type, error_if_nonfinite, foreach=True if foreach is None else foreach)

    torch.optim.SGD.__init__, nn_utils.clip_grad_norm_ = sgd, clipped


def measure(options, overrides: List[str], scratch: Path) -> int:
    if options.dispatch_only and options.gpu_defaults:
        use_gpu_defaults()
    args, _ = parse_fit(options.config, overrides)
    name = dataset_name(args.data.dataset)
    data_words, data_overrides = "as the config reads it", []
    if name in CIFAR_LAYOUTS and not any(o.startswith("--data.root") for o in overrides):
        root = Path(options.data_dir) if options.data_dir else scratch / "data"
        options.data_dir = str(root)  # the dispatch counts' runs read the same files
        seconds = generated_in_child(root, name)
        data_overrides = ["--data.root", str(root), "--data.download", "false"]
        if accepts_skip_option(args.data.dataset):
            data_overrides += ["--data.dataset.init_args.skip_integrity_check", "true"]
        else:  # the pinned code has no such option: its md5 comparison is bypassed here
            import torchvision.datasets.cifar as tv_cifar

            tv_cifar.check_integrity = lambda *a, **k: True
        data_words = (f"generated {name} in its on-disk format under {root} (50,000 / 10,000 images of random "
                      f"pixels, {seconds:.1f} s), read with {' '.join(data_overrides[4:]) or 'md5 check bypassed'}")
    out = Path(options.out) if options.out else scratch / "runs"
    fixed = ["--stop_after", str(options.rounds), "--out_dir", str(out), "--name", "main_job_round",
             "--fabric.devices", "1"]
    args, resolved = parse_fit(options.config, overrides + data_overrides + fixed)

    phases = Phases()
    syncs = SyncCounter(phases)
    steps = Steps(phases, syncs, options.profile_steps if options.dispatch_only else 0, options.dispatch_only,
                  options.profile_from)
    watched = instrument(phases, steps, args.algorithm)
    try:
        from fl_lightning.cli.commands import fit_command
    except ImportError:  # the layout before the CLI became a package (--before-src)
        from fl_lightning.commands import fit_command

    log = out / "main_job_round.log"
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as handle, contextlib.redirect_stdout(handle), syncs.counter:
        try:
            fit_command(args, resolved)
        except DispatchesMeasured:
            pass
    wall = time.perf_counter() - started
    if options.dispatch_only:
        print_dispatches(steps)
        return 0
    counted = options.profile_steps > 0
    after = dispatch_count(options, overrides) if counted else Dispatches(float("nan"), "")
    before = before_figure(options, overrides) if counted else None
    report(options, overrides, args, data_words, phases, syncs, steps, watched, after, before, wall)
    return 0


def print_dispatches(steps: "Steps") -> None:
    """The two lines a ``--dispatch-only`` run prints: the count, and where it comes from."""
    if not steps.profiled:
        print("dispatches/step nan")
        return
    per_step = sum(steps.profiled.values()) / steps.profiled_steps
    top = ", ".join(f"{k} {v / steps.profiled_steps:.0f}" for k, v in steps.profiled.most_common(8))
    print(f"dispatches/step {per_step:.1f}")
    first = steps.profile_from
    print(f"dispatches: {per_step:.0f} top-level operators per step (steps {first}-{first + steps.profiled_steps - 1} "
          f"of the first {steps.profiled_client} with {first} or more steps); most: {top}")


@dataclass
class Dispatches:
    per_step: float
    detail: str


def dispatch_count(options, overrides: List[str], src: Optional[str] = None) -> Dispatches:
    """The dispatch count of a ``--dispatch-only`` run of this script in a child process (its
    profiler's memory and time stay out of this run's figures), on this checkout's code or on
    the ``src`` folder's."""
    command = [sys.executable, __file__, "--dispatch-only", "--config", options.config,
               "--profile-steps", str(options.profile_steps), "--profile-from", str(options.profile_from),
               *(["--gpu-defaults"] if options.gpu_defaults else []),
               *overrides]
    if options.data_dir:
        command[2:2] = ["--data-dir", options.data_dir]
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(Path(src).resolve())
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    lines = done.stdout.splitlines()
    for i, line in enumerate(lines):
        match = DISPATCH_LINE.match(line)
        if match:
            return Dispatches(float(match.group(1)), lines[i + 1] if i + 1 < len(lines) else "")
    sys.stderr.write(done.stderr[-2000:])
    sys.exit(f"main_job_round: the dispatch count's run{' under ' + src if src else ''} gave no figure")


def before_figure(options, overrides: List[str]) -> Optional[float]:
    """The dispatch count under the pinned commit's code: recomputed, recorded, or None."""
    if options.before_src:
        return dispatch_count(options, overrides, options.before_src).per_step
    if (options.profile_steps, options.profile_from) != (3, 2):  # figures recorded with the defaults
        return None
    return RECORDED_BEFORE.get((options.config, tuple(overrides), options.gpu_defaults))


def report(options, overrides, args, data_words, phases, syncs, steps, watched, dispatches, before, wall) -> None:
    federation = watched.federation
    startup = federation.startup if federation is not None else {}
    device = federation.fabric.device if federation is not None else torch.device("cpu")
    print(f"main_job_round: {options.config}, {options.rounds} round(s) of {args.federation.rounds}, 1 rank on "
          f"{device}, {torch.get_num_threads()} thread(s), torch {torch.__version__}")
    print(f"scaled: {shlex.join(overrides) if overrides else 'nothing (the config as it is)'}")
    print(f"data: {data_words}")
    print(f"work: {steps.clients} client(s), {steps.steps} training step(s), {steps.examples} example(s); "
          f"{wall:.1f} s in all")
    print("start-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in startup.items()))
    print(f"{'phase':<24}{'seconds':>10}{'CPU s':>10}{'host syncs':>12}")
    for name in PHASE_ORDER:
        if name in phases.totals:
            p = phases.totals[name]
            print(f"{name:<24}{p.seconds:>10.2f}{p.cpu:>10.2f}{p.syncs:>12d}")
    if dispatches.detail:
        print(dispatches.detail)
    client_syncs = sum(phases.totals[p].syncs for p in CLIENT_PHASES if p in phases.totals)
    per_client = client_syncs / steps.clients if steps.clients else float("nan")
    where = ", ".join(f"{k} x{v}" for k, v in syncs.where.most_common(4))
    print(f"host syncs: {client_syncs} in {steps.clients} client round(s), {syncs.in_steps} inside training steps"
          + (f" ({where})" if where else ""))
    data = phases.totals.get("data and augmentation", Phase())
    per_example = 1000 * data.cpu / steps.examples if steps.examples else float("nan")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    memory = f"memory: peak RSS {peak / GB:.2f} GB (reached in {phases.peak[1]})"
    if watched.ready:
        resident, start_peak = watched.ready
        memory += f", {resident / GB:.2f} GB resident when round 1 began (start-up peak {start_peak / GB:.2f} GB)"
    if torch.cuda.is_available():
        memory += f", CUDA peak allocated {torch.cuda.max_memory_allocated() / GB:.2f} GB"
    estimate = placement_estimate(args)
    if estimate is not None:
        memory += f"; placement estimate {estimate / GB:.2f} GB per rank (estimate / peak {estimate / peak:.3f})"
    print(memory)
    if before is None:
        before_words = "before n/a, ratio n/a"
    else:
        before_words = f"before {before:.0f}, ratio {dispatches.per_step / before:.3f}"
    print(f"dispatches/step {dispatches.per_step:.0f} ({before_words}); host syncs/client {per_client:.1f}; "
          f"main-process CPU/example {per_example:.3f} ms; peak memory {peak / GB:.2f} GB")


def placement_estimate(args) -> Optional[int]:
    try:
        from fl_lightning.federation.machine import Footprint

        try:
            return Footprint.of(args.model, args.data, args.train.batch_size, args.algorithm).per_rank
        except TypeError:  # an older checkout's estimate, from the model and data only
            return Footprint.of(args.model, args.data).per_rank
    except Exception:  # an older checkout's estimate may not be reachable this way
        return None


if __name__ == "__main__":
    sys.exit(main())
