"""The main job's instrument (benchmarks/main_job_round.py): its interface and its data."""

import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import main_job_round  # noqa: E402

LAST_LINE = re.compile(r"^dispatches/step (\d+) \(before (\S+), ratio (\S+)\); host syncs/client ([0-9.]+); "
                       r"main-process CPU/example ([0-9.]+) ms; peak memory ([0-9.]+) GB$")


def test_generated_cifar_is_the_release_format_read_with_the_integrity_check_skipped(tmp_path):
    from fl_lightning.data import CIFAR10, CIFAR100

    main_job_round.write_cifar(tmp_path, "cifar100", train=300, test=50)
    bundle = CIFAR100(skip_integrity_check=True).load(str(tmp_path), False, False)
    assert len(bundle.train) == 300 and len(bundle.test) == 50 and bundle.train.data.dtype == torch.uint8
    assert torch.bincount(bundle.train_targets, minlength=100).tolist() == [3] * 100  # balanced
    main_job_round.write_cifar(tmp_path, "cifar10", train=100, test=20)
    bundle = CIFAR10(skip_integrity_check=True).load(str(tmp_path), False, False)
    assert len(bundle.train) == 100 and bundle.num_classes == 10  # five training files of 20


def test_the_last_line_reads_as_the_interface_says(tmp_path):
    """The interface other scripts read: a small run, its figures on the last line; one host
    read per client (its reported loss) and none inside the steps."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "main_job_round.py"), "--config",
                           "configs/fedavg_digits.yaml", "--profile-steps", "1", "--federation.clients_per_round", "2",
                           "--train.steps", "2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    match = LAST_LINE.match(lines[-1])
    assert match, lines[-1]
    dispatches, before, ratio, syncs, cpu, peak = match.groups()
    assert int(dispatches) > 10 and (before, ratio) == ("n/a", "n/a")
    assert float(syncs) == 1.0 and 0.1 < float(peak) < 64
    assert "scaled: --federation.clients_per_round 2 --train.steps 2" in done.stdout
    assert "work: 2 client(s), 4 training step(s)" in done.stdout
    assert "0 inside training steps" in done.stdout


def test_the_count_starts_at_a_step_number_of_at_least_one():
    """``--profile-from`` takes a client's step number: 0, a negative number or a word stops
    the parser (exit 2) naming the option, before any run."""
    import argparse

    import pytest
    assert main_job_round.step_number("6") == 6 and main_job_round.step_number("1") == 1
    for bad in ("0", "-3"):
        with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
            main_job_round.step_number(bad)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "main_job_round.py"), "--config",
                           "configs/quickstart.yaml", "--profile-from", "0"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "--profile-from" in done.stderr.splitlines()[-1]
