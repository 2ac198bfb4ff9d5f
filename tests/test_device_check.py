"""benchmarks/device_check.sh without a GPU: it parses, and stops at once with one line; the
pieces its verdicts rest on (tolerances, nvidia-smi lines, comparison lines, the main job's
lines) on made-up runs; and its main-job slice end to end at smoke size on the CPU
(``--cpu-smoke``). No test here needs a GPU."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"


def _module():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "benchmarks" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


check = _module()


def run_script(*args: str, timeout: int = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, **env})


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    assert os.access(SCRIPT, os.X_OK)


@pytest.mark.parametrize("args,env,starts", [
    ([], {}, "device_check: no CUDA GPU: torch.cuda.is_available() is False"),
    (["--out", "{tmp}/runs"], {}, "device_check: no CUDA GPU"),
    ([], {"PYTHON": "/no/such/python"}, "device_check: no python at '/no/such/python'"),
    (["--accelerator", "tpu"], {}, "device_check: error: argument --accelerator: invalid choice"),
    (["--out", "{tmp}/a_file"], {}, "device_check: error: out: "),
    (["--minutes", "0"], {}, "device_check: error: minutes: must be > 0"),
    (["--minutes", "soon"], {}, "device_check: error: argument --minutes: invalid float value"),
])
def test_without_cuda_or_with_bad_arguments_it_stops_with_one_line(tmp_path, args, env, starts):
    (tmp_path / "a_file").write_text("")
    done = run_script(*[a.format(tmp=tmp_path) for a in args], **env)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(starts), done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"], "nothing is written"


def test_the_accuracy_tolerance_is_the_reordering_spread_or_one_standard_error():
    # CPU threads disagree by 0.02: 3 x 0.02 is looser than sqrt(0.5 * 0.5 / 1000) = 0.0158
    assert check.accuracy_tolerance(0.50, 0.52, 1000) == pytest.approx(0.06)
    # equal CPU results: one standard error of the accuracy over the test set
    assert check.accuracy_tolerance(0.50, 0.50, 1000) == pytest.approx(math.sqrt(0.25 / 1000))
    assert check.accuracy_tolerance(0.9, 0.9, 100) == pytest.approx(0.03)
    assert check.loss_tolerance(1.0, 1.0) == pytest.approx(0.02) and check.loss_tolerance(1.0, 1.1) == pytest.approx(0.3)


def _run(tmp_path: Path, name: str, acc: float, loss: float, code: int = 0, seconds=(2.0, 1.0, 1.2, 1.1)):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"final": {"test_acc": acc, "test_loss": loss}}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"round": i, "round_seconds": s}) + "\n"
                                                  for i, s in enumerate(seconds)))
    return check.Run(folder, code, "error: data.root: no files" if code else "peak_cuda_bytes 1048576\n", 1.0)


@pytest.mark.parametrize("device_acc,device_loss,verdict", [(0.51, 1.00, "PASS"), (0.60, 1.00, "FAIL"),
                                                            (0.50, 1.50, "FAIL"), (0.50, float("nan"), "FAIL")])
def test_a_comparison_line_passes_within_the_tolerance_only(tmp_path, device_acc, device_loss, verdict):
    cpu, other = _run(tmp_path, "cpu1", 0.50, 1.00), _run(tmp_path, "cpu2", 0.505, 1.01)
    line = check.compare("resnet18-cuda-vs-cpu", _run(tmp_path, "gpu", device_acc, device_loss), cpu, other, 1000, 2)
    assert line.startswith(f"{verdict} resnet18-cuda-vs-cpu:") and "\n" not in line


def test_a_method_without_a_test_loss_is_compared_on_its_accuracy(tmp_path):
    runs = [_run(tmp_path, name, acc, 1.0) for name, acc in (("gpu", 0.40), ("cpu1", 0.41), ("cpu2", 0.41))]
    for run in runs:  # FEAST's summary: population accuracy, no loss
        (run.folder / "summary.json").write_text(json.dumps({"final": {"test_acc": run.final["test_acc"]}}))
    line = check.compare("quickstart-cuda-vs-cpu", *runs, 1000, 6)
    assert line.startswith("PASS") and "test_loss" not in line and "after 6 rounds on 1000 test examples" in line
    assert check.compare("quickstart-cuda-vs-cpu", _run(tmp_path, "far", 0.30, 1.0), *runs[1:], 1000, 6).startswith("FAIL")


def test_a_run_that_failed_is_a_failed_check_naming_its_error(tmp_path):
    ok = _run(tmp_path, "cpu1", 0.5, 1.0)
    line = check.compare("quickstart-cuda-vs-cpu", _run(tmp_path, "gpu", 0.5, 1.0, code=2), ok, ok, 1000, 6)
    assert line == "FAIL quickstart-cuda-vs-cpu: gpu did not finish (error: data.root: no files)"
    assert check.bf16_line(_run(tmp_path, "bf16", 0.9, 0.2), ok).startswith("FAIL bf16-mixed:")


def test_steady_round_time_leaves_out_the_first_round_and_reads_nvidia_smi(tmp_path):
    run = _run(tmp_path, "timed", 0.5, 1.0, seconds=(9.0, 1.0, 3.0, 2.0))
    assert check.steady(run.round_seconds) == 2.0 and run.peak_cuda_bytes == 2**20
    assert check.parse_smi("87, 1234\n") == (87.0, 1234.0)
    for bad in ("", "[N/A], 12", "87"):
        assert check.parse_smi(bad) is None
    run.samples, run.memory_peak_mib = [(80.0, 900.0), (90.0, 1000.0), (100.0, 1000.0)], 1000.0
    line = check.utilization_line(run, "/usr/bin/nvidia-smi")
    assert line.startswith("INFO gpu-utilization:") and "mean 90 %" in line and "over 3 samples" in line
    assert "1 MiB allocated by torch, 1000 MiB used" in check.memory_line({"resnet18": run, "quickstart": run})


class _Finished:
    """A stand-in for a fit's process: writes the files a finished run writes."""

    def __init__(self, command, cwd=None, env=None, **_):
        self.command, self.env, self.returncode = command, env, 0
        args = command[command.index("fit") + 1:]
        folder = Path(args[args.index("--out_dir") + 1]) / args[args.index("--name") + 1]
        folder.mkdir(parents=True)
        final = {"test_acc": 0.9, "test_loss": 0.3}
        if "quickstart" in args[args.index("--config") + 1]:
            final.pop("test_loss")  # FEAST reports population accuracy only
        (folder / "summary.json").write_text(json.dumps({"final": final}))
        (folder / "metrics.jsonl").write_text("".join(json.dumps({"round": i, "round_seconds": 1.0 + (i == 0)}) + "\n"
                                                      for i in range(6)))
        _Finished.started.append(self)

    def communicate(self, timeout=None):
        return None, "peak_cuda_bytes 3145728\n"


