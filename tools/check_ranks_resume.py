"""Check, for every method kind, that two ranks give the one-rank model and that a stopped and
resumed run is the uninterrupted one, bit for bit:

    python tools/check_ranks_resume.py runs/ranks_resume                     # all 25 methods
    python tools/check_ranks_resume.py runs/ranks_resume --methods FedAvg Scaffold
    python tools/check_ranks_resume.py runs/ranks_resume \
        --configs configs/split/offline/mnist_subset/vit_tiny/splitfed_v2.yaml

A method kind is a class of ``fl_lightning.algorithms`` deriving from ``Algorithm`` (all but
``Algorithm`` and ``SubmodelAlgorithm``). Each is run on one offline config whose
``algorithm.class_path`` names it, the cheapest by its data (digits or synthetic images, then
the MNIST subset, then the rest; ties in path order). A method no offline config names runs on
a stand-in, a config of its parent with the class swapped (``STAND_INS``: FedOpt as FedAdam on
``configs/fedavg_digits.yaml``, so that the server optimiser's moments are state to restore).
``--methods`` narrows the set; ``--configs`` names the configs instead (each row's method is the
class its config names).

Each config runs ``python -m fl_lightning fit --config C --federation.rounds R --eval.every 1
--fabric.accelerator cpu --fabric.threads_per_rank 1`` (seeds as the config) four times, into
``OUT/<method>-<config path with / as _>/``:

- ``one``: one rank (``--fabric.devices 1``);
- ``two``: two forked CPU ranks (``--fabric.devices 2``); a method with ``sequential_clients``
  trains its whole cohort on rank 0 while the other rank contributes zeros;
- ``resumed``: the ``one`` command with ``--stop_after 1``, then again with ``--resume auto``.

Then ``resumed`` against ``one`` must be identical: every figure of ``metrics.jsonl`` and
``clients.jsonl`` but wall times (``tools/compare_runs.py``'s comparison) and every entry of
``last.ckpt`` and ``best.ckpt`` (model, algorithm state, round, best figure, method); the row
names the first difference. ``two`` against ``one``: the largest absolute difference over the
tensors of ``last.ckpt``'s model and algorithm state, and over the figures (clients' rows
matched by round and client).

Tolerance for two ranks. Tensors: zero. The runtime promises models that do not depend on the
rank count (docs/runtime.md, "Randomness" and "Thread rule"): a client's computation is keyed by
(seed, round, client) and runs on one thread whichever rank trains it, and the ranks' shares
meet in one float64 all-reduce. Regrouping float64 sums of float32 values moves them by about
2^-53 relative, far below float32's half unit in the last place (2^-25): the stored float32
entry changes only if a sum lands that close to a rounding boundary, so a tensor difference is
reported as a failure to look into, not accepted as rounding. Figures:
relative ``FIGURE_RTOL`` = 1e-4. An evaluation's loss is a float32 mean over examples
(torchmetrics' ``MeanMetric``) of which each rank scores a share, so its sum is grouped by
rank; regrouping a float32 sum of n terms changes it by at most about n * 2^-24 of the sum of
magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, 2002, section 4.2), 6e-5
for the ~1000 examples of the offline test sets, and typically by a unit or two in the last
place: on FedAvg, FedOpt, SCAFFOLD and HeteroFL (digits) the model and algorithm tensors were
identical and only ``val_loss``/``test_loss`` differed, by at most 2.4e-7 (1-2 float32 units);
accuracies and every clients' row agreed exactly.

Prints one row per method: method, config, resume bit-exact (or the first differing key), two
ranks identical (and the largest differences), wall seconds of the commands it ran (each
run's in ``check.json``). A finished method's folder holds ``check.json`` and is reused, so a
stopped check continues; an unfinished run folder is removed and run again. Exits 1 if any
resume is not bit-exact, any two-rank difference exceeds the tolerance or any run fails; 2 for
bad options (one line, nothing written).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from compare_runs import checkpoint_difference, figures, first_difference, first_entry_difference
from fl_lightning.errors import ConfigError
from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.saved_configs import dataset_of
from fl_lightning.tool_parser import ToolParser
from record_runs import at_least_one, data_section, offline_configs, run_name

ROOT = Path(__file__).resolve().parents[1]
DATA_COST = {"Digits": 0, "Synthetic": 0, "MNISTSubset": 1}  # the rest: 2
STAND_INS = {"FedOpt": ("configs/fedavg_digits.yaml",
                        ["--algorithm", "fl_lightning.algorithms.FedOpt", "--algorithm.server.name", "adam",
                         "--algorithm.server.lr", "0.01"])}
FIGURE_RTOL, FIGURE_ATOL = 1e-4, 1e-12
RUNS = ("one", "two", "resumed")


def method_kinds() -> list:
    from fl_lightning import algorithms

    base = (algorithms.Algorithm, algorithms.SubmodelAlgorithm)
    return [name for name in algorithms.__all__
            if inspect.isclass(getattr(algorithms, name)) and issubclass(getattr(algorithms, name), base[0])
            and getattr(algorithms, name) not in base]


def named_class(config: Path):
    """The class name that the config's ``algorithm.class_path`` (or short form) names, or None."""
    try:
        algorithm = (yaml.safe_load(config.read_text()) or {}).get("algorithm")
    except (yaml.YAMLError, AttributeError):
        return None
    path = algorithm.get("class_path") if isinstance(algorithm, dict) else algorithm
    return path.rpartition(".")[2] if isinstance(path, str) else None


