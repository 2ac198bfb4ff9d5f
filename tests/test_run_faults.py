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
from fl_lightning.runtime import output_files
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
    record = {"class_path": "fl_lightning.algorithms.split.splitfed.SplitFedV2", "init_args": {"cut": "block2"}}
    fedsga = {"class_path": "fl_lightning.algorithms.split.fedsga.FedSGA", "init_args": {}}
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


def _disk_full_after(monkeypatch, nbytes: int, only: str = "", skip: int = 0):
    """Writes through ``output_files`` (every file a run writes) hit a full disk after ``nbytes``
    bytes of a file, for files whose name contains ``only``, once ``skip`` of those went through."""
    real = output_files._write_all
    seen = []

    def write_all(fd, payload):
        name = os.readlink(f"/proc/self/fd/{fd}")
        if only not in Path(name).name or len(seen) < skip:
            seen.append(name) if only in Path(name).name else None
            return real(fd, payload)
        real(fd, payload[:nbytes])  # what had been written when the disk filled up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output_files, "_write_all", write_all)


def test_disk_full_keeps_the_previous_checkpoint_and_removes_the_temporary(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    save_checkpoint({"model": {"w": torch.zeros(4)}, "round": 1}, path)
    kept = path.read_bytes()
    _disk_full_after(monkeypatch, 100)
    with pytest.raises(RunError) as err:
        save_checkpoint({"model": {"w": torch.ones(1000)}, "round": 2}, path)
    message = str(err.value)
    assert "\n" not in message and "no space left" in message and str(tmp_path) in message
    assert "while writing last.ckpt, which needs" in message and "free of" in message
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
    assert code == 1 and "no space left" in line and "which needs" in line
    assert last.read_bytes() == kept
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


@pytest.fixture(scope="module")
def one_round_run(tmp_path_factory):
    """A run folder after 1 of 2 rounds, with every kind of file a run writes."""
    out = tmp_path_factory.mktemp("base") / "runs"
    assert main(tiny_fit(out, "r", "--stop_after", "1")) == 0
    return out


# (file that fills the disk, writes of it that go through first, file named in the error line):
# every writer of the run folder; the logs both when rewritten on resume and when appended to
FILLING = [("config.yaml", 0, "config.yaml"), ("partition.pt", 0, "partition.pt"),
           ("metrics.jsonl", 0, "metrics.jsonl"), ("metrics.jsonl", 1, "metrics.jsonl"),
           ("clients.jsonl", 0, "clients.jsonl"), ("clients.jsonl", 2, "clients.jsonl"),
           ("best.ckpt", 0, "best.ckpt"), ("last.ckpt", 0, "last.ckpt"), ("summary.json", 0, "summary.json"),
           ("tfevents", 0, "tensorboard")]


@pytest.mark.parametrize("target,skip,named", FILLING, ids=[f"{t}-{k}" for t, k, _ in FILLING])
def test_a_full_disk_at_any_file_of_the_run_is_one_line_and_loses_nothing(one_round_run, tmp_path, capsys,
                                                                           monkeypatch, target, skip, named):
    """Each file is written whole (or cut back) through one helper: whichever write fills the
    disk, the command ends with one line naming it, the file is as it was, no temporary file is
    left, every log line is whole, and the same command resumes once there is room."""
    import shutil

    out = tmp_path / "runs"
    shutil.copytree(one_round_run, out)
    before = snapshot(out)
    capsys.readouterr()
    if target == "tfevents":  # TensorBoard's own writer: its failure surfaces at a flush
        from torch.utils.tensorboard import SummaryWriter

        def full(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(SummaryWriter, "flush", full)
    else:
        _disk_full_after(monkeypatch, 7, only=target, skip=skip)
    code = main(tiny_fit(out, "r", "--resume", "auto"))
    line = error_line(capsys)
    assert code == 1 and "no space left" in line and named in line and "--resume auto" in line
    after = snapshot(out)
    for name, content in before.items():
        if Path(name).name.startswith(target) or (target == "tfevents" and "tfevents" in name):
            if skip:  # appended to: what was there is there, and no part of a line follows it
                assert after[name].startswith(content) and after[name].endswith(b"\n"), f"{name} lost or cut a line"
            else:
                assert after[name] == content, f"{name} must be as it was"
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    for log in ("metrics.jsonl", "clients.jsonl"):
        rows = [json.loads(l) for l in (out / "r" / log).read_text().splitlines()]  # whole lines only
        assert rows and all("round" in r for r in rows)
    held = load_checkpoint(out / "r" / "checkpoints" / "last.ckpt")["round"]
    assert held in (1, 2)
    monkeypatch.undo()
    assert main(tiny_fit(out, "r", "--resume", "auto")) == 0  # with room, the same command goes on
    assert load_checkpoint(out / "r" / "checkpoints" / "last.ckpt")["round"] == 2


def _in_a_small_file_system(script: str, folder: Path, size: str = "600k") -> subprocess.CompletedProcess:
    """Run ``script`` (bash) with ``folder`` a tmpfs of ``size``, mounted in a private mount
    namespace (unshare; as root or through a user namespace); skips where neither is allowed."""
    import shutil

    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "--user", "--map-root-user", "--mount", "true"],
                           capture_output=True) if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip("needs unshare with user and mount namespaces to mount a small tmpfs")
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "FOLDER": str(folder)}
    return subprocess.run([unshare, "--user", "--map-root-user", "--mount", "bash", "-c",
                           f'mount -t tmpfs -o size={size} tmpfs "$FOLDER" && {script}'],
                          env=env, capture_output=True, text=True, timeout=300)


