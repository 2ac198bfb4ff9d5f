"""Faults a user meets around a run's folder: checkpoints of another method, damaged checkpoints
found before any work, one run per folder, disk full, Ctrl-C, operating-system refusals and a
round whose clients all fail. Every one ends in one line, with nothing half-written left behind."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fl_lightning
from fl_lightning.cli import main
from fl_lightning.errors import ConfigError, RunError
from fl_lightning.runtime import checkpoint as checkpoint_module
from fl_lightning.runtime.checkpoint import load_checkpoint, save_checkpoint
from fl_lightning.federation.provenance import check_method

SRC = Path(fl_lightning.__file__).parents[1]  # the code under test, also in the subprocesses


def tiny_fit(out: Path, name: str, *extra: str, rounds: int = 2) -> list:
    """A fit on digits that takes about a second a round on one CPU thread."""
    return ["fit", "--out_dir", str(out), "--name", name, "--data.dataset", "fl_lightning.data.Digits", "--data.val_size", "100",
            "--partition.method", "iid", "--partition.num_clients", "4", "--partition.min_size", "1",
            "--federation.clients_per_round", "2", "--federation.rounds", str(rounds), "--train.batch_size", "32",
            "--eval.every", "1", "--fabric.accelerator", "cpu", *extra]


def error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


# ---------------------------------------------------------------------------------------
# Checkpoints know the method that wrote them
# ---------------------------------------------------------------------------------------


def test_checkpoint_of_another_method_is_refused_naming_both(tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(tiny_fit(out, "avg", "--stop_after", "1")) == 0
    last = out / "avg" / "checkpoints" / "last.ckpt"
    assert load_checkpoint(last)["method"]["class_path"].endswith(".FedAvg")
    capsys.readouterr()
    code = main(tiny_fit(out, "prox", "--algorithm", "FedProx", "--algorithm.mu", "0.1", "--resume", str(last)))
    line = error_line(capsys)
    assert code == 2 and line.startswith("error: resume:") and "FedAvg" in line and "FedProx" in line
    assert not (out / "prox").exists()


def test_checkpoint_of_other_method_settings_is_refused(tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(tiny_fit(out, "a", "--algorithm", "FedProx", "--algorithm.mu", "0.01", "--stop_after", "1")) == 0
    capsys.readouterr()
    last = out / "a" / "checkpoints" / "last.ckpt"
    code = main(tiny_fit(out, "b", "--algorithm", "FedProx", "--algorithm.mu", "0.5", "--resume", str(last)))
    line = error_line(capsys)
    assert code == 2 and "mu 0.01 -> 0.5" in line


def test_evaluate_refuses_a_checkpoint_of_another_method(tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(tiny_fit(out, "avg", "--stop_after", "1")) == 0
    assert main(tiny_fit(out, "prox", "--algorithm", "FedProx", "--stop_after", "1")) == 0
    capsys.readouterr()
    code = main(["evaluate", "--run", str(out / "prox"), "--checkpoint", str(out / "avg" / "checkpoints" / "last.ckpt"),
                 "--fabric.accelerator", "cpu"])
    line = error_line(capsys)
    assert code == 2 and line.startswith("error: checkpoint:") and "FedAvg" in line and "FedProx" in line


def test_method_check_unit(tmp_path):
    record = {"class_path": "fl_lightning.algorithms.splitfed.SplitFedV2", "init_args": {"cut": "block2"}}
    fedsga = {"class_path": "fl_lightning.algorithms.fedsga.FedSGA", "init_args": {}}
    with pytest.raises(ConfigError, match="written by FedSGA, and this run is SplitFedV2"):
        check_method({"method": fedsga}, record, tmp_path / "x.ckpt", "resume")
    check_method({"method": record}, record, tmp_path / "x.ckpt", "resume")
    check_method({}, record, tmp_path / "x.ckpt", "resume")  # written before checkpoints named their method


def test_damaged_best_checkpoint_is_found_before_any_work(tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(tiny_fit(out, "r", "--stop_after", "1")) == 0
    best = out / "r" / "checkpoints" / "best.ckpt"
    best.write_bytes(best.read_bytes()[: best.stat().st_size // 2])
    capsys.readouterr()
    before = snapshot(out)
    code = main(tiny_fit(out, "r", "--resume", "auto"))
    line = error_line(capsys)
    assert code == 2 and line.startswith("error: resume:") and str(best) in line
    assert snapshot(out) == before, "last.ckpt and the metrics must stay as they were"


# ---------------------------------------------------------------------------------------
# Disk full while saving
# ---------------------------------------------------------------------------------------


def _disk_full_after(monkeypatch, nbytes: int):
    real_save = torch.save

    def save(obj, handle, *args, **kwargs):
        real_save(obj, handle, *args, **kwargs)
        handle.truncate(nbytes)  # what had been written when the disk filled up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module.torch, "save", save)


def test_disk_full_keeps_the_previous_checkpoint_and_removes_the_temporary(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    save_checkpoint({"model": {"w": torch.zeros(4)}, "round": 1}, path)
    kept = path.read_bytes()
    _disk_full_after(monkeypatch, 100)
    with pytest.raises(RunError) as err:
        save_checkpoint({"model": {"w": torch.ones(1000)}, "round": 2}, path)
    message = str(err.value)
    assert "\n" not in message and "no space left" in message and str(path) in message
    assert "needs about" in message and "free" in message
    assert path.read_bytes() == kept and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_disk_full_during_fit_is_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "runs"
    assert main(tiny_fit(out, "r", "--stop_after", "1", "--data.val_size", "0")) == 0
    last = out / "r" / "checkpoints" / "last.ckpt"
    kept = last.read_bytes()
    capsys.readouterr()
    _disk_full_after(monkeypatch, 10)
    code = main(tiny_fit(out, "r", "--resume", "auto", "--data.val_size", "0"))
    line = error_line(capsys)
    assert code == 1 and "no space left" in line and "needs about" in line
    assert last.read_bytes() == kept
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------------------
# One run per folder; Ctrl-C (two real processes)
# ---------------------------------------------------------------------------------------


def _start_fit(argv: list, new_session: bool = False) -> subprocess.Popen:
    """``new_session``: the fit and the ranks it forks form their own process group, as a job does."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.Popen([sys.executable, "-m", "fl_lightning", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=new_session,
                            preexec_fn=_terminal_signals)