def data_cost(config: Path) -> int:
    try:
        dataset, _ = dataset_of({"data": data_section(config)})
    except (ConfigError, TypeError, ImportError, AttributeError):
        return max(DATA_COST.values()) + 1
    return DATA_COST.get(type(dataset).__name__, max(DATA_COST.values()) + 1)


def cheapest_configs(root: Path, kinds, configs) -> dict:
    """``{method: (config, extra arguments)}``: per kind the cheapest of ``configs`` (offline,
    relative to ``root``), or its stand-in."""
    picked = {}
    for config in sorted(configs, key=lambda c: (data_cost(root / c), str(c))):
        kind = named_class(root / config)
        if kind in kinds and kind not in picked:
            picked[kind] = (config, [])
    for kind, (config, extra) in STAND_INS.items():
        if kind in kinds and kind not in picked:
            picked[kind] = (Path(config), list(extra))
    return {kind: picked[kind] for kind in kinds if kind in picked}


def checks(root: Path, methods, names):
    """The ``[(method, config, extra)]`` to check; ConfigError for a bad option."""
    kinds = method_kinds()
    unknown = [m for m in methods or () if m not in kinds]
    if unknown:
        raise ConfigError("methods", f"{', '.join(unknown)} is not a method kind (one of {', '.join(kinds)})")
    wanted = list(methods) if methods else kinds
    if names:
        out = []
        for name in names:
            path = root / name
            if not path.is_file() or data_section(path) is None:
                raise ConfigError("configs", f"{name} is not a full config file under {root}")
            kind = named_class(path)
            if kind not in kinds:
                raise ConfigError("configs", f"{name} names no method kind (algorithm.class_path: {kind})")
            if kind in wanted:
                out.append((kind, Path(name), []))
        if not out:
            raise ConfigError("configs", f"none of them names one of {', '.join(wanted)}")
        return out
    picked = cheapest_configs(root, wanted, offline_configs(root))
    missing = [m for m in wanted if m not in picked]
    if missing:
        raise ConfigError("methods", f"no offline config names {', '.join(missing)}; pass --configs")
    return [(m, *picked[m]) for m in wanted]


# ---- comparisons ---------------------------------------------------------------------------

def resume_difference(one: Path, resumed: Path):
    """The first difference of the resumed run from the uninterrupted one, or None."""
    return first_difference(one, resumed) or checkpoint_difference(one, resumed)