def test_disk_full_under_two_forked_ranks_fresh_and_resumed(tmp_path):
    """The issue's case: configs/fedavg_digits.yaml on a 600 KiB file system with two forked
    ranks. The first last.ckpt fits, the second does not: one line naming the folder, exit 1,
    the first checkpoint intact, no temporary file; resuming on the full disk ends the same."""
    config = Path(fl_lightning.__file__).parents[2] / "configs" / "fedavg_digits.yaml"
    full, kept = tmp_path / "full", tmp_path / "kept"
    fit = (f"{sys.executable} -m fl_lightning fit --config {config} --out_dir \"$FOLDER\" --federation.rounds 6 "
           "--fabric.devices 2")
    script = (f"{fit} 2> {tmp_path}/err1; echo $? > {tmp_path}/rc1; cp -a \"$FOLDER\" {tmp_path}/first; "
              f"{fit} --resume auto 2> {tmp_path}/err2; echo $? > {tmp_path}/rc2; cp -a \"$FOLDER\" {kept}")
    done = _in_a_small_file_system(script, full)
    assert done.returncode == 0, done.stderr
    for attempt, copy in (("1", tmp_path / "first"), ("2", kept)):
        err = (tmp_path / f"err{attempt}").read_text()
        lines = [l for l in err.splitlines() if l.startswith("error:")]
        assert (tmp_path / f"rc{attempt}").read_text().strip() == "1", err
        assert len(lines) == 1 and "Traceback" not in err and "distributed_backend" not in err, err
        assert f"no space left on the device in {full}/fedavg_digits/checkpoints" in lines[0]
        assert "while writing last.ckpt" in lines[0] and "the previous last.ckpt is kept" in lines[0]
        assert load_checkpoint(copy / "fedavg_digits" / "checkpoints" / "last.ckpt")["round"] == 1
        assert not [p for p in copy.rglob("*") if p.name.endswith(".tmp")]
    first, resumed = (tmp_path / "first" / "fedavg_digits", kept / "fedavg_digits")
    assert (first / "checkpoints" / "last.ckpt").read_bytes() == (resumed / "checkpoints" / "last.ckpt").read_bytes()