def _terminal_signals() -> None:
    """SIGINT as a terminal's job has it: a test suite started in the background of a
    non-interactive shell inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_second_fit_in_the_same_folder_is_refused_and_a_stale_lock_does_not_block(tmp_path, capsys):
    out = tmp_path / "runs"
    first = _start_fit(tiny_fit(out, "r", rounds=200))
    try:
        _wait_for(out / "r" / "checkpoints" / "last.ckpt", first)
        before = (out / "r" / "metrics.jsonl").read_text()
        for extra in ([], ["--resume", "auto"]):  # a fresh start and a resume are both refused
            code = main(tiny_fit(out, "r", *extra, rounds=200))
            line = error_line(capsys)
            assert code == 2 and line.startswith("error: name:")
            assert str(out / "r") in line and f"process {first.pid}" in line
        assert (out / "r" / "metrics.jsonl").read_text().startswith(before)
    finally:
        first.kill()  # kill -9: the lock file stays behind, naming a process that is gone
        first.communicate()
    assert (out / "r" / "run.lock").read_text().strip() == str(first.pid)
    done = load_checkpoint(out / "r" / "checkpoints" / "last.ckpt")["round"]
    assert main(tiny_fit(out, "r", "--resume", "auto", "--stop_after", str(done + 1), rounds=200)) == 0
    assert not (out / "r" / "run.lock").exists()


@pytest.mark.parametrize("devices, target", [(1, "launcher"), (2, "launcher"), (2, "job")])
def test_ctrl_c_is_one_line_exit_130_and_resumes_bit_exactly(tmp_path, devices, target):
    """``launcher``: ``kill -INT`` of the fit process; ``job``: a terminal's Ctrl-C, which reaches
    the launcher and its forked ranks together."""
    out = tmp_path / "runs"
    # Long enough that the interrupt lands mid-run on a fast quiet CPU (about 0.1 s a round).
    rounds = 40
    argv = tiny_fit(out, "r", "--data.val_size", "0", "--eval.every", "1000", "--fabric.devices", str(devices),
                    rounds=rounds)
    run = _start_fit(argv, new_session=True)
    _wait_for(out / "r" / "checkpoints" / "last.ckpt", run)
    if target == "job":
        os.killpg(run.pid, signal.SIGINT)
    else:
        run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    words = lines[0].split()
    r = int(words[words.index("round") + 1].rstrip(","))
    held = load_checkpoint(out / "r" / "checkpoints" / "last.ckpt")["round"]
    assert f"interrupted in round {r}, the last checkpoint holds round {r - 1}, resume with --resume auto" in lines[0]
    assert held == r  # rounds done: rounds 0 .. r - 1
    assert not (out / "r" / "run.lock").exists()
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]

    assert main([*argv, "--resume", "auto"]) == 0
    whole_argv = tiny_fit(out, "whole", "--data.val_size", "0", "--eval.every", "1000", "--fabric.devices", "1",
                          rounds=rounds)
    assert main(whole_argv) == 0
    resumed = load_checkpoint(out / "r" / "checkpoints" / "last.ckpt")["model"]
    whole = load_checkpoint(out / "whole" / "checkpoints" / "last.ckpt")["model"]
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in whole)
    rows = [json.loads(l)["round"] for l in (out / "r" / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(rounds))


# ---------------------------------------------------------------------------------------
# A round whose clients all fail
# ---------------------------------------------------------------------------------------


def test_round_where_every_client_fails_says_what_exists_and_logs_its_clients(tmp_path, capsys):
    out = tmp_path / "runs"
    code = main(tiny_fit(out, "nan", "--train.lr", "1e30", rounds=3))
    line = error_line(capsys)
    assert code == 1 and "round 0: every client's update was non-finite" in line
    assert "no checkpoint has been written yet" in line and "holds round" not in line
    assert not (out / "nan" / "checkpoints" / "last.ckpt").exists()
    rows = [json.loads(l) for l in (out / "nan" / "clients.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["round"] == 0 and "non-finite" in r["skipped"] for r in rows)


@pytest.mark.parametrize("bad, expected", [(float("nan"), "b.weight"), (float("inf"), "b.weight"),
                                           (3e38, None)])
def test_update_check_names_non_finite_tensors_and_lets_a_sum_overflow(bad, expected):
    """NaN or inf in an update names its tensor; finite values whose sum overflows float32
    (3e38 three times) are not a fault."""
    from torch import nn

    from fl_lightning.elastic.routing import Routed
    from fl_lightning.runtime.result import ClientResult

    module = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    with torch.no_grad():
        module["a"].weight.fill_(3e38)
        module["b"].weight[0, 0] = bad
    result = ClientResult(client=0, num_samples=1, loss=0.5, update=Routed(module, {}))
    problem = result.non_finite()
    assert (problem is None) if expected is None else expected in problem
