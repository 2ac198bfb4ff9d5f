"""The ranks-and-resume check (tools/check_ranks_resume.py) on run folders written here: which
config each method gets, what counts as a difference, what a stopped check reruns, exit codes."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import check_ranks_resume as check  # noqa: E402

METRICS = [{"round": 0, "lr": 0.05, "train_loss": 1.25, "round_seconds": 1.0, "val_acc": 0.5, "val_loss": 1.5},
           {"round": 1, "lr": 0.025, "train_loss": 0.75, "round_seconds": 2.0, "val_acc": 0.75, "val_loss": 1.0}]
CLIENTS = [{"round": r, "client": c, "loss": 1.0 + c / 8, "samples": 10 + c, "seconds": 0.1 * c} for r in (0, 1)
           for c in (3, 5)]


def state():
    return {"model": {"w": torch.linspace(-1, 1, 12).reshape(3, 4), "n": torch.tensor(7)},
            "algorithm": {"c/w": torch.full((3, 4), 0.25)}, "round": 2, "best": {"val_acc": 0.75, "round": 1},
            "method": {"class_path": "fl_lightning.algorithms.FedAvg", "init_args": {"bn": None}}}


def write_run(folder: Path, metrics=METRICS, clients=CLIENTS, ckpt=None, rounds_done=2):
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (folder / "clients.jsonl").write_text("".join(json.dumps(r) + "\n" for r in clients))
    torch.save(ckpt or state(), folder / "checkpoints" / "last.ckpt")
    (folder / "summary.json").write_text(json.dumps({"rounds_done": rounds_done, "rounds": 2}))


def method_folder(tmp_path, one=None, two=None, resumed=None) -> Path:
    folder = tmp_path / "FedAvg-fedavg_digits"
    for name, changes in (("one", one), ("two", two), ("resumed", resumed)):
        write_run(folder / name, **(changes or {}))
    return folder


def test_identical_runs_pass_and_wall_times_do_not_count(tmp_path):
    slower = [dict(r, round_seconds=9.0) for r in METRICS]
    result = check.compare(method_folder(tmp_path, two={"metrics": slower}, resumed={"metrics": slower}))
    assert result["resume_exact"] and result["two_identical"] and result["passed"]
    assert result["two_tensor_gap"] == 0 and result["two_figure_gap"] == 0


@pytest.mark.parametrize("part,key", [("model", "w"), ("algorithm", "c/w")])
def test_one_bit_in_a_resumed_checkpoint_tensor_is_named(tmp_path, part, key):
    changed = state()
    flat = changed[part][key].view(-1)
    flat[5] = torch.nextafter(flat[5], torch.tensor(2.0))  # one unit in the last place
    result = check.compare(method_folder(tmp_path, resumed={"ckpt": changed}))
    assert result["resume_difference"] == f"last.ckpt: {part}/{key}" and not result["passed"]
    assert result["two_identical"]


@pytest.mark.parametrize("change,named", [
    (lambda s: s.update(round=1), "last.ckpt: round"),
    (lambda s: s["best"].update(round=0), "last.ckpt: best/round"),
    (lambda s: s["model"].update(n=torch.tensor(7.0)), "last.ckpt: model/n"),  # same value, another dtype
    (lambda s: s["algorithm"].pop("c/w"), "last.ckpt: algorithm/c/w only in the first"),
])
def test_every_entry_of_the_checkpoint_counts_for_resume(tmp_path, change, named):
    changed = state()
    change(changed)
    assert check.compare(method_folder(tmp_path, resumed={"ckpt": changed}))["resume_difference"] == named


def test_a_resumed_figure_that_differs_is_named(tmp_path):
    clients = [dict(r) for r in CLIENTS]
    clients[3]["loss"] += 2 ** -40
    result = check.compare(method_folder(tmp_path, resumed={"clients": clients}))
    assert result["resume_difference"].startswith("clients.jsonl row 3: loss") and not result["passed"]


def test_two_ranks_report_the_largest_difference_and_gather_order_does_not_count(tmp_path):
    changed = state()
    changed["algorithm"]["c/w"][2, 1] += 0.125
    changed["model"]["w"][0, 0] += 2 ** -20
    metrics = [dict(r) for r in METRICS]
    metrics[1]["val_loss"] = 1.0 + 3e-7  # an evaluation's float32 sum grouped by rank
    result = check.compare(method_folder(tmp_path, two={"ckpt": changed, "metrics": metrics,
                                                      "clients": CLIENTS[::-1]}))
    assert result["two_tensor_gap"] == 0.125 and result["two_tensor_key"] == "algorithm/c/w"
    assert result["two_figure_gap"] == pytest.approx(3e-7, rel=1e-6)
    assert result["two_figure_key"] == "metrics.jsonl round 1: val_loss"
    assert not result["two_identical"] and not result["passed"]  # any tensor difference fails
    assert result["resume_exact"]


def test_two_rank_figures_within_rounding_pass_and_beyond_fail(tmp_path):
    def verdict(folder, val_loss):
        metrics = [dict(r) for r in METRICS]
        metrics[1]["val_loss"] = val_loss
        return check.compare(method_folder(folder, two={"metrics": metrics}))

    within = verdict(tmp_path / "a", 1.0 * (1 + 0.5 * check.FIGURE_RTOL))
    assert within["passed"] and not within["two_identical"]
    assert not verdict(tmp_path / "b", 1.0 * (1 + 2 * check.FIGURE_RTOL))["passed"]
    clients = [dict(r) for r in CLIENTS]
    clients[0]["skipped"] = "non-finite loss"  # a key only one run has
    assert check.figure_gap(method_folder(tmp_path / "c", two={"clients": clients}) / "one",
                            tmp_path / "c" / "FedAvg-fedavg_digits" / "two")[0] == float("inf")


def test_the_cheapest_config_per_method_and_the_stand_in(tmp_path):
    def config(path, dataset, algorithm):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(f"data:\n  dataset:\n    class_path: fl_lightning.data.{dataset}\n"
                                     f"algorithm:\n  class_path: fl_lightning.algorithms.{algorithm}\n")
        return Path(path)

    configs = [config("configs/a/heterofl.yaml", "MNISTSubset", "HeteroFL"),
               config("configs/b/heterofl.yaml", "Digits", "HeteroFL"),
               config("configs/a/feast.yaml", "CIFAR10", "Feast"),
               config("configs/z/feast.yaml", "Synthetic", "Feast"),
               config("configs/a/scaffold.yaml", "MNISTSubset", "Scaffold")]
    picked = check.cheapest_configs(tmp_path, ["HeteroFL", "Feast", "Scaffold", "FedOpt", "FedAvg"], configs)
    assert picked["HeteroFL"] == (Path("configs/b/heterofl.yaml"), [])
    assert picked["Feast"] == (Path("configs/z/feast.yaml"), [])
    assert picked["Scaffold"] == (Path("configs/a/scaffold.yaml"), [])
    config, extra = picked["FedOpt"]
    assert config == Path("configs/fedavg_digits.yaml") and "fl_lightning.algorithms.FedOpt" in extra
    assert "FedAvg" not in picked


def test_every_method_kind_is_a_class_of_the_package():
    from fl_lightning import algorithms

    kinds = check.method_kinds()
    assert len(kinds) == 25 and "Algorithm" not in kinds and "SubmodelAlgorithm" not in kinds
    assert {"FedAvg", "FedOpt", "FedDyn", "Feast", "HASFL", "SplitFed", "MultiSFL", "FIARSE"} <= set(kinds)
    assert all(issubclass(getattr(algorithms, k), algorithms.Algorithm) for k in kinds)
    for kind, (config, _) in check.STAND_INS.items():
        assert kind in kinds and (ROOT / config).is_file()


def test_a_stopped_check_reruns_only_unfinished_runs(tmp_path, monkeypatch):
    folder = tmp_path / "FedAvg-fedavg_digits"
    write_run(folder / "one")
    write_run(folder / "two", rounds_done=1)  # killed: its summary is of an earlier stop
    calls = []

    def fake_fit(command, err, root):
        name = command[command.index("--name") + 1]
        calls.append((name, command[command.index("--name") + 2:]))
        stop = int(command[command.index("--stop_after") + 1]) if "--stop_after" in command else 2
        if "--resume" not in command:
            assert not (folder / name).exists()  # an unfinished run starts afresh
            write_run(folder / name, rounds_done=stop)
        else:
            (folder / name / "summary.json").write_text(json.dumps({"rounds_done": 2, "rounds": 2}))
        return 0, 1.5

    monkeypatch.setattr(check, "fit", fake_fit)
    seconds, failure = check.run_all(folder, Path("configs/fedavg_digits.yaml"), [], 2, ROOT)
    assert failure is None and seconds == {"two": 1.5, "resumed": 3.0}
    assert calls == [("two", ["--fabric.devices", "2"]),
                     ("resumed", ["--fabric.devices", "1", "--stop_after", "1"]),
                     ("resumed", ["--fabric.devices", "1", "--resume", "auto"])]


def run_main(tmp_path, monkeypatch, capsys, **changes):
    out = tmp_path / "out"
    method_folder(out, **changes)
    monkeypatch.setattr(check, "fit", lambda *a: pytest.fail("a finished run ran again"))
    rc = check.main([str(out), "--configs", "configs/fedavg_digits.yaml"])
    return rc, capsys.readouterr().out, out


def test_the_check_exits_0_when_all_agree_and_keeps_its_verdict(tmp_path, monkeypatch, capsys):
    rc, printed, out = run_main(tmp_path, monkeypatch, capsys)
    assert rc == 0 and "FedAvg" in printed.splitlines()[1] and printed.splitlines()[1].endswith(" yes")
    assert json.loads((out / "FedAvg-fedavg_digits" / "check.json").read_text())["passed"]
    assert (out / "table.txt").read_text() == printed


@pytest.mark.parametrize("changes,named", [
    ({"resumed": {"metrics": [METRICS[0], dict(METRICS[1], val_acc=0.74)]}}, "metrics.jsonl row 1: val_acc"),
    ({"two": {"ckpt": {**state(), "model": {**state()["model"], "w": state()["model"]["w"] + 2 ** -23}}}},
     "model/w"),
])
def test_an_injected_difference_exits_1(tmp_path, monkeypatch, capsys, changes, named):
    rc, printed, _ = run_main(tmp_path, monkeypatch, capsys, **changes)
    assert rc == 1 and named in printed


@pytest.mark.parametrize("argv,line", [
    (["--methods", "FedAvg", "NoSuchMethod"], "methods: NoSuchMethod is not a method kind"),
    (["--rounds", "1", "--methods", "FedAvg"], "rounds: the resumed run stops after round 1"),
    (["--rounds", "two", "--methods", "FedAvg"], "--rounds"),
    (["--configs", "configs/no_such.yaml"], "configs: configs/no_such.yaml is not a full config"),
    (["--configs", "configs/feast/ablation/rule_min_only.yaml"],  # an overlay: no data section
     "rule_min_only.yaml is not a full config"),
    (["--configs", "configs/fedavg_digits.yaml", "--methods", "Scaffold"],
     "configs: none of them names one of Scaffold"),
])
def test_bad_options_exit_2_in_one_line_and_write_nothing(tmp_path, monkeypatch, capsys, argv, line):
    out = tmp_path / "out"
    monkeypatch.setattr(check, "fit", lambda *a: pytest.fail("a bad option started a run"))
    try:
        rc = check.main([str(out), *argv])
    except SystemExit as exit:  # the argument parser's own refusals
        rc = exit.code
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and line in err, err
    assert not out.exists()


def test_an_out_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "out").write_text("")
    assert check.main([str(tmp_path / "out"), "--methods", "FedAvg"]) == 2
    assert capsys.readouterr().err.startswith("error: out:")