def test_the_checks_run_valid_fit_commands_and_print_one_line_each(tmp_path, monkeypatch, capsys):
    """Every run the check starts is a command ``fit`` accepts (options spelled as the CLI spells
    them), each check prints one line, and a clean run exits 0."""
    from fl_lightning.cli import parse_command

    _Finished.started = []
    monkeypatch.setattr(check.subprocess, "Popen", _Finished)
    monkeypatch.setattr(check, "test_examples", lambda config: 1000)
    lines = check.run_checks(tmp_path, "cuda", checks="compare")
    assert [line.split(":")[0] for line in lines] == [
        "PASS quickstart-cuda-vs-cpu", "PASS resnet18-cuda-vs-cpu", "PASS bf16-mixed", "INFO round-time",
        "INFO gpu-utilization", "INFO peak-memory"]
    assert "equal-work FedAvg round 1.000 s on cuda" in lines[3] and "3 MiB allocated by torch" in lines[5]
    assert capsys.readouterr().out.splitlines() == lines
    commands = [run.command for run in _Finished.started]
    assert len(commands) == 9
    for command in commands:
        fit = command[command.index("fit"):]
        fit[fit.index("--config") + 1] = str(ROOT / fit[fit.index("--config") + 1])
        _, args, _ = parse_command(fit)  # a typo in an option would stop here
        assert args.fabric.devices == 1 and args.fabric.accelerator in ("cuda", "cpu")
    exact = [run for run in _Finished.started if run.env.get("NVIDIA_TF32_OVERRIDE") == "0"]
    assert len(exact) == 6  # the compared runs are float32 on both sides
    assert sum("bf16-mixed" in command for command in commands) == 1


# ---------------------------------------------------------------------------------------------
# The main job's slice (benchmarks/main_job_check.py)
# ---------------------------------------------------------------------------------------------

sys.path.insert(0, str(ROOT / "benchmarks"))
import main_job_check as main_job  # noqa: E402

SUMMARY_LINE = ("dispatches/step 913 (before n/a, ratio n/a); host syncs/client 1.0; main-process CPU/example "
                "0.051 ms; peak memory 0.94 GB")
INSTRUMENT_OUT = f"""main_job_round: configs/feast_cifar100.yaml, 2 round(s) of 4000
phase                      seconds     CPU s  host syncs
data and augmentation         0.18      0.17           0
forward and backward          0.74      0.70          12
reduction                     0.08      0.08           1
dispatches: 913 top-level operators per step
{SUMMARY_LINE}
"""