def test_best_checkpoint_of_another_width_is_refused_before_any_round(tmp_path, capsys, monkeypatch):
    """A best.ckpt of the same method but another model size: refused with the resume's other
    checks, before any rank starts or any file is rewritten (one and two ranks)."""
    import shutil

    from fl_lightning.federation import loop

    out = tmp_path / "runs"
    assert main(tiny_fit(out, "r", "--stop_after", "1")) == 0
    assert main(tiny_fit(out, "narrow", "--stop_after", "1", "--model.width", "0.5")) == 0
    shutil.copy(out / "narrow" / "checkpoints" / "best.ckpt", out / "r" / "checkpoints" / "best.ckpt")
    capsys.readouterr()
    before = snapshot(out)

    def no_rank(*args, **kwargs):
        raise AssertionError("a rank started: the checkpoint was not refused before launch")

    monkeypatch.setattr(loop, "_fit", no_rank)
    for devices in ("1", "2"):
        code = main(tiny_fit(out, "r", "--resume", "auto", "--fabric.devices", devices))
        line = error_line(capsys)
        assert code == 2 and line.startswith("error: resume:") and "best.ckpt does not fit the model" in line
        assert "different shapes" in line
        assert snapshot(out) == before, "last.ckpt, the logs and config.yaml must stay as they were"


# ---------------------------------------------------------------------------------------
# What only the data can refuse: before the ranks launch, in one line
# ---------------------------------------------------------------------------------------

DATA_REFUSALS = [(["--data.calib_size", "100000"], "data.calib_size"),
                 (["--data.dataset.test_fraction", "0.9999"], "data.dataset.test_fraction"),
                 (["--partition.num_clients", "5000", "--federation.clients_per_round", "2"], "partition.num_clients")]


@pytest.mark.parametrize("args,key", DATA_REFUSALS, ids=[k for _, k in DATA_REFUSALS])
def test_data_refusals_come_before_two_ranks_launch(tmp_path, capsys, args, key):
    """With two ranks asked for, the data is still built and refused before any rank starts:
    one line (no launch banner, no warning per rank) and no run folder."""
    out = tmp_path / "runs"
    code = main(tiny_fit(out, "r", "--fabric.devices", "2", *args))
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {key}:"), captured.err
    assert not out.exists()


def test_a_refusal_from_the_population_is_the_only_line_before_two_ranks_launch(tmp_path):
    """A method refusing its population (FEAST: budgets that afford no cached variant) refuses
    it before any rank starts: its line is the only one, no placement line, no launch banner."""
    config = Path(fl_lightning.__file__).parents[2] / "configs" / "quickstart.yaml"
    run = _start_fit(["fit", "--config", str(config), "--out_dir", str(tmp_path / "runs"), "--fabric.devices", "2",
                      "--partition.budgets.b_min", "1000", "--partition.budgets.b_max", "2000"])
    _, err = run.communicate(timeout=300)
    lines = [line for line in err.splitlines() if line.strip()]
    assert run.returncode == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: partition.budgets.b_min:") and "affords no cached variant" in lines[0]
    assert not (tmp_path / "runs").exists()


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


CTRL_C_ROUNDS = 15  # the interrupt, sent once round 0 is saved, lands mid-run on a fast quiet CPU (about 0.1 s a round)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The interrupted runs' uninterrupted model (one rank), run once for the three cases."""
    out = tmp_path_factory.mktemp("uninterrupted")
    assert main(tiny_fit(out, "whole", "--data.val_size", "0", "--eval.every", "1000", "--fabric.devices", "1",
                         rounds=CTRL_C_ROUNDS)) == 0
    return load_checkpoint(out / "whole" / "checkpoints" / "last.ckpt")["model"]


@pytest.mark.parametrize("devices, target", [(1, "launcher"), (2, "launcher"), (2, "job")])
def test_ctrl_c_is_one_line_exit_130_and_resumes_bit_exactly(tmp_path, uninterrupted, devices, target):
    """``launcher``: ``kill -INT`` of the fit process; ``job``: a terminal's Ctrl-C, which reaches
    the launcher and its forked ranks together."""
    out = tmp_path / "runs"
    rounds = CTRL_C_ROUNDS
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
    resumed = load_checkpoint(out / "r" / "checkpoints" / "last.ckpt")["model"]
    whole = uninterrupted
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
    from fl_lightning.runtime.link import Uplink

    module = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    with torch.no_grad():
        module["a"].weight.fill_(3e38)
        module["b"].weight[0, 0] = bad
    result = Uplink(client=0, num_samples=1, loss=0.5, model=Routed(module, {}))
    problem = result.non_finite()
    assert (problem is None) if expected is None else expected in problem
