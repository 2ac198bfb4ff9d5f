"""What a command prints and what its options take: one plain line per round where standard
error is no terminal, a bar where it is one, the placement line only once the data is accepted,
the start-up figure of this interpreter, help that opens with its description, refused option
abbreviations, the logger option's refusals, evaluate's round, partition's budgets."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import struct
import sys
import termios
import types
from pathlib import Path

import pytest

from fl_lightning.cli import COMMANDS, main
from fl_lightning.config import PartitionConfig
from fl_lightning.data.federated import client_budgets
from fl_lightning.federation import loop, machine
from fl_lightning.federation.loop import run_fit
from fl_lightning.federation.progress import RoundProgress, terminal_width

ROOT = Path(__file__).resolve().parents[1]


def tiny_fit(out: Path, name: str, *extra: str, rounds: int = 3) -> list:
    return ["fit", "--out_dir", str(out), "--name", name, "--data.dataset", "fl_lightning.data.Digits",
            "--data.val_size", "100", "--partition.method", "iid", "--partition.num_clients", "4",
            "--federation.clients_per_round", "2", "--federation.rounds", str(rounds), "--train.batch_size", "32",
            "--eval.every", "1", "--fabric.accelerator", "cpu", "--fabric.devices", "1", *extra]


def rows(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------
# Progress: a line per round off a terminal, the bar on one
# ---------------------------------------------------------------------------------------


def test_without_a_terminal_each_round_is_one_plain_line(spec_factory, capsys):
    spec = spec_factory(name="lines")
    run_fit(spec)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("round ")]
    metrics = rows(Path(spec.out_dir) / "lines" / "metrics.jsonl")
    clients = rows(Path(spec.out_dir) / "lines" / "clients.jsonl")
    assert [line.split(":")[0] for line in lines] == ["round 0 (1/3)", "round 1 (2/3)", "round 2 (3/3)"]
    for line, row in zip(lines, metrics):
        figures = dict(part.split("=") for part in line.split(": ", 1)[1].split())
        assert figures["train_loss"] == f"{row['train_loss']:.4f}" and figures["val_acc"] == f"{row['val_acc']:.4f}"
        assert figures["test_acc"] == f"{row['test_acc']:.4f}"
    # traffic both ways of every client so far, from clients.jsonl, in MB of 10^6 bytes
    total = sum(c["bytes_down"] + c["bytes_up"] for c in clients) / 1e6
    assert lines[-1].split("MB_total=")[1].split()[0] == f"{total:.4g}"


def _terminal(columns: int):
    """A pseudo-terminal of ``columns`` columns (0: one that reports no size): (reader, writer)."""
    reader, writer = os.openpty()
    fcntl.ioctl(writer, termios.TIOCSWINSZ, struct.pack("HHHH", 24 if columns else 0, columns, 0, 0))
    return os.fdopen(reader, "rb", buffering=0), os.fdopen(writer, "w")


def _read_all(reader) -> str:
    """Everything written so far: a terminal hands it over in chunks, one read may return only
    the first."""
    import select

    chunks = []
    while select.select([reader], [], [], 0.5)[0]:
        chunk = reader.read(65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


@pytest.mark.parametrize("columns", [0, 100])
def test_a_terminal_gets_the_bar_and_one_without_a_size_gets_lines(columns):
    reader, writer = _terminal(columns)
    with reader, writer:
        assert terminal_width(writer) == columns
        progress = RoundProgress("run", rounds=2, shown=True, stream=writer)
        progress.start(0)
        for r in range(2):
            progress.round_done({"round": r, "train_loss": 0.5, "sum/bytes_down": 2e6, "sum/bytes_up": 1e6}, 0.25)
        progress.close()
        writer.flush()
        shown = _read_all(reader)
    if columns:
        assert "\r" in shown and "2/2" in shown and "round 1 (" not in shown
    else:
        assert "round 1 (2/2): train_loss=0.5000 MB_down=2 MB_up=1 MB_total=6 seconds=0.2" in shown


# ---------------------------------------------------------------------------------------
# Start-up: the placement line after the data checks; this interpreter's own start-up
# ---------------------------------------------------------------------------------------


@pytest.fixture
def as_command_line(monkeypatch):
    """Print the start-up lines as ``python -m fl_lightning`` does."""
    for module in (loop, machine):
        monkeypatch.setattr(module, "launched_by_command_line", lambda: True)


def test_a_refusal_found_in_the_data_is_the_only_line(tmp_path, capsys, as_command_line):
    code = main(tiny_fit(tmp_path / "runs", "r", "--data.calib_size", "100000"))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: data.calib_size:"), lines


def test_an_accepted_run_prints_placement_then_ready_then_rounds(tmp_path, capsys, as_command_line):
    assert main(tiny_fit(tmp_path / "runs", "r", rounds=1)) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0].startswith("fit: 1 rank(s) x 1 thread(s) on cpu") and lines[1].startswith("ready for round 0")
    assert lines[2].startswith("round 0 (1/1): ") and lines[3].startswith("done after 1 rounds: last model test_acc=")
    summary = json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())
    assert f"test_acc={summary['final']['test_acc']:.4f}" in lines[3]
    assert captured.out == ""  # FedAvg has no table, and the summary stays in its file


def test_start_up_counts_from_this_interpreter_not_the_process(monkeypatch):
    """A shell that runs ``pip install ... && python -m fl_lightning`` may exec Python in its own
    process, created before the install: the figure counts from ``__main__``'s clock reading."""
    monkeypatch.setattr(machine.time, "perf_counter", lambda: 1000.0)
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(STARTED=993.5))
    assert machine.process_age() == 6.5
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace())  # not the command line
    assert machine.process_age() == 1000.0 - machine._IMPORTED