def tensor_gap(a: dict, b: dict):
    """``(largest |a - b| over the tensors of the model and algorithm state, its key)``; inf
    for a key, shape or dtype that only one side has."""
    gap, where = 0.0, None
    for part in ("model", "algorithm"):
        x, y = a.get(part) or {}, b.get(part) or {}
        for key in sorted(set(x) | set(y)):
            name = f"{part}/{key}"
            u, v = x.get(key), y.get(key)
            if not (isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor)):
                if first_entry_difference(u, v):
                    return math.inf, name
                continue
            if u.shape != v.shape or u.dtype != v.dtype:
                return math.inf, name
            if u.numel():
                d = (u.double() - v.double()).abs().max().item()
                if not d <= gap:  # NaN counts as the largest
                    gap, where = (math.inf if math.isnan(d) else d), name
    return gap, where


def keyed_rows(run: Path, name: str) -> dict:
    """A run's rows of ``name`` (wall times left out) by ``round N`` or ``round N client C``:
    ranks gather the clients' rows, so they are matched by who, not by position."""
    out = {}
    for row in figures(run, name):
        key = f"round {row.get('round')}" + (f" client {row['client']}" if "client" in row else "")
        out[key if key not in out else f"{key} ({len(out)})"] = row
    return out


def figure_gap(a: Path, b: Path):
    """``(largest |a - b| / (FIGURE_ATOL + FIGURE_RTOL |a|) over every figure but wall times,
    largest |a - b|, its key)``; a row, key or non-numeric value that differs gives inf."""
    worst, gap, where = 0.0, 0.0, None
    for name in ("metrics.jsonl", "clients.jsonl"):
        ra, rb = keyed_rows(a, name), keyed_rows(b, name)
        if set(ra) != set(rb):
            return math.inf, math.inf, f"{name}: rows {sorted(set(ra) ^ set(rb))[:3]} in one run only"
        for row_key, row in ra.items():
            other = rb[row_key]
            for key in sorted(set(row) | set(other)):
                u, v = row.get(key), other.get(key)
                label = f"{name} {row_key}: {key}"
                numeric = all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in (u, v))
                if not numeric:
                    if u != v:
                        return math.inf, math.inf, label
                    continue
                d = abs(u - v)
                if math.isnan(d):
                    if not (math.isnan(u) and math.isnan(v)):
                        return math.inf, math.inf, label
                    continue
                ratio = d / (FIGURE_ATOL + FIGURE_RTOL * abs(u))
                if d > gap:
                    gap, where = d, label
                worst = max(worst, ratio)
    return worst, gap, where


def compare(folder: Path) -> dict:
    """The check's verdict on a method folder holding the three finished runs."""
    one, two, resumed = (folder / r for r in RUNS)
    resume = resume_difference(one, resumed)
    model_gap, model_key = tensor_gap(load_checkpoint(one / "checkpoints" / "last.ckpt"),
                                      load_checkpoint(two / "checkpoints" / "last.ckpt"))
    ratio, figure_diff, figure_key = figure_gap(one, two)
    return {"resume_exact": resume is None, "resume_difference": resume,
            "two_tensor_gap": model_gap, "two_tensor_key": model_key,
            "two_figure_gap": figure_diff, "two_figure_key": figure_key, "two_figure_ratio": ratio,
            "two_identical": model_gap == 0 and figure_diff == 0 and figure_key is None,
            "passed": resume is None and model_gap == 0 and ratio <= 1}


# ---- runs ----------------------------------------------------------------------------------

def finished(run: Path, rounds: int) -> bool:
    try:
        return json.loads((run / "summary.json").read_text()).get("rounds_done") == rounds
    except (OSError, ValueError):
        return False


def fit(command: list, err: Path, root: Path) -> tuple:
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    with open(err, "a") as stream:
        rc = subprocess.run(command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=stream).returncode
    return rc, time.perf_counter() - start


