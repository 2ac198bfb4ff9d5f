"""Run configs for a few rounds with one checkout of the code and keep their figures, so that
``tools/compare_runs.py`` can show a change that should not alter results did not:

    git worktree add /tmp/before <commit before the change>
    python tools/record_runs.py runs/before --root /tmp/before     # every offline config
    python tools/record_runs.py runs/after                          # this checkout
    python tools/compare_runs.py runs/before runs/after

Each config runs ``--federation.rounds 2 --eval.every 1`` (``--rounds`` changes it) on one
rank and one thread, from the root of the checkout given (its ``src`` and ``configs``), into
``OUT/<config path with / as _>``; finished runs are skipped, so a stopped recording continues.
"Offline" configs are those whose data is on this machine (the loader's own check, no
download); the others are listed as skipped. ``--configs`` names files or folders instead.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import yaml

from fl_lightning.errors import ConfigError
from fl_lightning.saved_configs import dataset_of
from fl_lightning.tool_parser import ToolParser

ROOT = Path(__file__).resolve().parents[1]


def data_section(config: Path):
    """The config's ``data`` mapping, or None (an overlay that names no dataset). Configs of
    either form (a named dataset, or a ``dataset`` class_path section) are read."""
    try:
        loaded = yaml.safe_load(config.read_text())
    except yaml.YAMLError:
        return None
    data = loaded.get("data") if isinstance(loaded, dict) else None
    return data if isinstance(data, dict) and ("name" in data or "dataset" in data) else None


def missing_data(data: dict, root: Path):
    """Why the dataset of a config's ``data`` section cannot load here without a download
    (None: it can)."""
    try:
        dataset, folder = dataset_of({"data": data})
        folder = Path(folder)
        dataset.check(str(folder if folder.is_absolute() else root / folder), False)
    except (ConfigError, TypeError) as error:
        return str(error)
    return None


def offline_configs(root: Path, skipped: list = None) -> list:
    """Every full config of ``root/configs`` whose data is here; the others go to ``skipped``
    as ``(config, why)``."""
    chosen = []
    for path in sorted((root / "configs").rglob("*.yaml")):
        data = data_section(path)
        if data is None:
            continue
        why = missing_data(data, root)
        if why is None:
            chosen.append(path.relative_to(root))
        elif skipped is not None:
            skipped.append((path.relative_to(root), why))
    return chosen


def chosen_configs(root: Path, names) -> list:
    out = []
    for name in names:
        path = root / name
        if path.is_dir():
            out += sorted(p.relative_to(root) for p in path.rglob("*.yaml") if data_section(p))
        elif path.is_file():
            out.append(Path(name))
        else:
            raise ConfigError("configs", f"{name} is neither a file nor a folder under {root}")
    return out


def at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def run_name(config: Path) -> str:
    parts = config.with_suffix("").parts
    return "_".join(parts[1:] if parts[0] == "configs" else parts)


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for the run folders")
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout whose src/ and configs/ run (default: this one)")
    parser.add_argument("--configs", nargs="+", help="config files or folders relative to the root (default: every offline config)")
    parser.add_argument("--rounds", type=at_least_one, default=2)
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if not (root / "src" / "fl_lightning").is_dir():
        print(f"error: root: {root} has no src/fl_lightning", file=sys.stderr)
        return 2
    skipped = []
    try:  # every config is known before anything is written
        configs = chosen_configs(root, args.configs) if args.configs else offline_configs(root, skipped)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for config, why in skipped:
        print(f"{config}: skipped, its data is not here ({why})")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"}
    failed = 0
    for config in configs:
        name = run_name(config)
        if (out / name / "summary.json").exists():
            continue
        resume = ["--resume", "auto"] if (out / name).exists() else []
        command = [sys.executable, "-m", "fl_lightning", "fit", "--config", str(config), "--name", name,
                   "--out_dir", str(out), "--federation.rounds", str(args.rounds), "--eval.every", "1",
                   "--fabric.devices", "1", "--fabric.threads_per_rank", "1", *resume]
        with open(out / f"{name}.err", "w") as err:
            rc = subprocess.run(command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=err).returncode
        print(f"{name}: rc={rc}", flush=True)
        failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