# ---------------------------------------------------------------------------------------
# Help and options
# ---------------------------------------------------------------------------------------


def test_fit_help_opens_with_its_description(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "usage: python -m fl_lightning fit [--config FILE.yaml] [--OPTION VALUE ...]"
    assert lines[2].startswith("Train a federation and write runs/<name>/")


def test_top_level_help_names_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "<fit|evaluate|partition|models|extract>" in " ".join(text.split())
    assert all(f"    {name} " in text for name in COMMANDS)


def test_an_abbreviated_option_is_refused(tmp_path, capsys):
    assert main(["fit", "--out_dir", str(tmp_path), "--federation.round", "5"]) == 2
    assert capsys.readouterr().err.startswith("error: federation.round: unknown option")
    assert not list(tmp_path.iterdir())


LOGGER_REFUSALS = [
    ("[NoSuchLogger]", "loggers[0]", "no logger class NoSuchLogger"),
    ("[TensorBoardLogger, {class_path: CSVLogger, init_args: {flush_every: 3}}]", "loggers[1].init_args.flush_every",
     "CSVLogger takes no option flush_every"),
    ("[WandbLogger]", "loggers[0]", "pip install 'fl_lightning[wandb]'"),
    ("[CSVLogger, CSVLogger]", "loggers[1]", "as loggers[0] does"),
    ("[fl_lightning.config.DataConfig]", "loggers[0]", "is not a Lightning logger"),
]


@pytest.mark.parametrize("loggers,key,words", LOGGER_REFUSALS, ids=[k for _, k, _ in LOGGER_REFUSALS])
def test_a_logger_that_cannot_be_made_is_refused_before_any_work(tmp_path, capsys, loggers, key, words):
    if "Wandb" in loggers and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    assert main(tiny_fit(tmp_path / "runs", "r", "--loggers", loggers)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {key}: ") and words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------
# evaluate and partition
# ---------------------------------------------------------------------------------------


def test_evaluate_names_the_round_as_summary_json_does(tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(tiny_fit(out, "r", "--eval.every", "2", rounds=4)) == 0  # validated after rounds 1 and 3
    summary = json.loads((out / "r" / "summary.json").read_text())
    capsys.readouterr()
    for checkpoint, round_idx in (("best", summary["best"]["round"]), ("last", 3)):
        assert main(["evaluate", "--run", str(out / "r"), "--checkpoint", checkpoint, "--fabric.accelerator", "cpu"]) == 0
        assert json.loads(capsys.readouterr().out)["round"] == round_idx, checkpoint


def test_partition_reports_the_budgets_a_run_draws(tmp_path, capsys):
    config = str(ROOT / "configs" / "quickstart.yaml")  # gamma_dirichlet: data shares follow the budgets
    assert main(["partition", "--config", config, "--out", str(tmp_path / "q")]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "q" / "partition.json").read_text())
    quick = PartitionConfig(method="gamma_dirichlet", num_clients=20)
    quick.budgets.zipf_s, quick.budgets.b_min, quick.budgets.b_max = 1.2, 2e5, 12e6
    assert report["budgets"] == client_budgets(quick, seed=0).tolist()
    assert printed.splitlines()[1].split()[3] == "budget" and (tmp_path / "q" / "partition.png").is_file()
    fedavg = str(ROOT / "configs" / "fedavg_digits.yaml")  # dirichlet: shown only when asked
    for extra, shown in (([], False), (["--show_budgets", "true"], True)):
        assert main(["partition", "--config", fedavg, "--out", str(tmp_path / f"f{shown}"), *extra]) == 0
        assert ("budgets" in json.loads((tmp_path / f"f{shown}" / "partition.json").read_text())) == shown


def test_a_searched_cache_beyond_the_supernet_is_the_only_line(tmp_path, capsys, as_command_line):
    """Refused from the population before the placement line (the method's check with the
    budgets and the model's shapes runs in the run's preparation, not once the ranks start)."""
    config = Path(__file__).parents[1] / "configs" / "quickstart.yaml"
    code = main(["fit", "--config", str(config), "--out_dir", str(tmp_path / "runs"), "--fabric.devices", "1",
                 "--algorithm.init_args.cache", "null", "--algorithm.search.segments", "[[20e6, 30e6, 2, 0.4]]"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: algorithm.search.segments[0]:"), lines
    assert not (tmp_path / "runs").exists()