def _main_run(tmp_path: Path, name: str, losses=(4.6, 4.5), stdout: str = INSTRUMENT_OUT, code: int = 0):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"round": i, "train_loss": loss, "round_seconds": 2.0,
                                                              "sum/train_macs": 3e12}) + "\n"
                                                  for i, loss in enumerate(losses)))
    return check.Run(folder, code, "" if code == 0 else "error: fabric.precision: no", 1.0, stdout=stdout)


def test_the_instrument_line_passes_a_finished_run_with_finite_losses_only(tmp_path):
    line = main_job.instrument_line("main-job-fp32", _main_run(tmp_path, "ok"))
    assert line.startswith("PASS main-job-fp32: 2 rounds, round seconds 2.00, 2.00; " + SUMMARY_LINE)
    assert line.endswith("phases: data and augmentation 0.18 s, forward and backward 0.74 s, reduction 0.08 s")
    nan = main_job.instrument_line("main-job-bf16", _main_run(tmp_path, "nan", losses=(4.6, float("nan"))))
    assert nan.startswith("FAIL main-job-bf16: non-finite training loss")
    quiet = main_job.instrument_line("main-job-fp32", _main_run(tmp_path, "quiet", stdout="phase  seconds\n"))
    assert quiet.startswith("FAIL main-job-fp32: the instrument printed no summary line")
    failed = main_job.instrument_line("main-job-bf16", _main_run(tmp_path, "failed", code=2))
    assert failed == "FAIL main-job-bf16: did not finish (error: fabric.precision: no)"


def _checkpoint(folder: Path, value: float) -> None:
    (folder / "checkpoints").mkdir()
    model = {"w": torch.full((3,), 1.0), "b": torch.tensor([value])}
    torch.save({"model": model}, folder / "checkpoints" / "last.ckpt")


def test_shared_device_requires_the_one_rank_model_bit_for_bit_on_a_cpu(tmp_path):
    alone, same, off = (_main_run(tmp_path, name) for name in ("alone", "same", "off"))
    _checkpoint(alone.folder, 0.5)
    _checkpoint(same.folder, 0.5)
    _checkpoint(off.folder, 0.5 + 2**-24)  # one float32 unit in the last place at 0.5
    assert main_job.shared_line(same, alone, "cpu").startswith("PASS shared-device: model after 2 rounds equal")
    assert main_job.shared_line(off, alone, "cpu").startswith("FAIL shared-device:")
    assert "largest difference 5.96e-08" in main_job.shared_line(off, alone, "cpu")
    assert main_job.shared_line(off, alone, "cuda").startswith("INFO shared-device:")


def test_the_throughput_ratio_is_feast_macs_per_second_over_the_dense_loops(tmp_path, monkeypatch):
    runs = {"fp32": _main_run(tmp_path, "fp32"), "bf16": _main_run(tmp_path, "bf16")}
    monkeypatch.setattr(main_job, "dense_rate", lambda config, cache, accelerator, precision:
                        (6e12 if precision == "fp32" else 1.2e13, "578.0M MACs"))
    line = main_job.throughput_line(runs, [main_job.CONFIG], "cuda")
    # FEAST: 3e12 training MACs in a 2 s round = 1.5 TMAC/s; against 6 and 12 TMAC/s
    assert "fp32: FEAST round 1 1.500 TMAC/s vs dense loop 6.000 TMAC/s, ratio 0.250" in line
    assert "bf16: FEAST round 1 1.500 TMAC/s vs dense loop 12.000 TMAC/s, ratio 0.125" in line


def test_the_cpu_smoke_runs_the_main_job_slice_end_to_end(tmp_path):
    """The instrument in float32 and bf16, 2 ranks sharing the CPU against 1, the dense loop:
    every line a pass (or INFO), and the throughput line's FEAST rate the run's own
    ``sum/train_macs / round_seconds``."""
    done = run_script("--cpu-smoke", "--checks", "main-job", "--out", str(tmp_path), timeout=1200)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert [line.split(":")[0] for line in lines] == [
        "PASS main-job-fp32", "PASS main-job-bf16", "PASS shared-device", "INFO main-job-throughput", "device_check"]
    assert lines[-1].startswith("device_check: 4 of 4 checks passed")
    last = [json.loads(row) for row in (tmp_path / "main_fp32" / "main_job_round" / "metrics.jsonl").read_text()
            .splitlines()][-1]
    feast = main_job.rate(last["sum/train_macs"] / last["round_seconds"])
    assert f"fp32: FEAST round 1 {feast} vs dense loop" in lines[3]