def run_all(folder: Path, config: Path, extra: list, rounds: int, root: Path) -> tuple:
    """Runs what is not finished in ``folder``; ``({run: wall seconds}, failure or None)``."""
    base = [sys.executable, "-m", "fl_lightning", "fit", "--config", str(config), *extra, "--out_dir", str(folder),
            "--federation.rounds", str(rounds), "--eval.every", "1", "--fabric.accelerator", "cpu",
            "--fabric.threads_per_rank", "1"]
    steps = {"one": [["--fabric.devices", "1"]], "two": [["--fabric.devices", "2"]],
             "resumed": [["--fabric.devices", "1", "--stop_after", "1"], ["--fabric.devices", "1", "--resume", "auto"]]}
    seconds = {}
    for name, commands in steps.items():
        run = folder / name
        if finished(run, rounds):
            continue
        shutil.rmtree(run, ignore_errors=True)  # an unfinished run starts again
        (folder / f"{name}.err").unlink(missing_ok=True)
        for arguments in commands:
            rc, took = fit(base + ["--name", name, *arguments], folder / f"{name}.err", root)
            seconds[name] = seconds.get(name, 0.0) + took
            if rc != 0:
                return seconds, f"{name} failed, rc={rc} ({folder / f'{name}.err'})"
        if not finished(run, rounds):
            return seconds, f"{name} did not reach round {rounds} ({folder / f'{name}.err'})"
    return seconds, None


def row(method: str, config: Path, result: dict) -> str:
    start = f"{method:<12} {str(config):<66}"
    if "failure" in result:
        return f"{start} run failed: {result['failure']}"
    resume = "yes" if result["resume_exact"] else f"no: {result['resume_difference']}"
    tensors = f"{result['two_tensor_gap']:.3g}" + (f" {result['two_tensor_key']}" if result["two_tensor_gap"] else "")
    figures_ = f"{result['two_figure_gap']:.3g}" + (f" {result['two_figure_key']}" if result["two_figure_key"] else "")
    two = "yes" if result["two_identical"] else "no"
    return f"{start} {result['seconds']:7.1f}  {two:<4} {tensors:<10} {figures_:<44} {resume}"


HEADER = (f"{'method':<12} {'config':<66} {'seconds':>7}  {'two ranks: identical, max |diff| tensors, figures':<60} "
          f"resume bit-exact")


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for the method folders (finished ones are reused)")
    parser.add_argument("--methods", nargs="+", help="method kinds to check (default: all)")
    parser.add_argument("--configs", nargs="+", help="config files to check instead of the cheapest per method")
    parser.add_argument("--rounds", type=at_least_one, default=2, help="rounds per run (at least 2; default 2)")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        print("error: rounds: the resumed run stops after round 1, so at least 2 are needed", file=sys.stderr)
        return 2
    if args.out.exists() and not args.out.is_dir():
        print(f"error: out: {args.out} is not a folder", file=sys.stderr)
        return 2
    try:  # everything is known before anything is written
        chosen = checks(ROOT, args.methods, args.configs)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(HEADER, flush=True)
    lines, failed = [HEADER], 0
    for method, config, extra in chosen:
        folder = out / f"{method}-{run_name(config)}"
        done = folder / "check.json"
        if done.exists():
            result = json.loads(done.read_text())
        else:
            folder.mkdir(exist_ok=True)
            seconds, failure = run_all(folder, config, extra, args.rounds, ROOT)
            result = {"failure": failure} if failure else {**compare(folder), "seconds": sum(seconds.values()),
                                                          "run_seconds": seconds}
            if not failure:
                done.write_text(json.dumps({"method": method, "config": str(config), "extra": extra, **result},
                                           indent=2))
        line = row(method, config, result)
        print(line, flush=True)
        lines.append(line)
        failed += not result.get("passed", False)
    (out / "table.txt").write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
