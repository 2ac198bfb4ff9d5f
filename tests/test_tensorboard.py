"""What the loggers hold, read back as TensorBoard reads it (``EventAccumulator``): tags grouped by
what they measure, cumulative costs, the final and best test figures at their rounds, the config
as hyperparameters, served models overlaid and named by their MACs, and no step twice after a
resume. The expected figures come from the run's own files (metrics.jsonl, clients.jsonl,
summary.json, cache.json) and from the model's size, not from the logging code."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import plugin_data_pb2

from fl_lightning.cli import main
from fl_lightning.data.federated import build_federated_data
from fl_lightning.federation.builder import build_global_model
from fl_lightning.federation.log_tags import RunTags
from fl_lightning.federation.loggers import RunLoggers
from fl_lightning.federation.loop import Federation
from fl_lightning.cli.saved_runs import load_run_spec

GROUPS = {"train", "val", "test", "traffic", "compute", "clients", "time", "method", "hparams"}
ROOT = Path(__file__).resolve().parents[1]


def tiny_fit(out: Path, name: str, *extra: str, rounds: int = 3) -> list:
    """FedAvg on digits, 2 of 4 clients a round, the test set scored once at the end."""
    return ["fit", "--out_dir", str(out), "--name", name, "--data.dataset", "fl_lightning.data.Digits",
            "--data.val_size", "100", "--partition.method", "iid", "--partition.num_clients", "4",
            "--federation.clients_per_round", "2", "--federation.rounds", str(rounds), "--train.batch_size", "32",
            "--eval.every", "1", "--eval.test", "final", "--fabric.accelerator", "cpu", "--fabric.devices", "1",
            "--loggers", "[TensorBoardLogger, CSVLogger]", *extra]


def events(folder: Path, purge: bool = True) -> EventAccumulator:
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0},
                                   purge_orphaned_data=purge)
    return accumulator.Reload()


def scalars(accumulator: EventAccumulator) -> dict:
    """``{tag: [(step, value), ...]}`` in the order written."""
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def rows(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def csv_rows(path: Path) -> list:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def layout(accumulator: EventAccumulator) -> layout_pb2.Layout:
    (event,) = accumulator.Tensors("custom_scalars__config__")
    return layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])


def chart_regexes(run_layout: layout_pb2.Layout, title: str) -> list:
    charts = [chart for category in run_layout.category for chart in category.chart if chart.title == title]
    assert len(charts) == 1, title
    return list(charts[0].multiline.tag)


def model_bytes(run: Path) -> int:
    """What FedAvg sends a client each way: every tensor of the global model, in its own dtype."""
    spec = load_run_spec(run)
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    return sum(t.numel() * t.element_size() for t in build_global_model(spec, fed).state_dict().values())


def assert_no_step_twice(logged: dict) -> None:
    for tag, points in logged.items():
        steps = [step for step, _ in points]
        assert steps == sorted(set(steps)), f"{tag} logs steps {steps}"


def test_a_short_run_logs_groups_costs_final_figures_and_hyperparameters(tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(tiny_fit(out, "short")) == 0
    run = out / "short"
    accumulator = events(run / "tensorboard")
    logged = scalars(accumulator)
    metrics, summary = rows(run / "metrics.jsonl"), json.loads((run / "summary.json").read_text())

    assert {tag.split("/")[0] for tag in logged} <= GROUPS
    assert {"train/loss", "train/lr", "val/acc", "val/loss", "traffic/down_MB", "traffic/up_MB", "compute/samples",
            "clients/cohort", "time/round_seconds"} <= set(logged)
    assert_no_step_twice(logged)
    # rounds 0-2; float32 in the event file
    assert [s for s, _ in logged["train/loss"]] == [0, 1, 2]
    assert [v for _, v in logged["train/loss"]] == pytest.approx([r["train_loss"] for r in metrics], rel=1e-6)
    # FedAvg sends the whole model both ways to 2 clients a round: 2 x model bytes in MB of 10^6
    # bytes (in MiB the figures would be 4.6% lower), and the cumulative figure adds the rounds up
    sent = 2 * model_bytes(run)
    assert [v for _, v in logged["traffic/down_MB"]] == pytest.approx([sent / 1e6] * 3, rel=1e-6)
    assert [v for _, v in logged["traffic/up_MB_cumulative"]] == pytest.approx([sent / 1e6 * k for k in (1, 2, 3)],
                                                                               rel=1e-6)
    clients = rows(run / "clients.jsonl")
    assert [v for _, v in logged["compute/samples"]] == [sum(c["samples"] for c in clients if c["round"] == r)
                                                         for r in range(3)]

    # eval.test=final: the test set appears once, at the last round, as summary.json has it;
    # the best-validation checkpoint's test figures at the round it was saved
    assert logged["test/acc"] == [(2, pytest.approx(summary["final"]["test_acc"], rel=1e-6))]
    best = summary["best"]
    assert logged["test/best/acc"] == [(best["round"], pytest.approx(best["test_acc"], rel=1e-6))]
    assert logged["hparams/best_val_acc"] == [(2, pytest.approx(best["val_acc"], rel=1e-6))]

    # the flattened config as hyperparameters, with the end figures as the HParams tab's metrics
    content = accumulator.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["train.lr"].number_value == 0.05 and start.hparams["partition.num_clients"].number_value == 4
    assert start.hparams["algorithm.class_path"].string_value == "FedAvg"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in experiment.metric_infos} == {"hparams/test_acc", "hparams/best_test_acc",
                                                              "hparams/best_val_acc"}

    # the custom-scalars layout overlays val and test accuracy on one chart
    accuracy = chart_regexes(layout(accumulator), "accuracy")
    assert {t for t in logged if any(re.search(r, t) for r in accuracy)} == {"val/acc", "test/acc", "test/best/acc"}

    # the CSV logger holds the same rows, and loggers.json says where each logger wrote
    table = [r for r in csv_rows(run / "csv" / "metrics.csv") if r["train/loss"]]
    assert [(int(r["step"]), float(r["train/loss"])) for r in table] == [(m["round"], m["train_loss"]) for m in metrics]
    assert [(w["class_path"].rsplit(".", 1)[-1], w["folder"]) for w in json.loads((run / "loggers.json").read_text())] \
        == [("TensorBoardLogger", "tensorboard"), ("CSVLogger", "csv")]


def test_a_resumed_run_logs_each_round_once_and_its_costs_run_on(tmp_path, monkeypatch):
    """Interrupted in round 3 with the last checkpoint after round 1: rounds 2 is logged twice on
    disk (the first call's and the resumed call's), yet each logger holds each round once."""
    out = tmp_path / "runs"
    argv = tiny_fit(out, "r", "--checkpoint_every", "2", rounds=5)
    run_round = Federation.run_round

    def interrupted(self, round_idx):
        if round_idx == 3:
            raise KeyboardInterrupt
        return run_round(self, round_idx)

    monkeypatch.setattr(Federation, "run_round", interrupted)
    assert main(argv) == 130
    monkeypatch.undo()
    assert main([*argv, "--resume", "auto"]) == 0
    run = out / "r"
    # as TensorBoard read such a folder before: step 2 twice
    unpurged = scalars(events(run / "tensorboard", purge=False))
    assert [s for s, _ in unpurged["train/loss"]] == [0, 1, 2, 2, 3, 4]
    logged = scalars(events(run / "tensorboard"))
    assert_no_step_twice(logged)
    metrics = rows(run / "metrics.jsonl")
    assert [r["round"] for r in metrics] == [0, 1, 2, 3, 4]
    assert [v for _, v in logged["train/loss"]] == pytest.approx([r["train_loss"] for r in metrics], rel=1e-6)
    # carried from the kept rounds: restarted at the resume it would end at 3 rounds' worth,
    # counting round 2 twice at 6
    sent = 2 * model_bytes(run) / 1e6
    assert [v for _, v in logged["traffic/down_MB_cumulative"]] == pytest.approx([sent * k for k in range(1, 6)],
                                                                                 rel=1e-6)
    table = [r for r in csv_rows(run / "csv" / "metrics.csv") if r["train/loss"]]
    assert [int(r["step"]) for r in table] == [0, 1, 2, 3, 4]
    assert [float(r["train/loss"]) for r in table] == [r["train_loss"] for r in metrics]


def test_feast_serves_its_variants_on_one_chart_named_by_their_macs(tmp_path, capsys):
    """The quick start config shrunk to two rounds of two clients on a third of its data."""
    assert main(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
                 "--algorithm.init_args.cache", str(ROOT / "configs" / "caches" / "quickstart.json"),
                 "--data.dataset.init_args.num_train", "1000", "--data.dataset.init_args.num_test", "200",
                 "--data.val_size", "100", "--partition.min_size", "1", "--federation.rounds", "2",
                 "--federation.clients_per_round", "2", "--train.epochs", "1", "--eval.every", "1",
                 "--fabric.devices", "1", "--out_dir", str(tmp_path), "--name", "q"]) == 0
    run = tmp_path / "q"
    printed = capsys.readouterr().out
    accumulator = events(run / "tensorboard")
    logged = scalars(accumulator)
    assert_no_step_twice(logged)

    def name(j: int, macs: int) -> str:  # 3 significant digits, K below a million
        return f"variant{j:02d}_" + (f"{macs / 1e6:.3g}M" if macs >= 1e6 else f"{macs / 1e3:.3g}K") + "_MACs"

    cache = json.loads((run / "cache.json").read_text())
    variants = {f"test/served/{name(j, v['macs'])}": j for j, v in enumerate(cache["variants"])}
    summary = json.loads((run / "summary.json").read_text())
    # the final test scores every cached variant at the last round, each under its MACs
    assert {t for t in logged if t.startswith("test/served/")} == set(variants)
    for tag, j in variants.items():
        assert logged[tag] == [(1, pytest.approx(summary["final"][f"test_variant{j:02d}_acc"], rel=1e-6))]
    # validation scores the served variants every round; one chart overlays them, and only them
    served = {t for t in logged if t.startswith("val/served/")}
    assert served and served <= {t.replace("test/", "val/", 1) for t in variants}
    regexes = chart_regexes(layout(accumulator), "validation accuracy of each served model")
    assert {t for t in logged if any(re.search(r, t) for r in regexes)} == served
    assert all([s for s, _ in logged[t]] == [0, 1] for t in served)
    # the console ends with the method's table; the summary stays in its file
    assert "rounds_done" not in printed
    assert printed.rstrip().splitlines()[-1].startswith("population accuracy")


def test_tags_group_a_figure_by_its_key_alone():
    from fl_lightning.algorithms.levels import LevelAssignment

    levels = LevelAssignment.by_budget([23_400, 1_500_000], [1e5, 2e6], lambda k: ("levels", f"level {k}"))
    assert levels.served_names() == {"level1_acc": "level1 23.4K MACs", "level2_acc": "level2 1.5M MACs"}
    tags = RunTags(levels.served_names())
    assert tags.tag("sum/bytes_down") == ("traffic/down_MB", 1e-6)
    assert tags.tag("sum/prompt_bytes_up") == ("traffic/prompt_up_MB", 1e-6)
    assert tags.tag("sum/train_macs") == ("compute/train_GMACs", 1e-9)
    assert tags.tag("sum/seconds") == ("time/client_seconds_sum", 1.0)
    assert tags.tag("sum/fallback") == ("clients/fallback_sum", 1.0)
    assert tags.tag("val_level2_acc") == ("val/served/level2_1.5M_MACs", 1.0)
    assert tags.tag("test_acc_cut1") == ("test/served/cut1", 1.0)  # no name given: its key
    assert tags.tag("val_mean_level_acc") == ("val/mean_level_acc", 1.0)
    assert tags.tag("mass/trained_frac") == ("method/mass/trained_frac", 1.0)
    # cumulative costs: 3,000,000 bytes and 2.5e9 training MACs a round
    row = {"round": 0, "sum/bytes_down": 3_000_000, "sum/train_macs": 2.5e9, "sum/steps": 7}
    tags.carry([row, {**row, "round": 1}])
    figures = tags.round_figures({**row, "round": 2})
    assert figures["traffic/down_MB_cumulative"] == pytest.approx(9.0)
    assert figures["compute/train_GMACs_cumulative"] == pytest.approx(7.5)
    assert "compute/steps_cumulative" not in figures
    # the best checkpoint's headline test figures; its served models' stay in summary.json
    best = tags.best({"round": 1, "val_acc": 0.5, "test_acc": 0.4, "test_loss": 1.5, "test_level2_acc": 0.3})
    assert best == {"test/best/acc": 0.4, "test/best/loss": 1.5}


def test_the_end_figures_land_at_their_rounds(tmp_path):
    """The best checkpoint's test figures at its round (1), the last model's at the last round
    (4) unless that round logged them already, the config and headline figures as hyperparameters."""
    from types import SimpleNamespace

    from lightning.fabric.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="csv", version="")
    run = SimpleNamespace(tags=RunTags(), logs=RunLoggers([logger], tmp_path), logged_last={"val/acc"},
                          spec=SimpleNamespace(federation=SimpleNamespace(rounds=5), config_yaml="train:\n  lr: 0.1\n"))
    summary = {"final": {"test_acc": 0.7, "test_loss": 0.9, "val_acc": 0.6},
               "best": {"round": 1, "val_acc": 0.65, "test_acc": 0.72}}
    Federation._log_end(run, summary)
    logged = {(int(r["step"]), k): float(v) for r in csv_rows(tmp_path / "csv" / "metrics.csv")
              for k, v in r.items() if k != "step" and v}
    assert logged == {(4, "test/acc"): 0.7, (4, "test/loss"): 0.9, (1, "test/best/acc"): 0.72,
                      (4, "hparams/test_acc"): 0.7, (4, "hparams/best_test_acc"): 0.72, (4, "hparams/best_val_acc"): 0.65}
