"""The before/after tools: which configs a recording runs, and the comparison of two runs'
figures (wall times left out, deliberate renames ignorable)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import compare_runs  # noqa: E402
import record_runs  # noqa: E402


def write_run(folder: Path, metrics, clients):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (folder / "clients.jsonl").write_text("".join(json.dumps(r) + "\n" for r in clients))


def test_recording_takes_the_offline_configs_and_names_runs_after_their_paths():
    configs = {str(c) for c in record_runs.offline_configs(ROOT)}
    assert "configs/fedavg_digits.yaml" in configs and "configs/quickstart.yaml" in configs
    assert "configs/split/offline/mnist_subset/resnet18_narrow/fedsga.yaml" in configs
    assert "configs/feast_cifar100.yaml" not in configs  # needs a download
    assert not any(c.startswith("configs/feast/ablation/") for c in configs)  # overlays name no data
    assert record_runs.run_name(Path("configs/supernet/offline/synthetic/feast.yaml")) == "supernet_offline_synthetic_feast"


def test_identical_figures_pass_and_times_do_not_count(tmp_path, capsys):
    write_run(tmp_path / "a" / "x", [{"round": 0, "test_acc": 0.5, "round_seconds": 1.0}],
              [{"client": 3, "loss": 0.25, "seconds": 2.0, "bytes_up": 40}])
    write_run(tmp_path / "b" / "x", [{"round": 0, "test_acc": 0.5, "round_seconds": 9.0}],
              [{"client": 3, "loss": 0.25, "seconds": 7.0, "bytes_up": 40}])
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "x: identical" in capsys.readouterr().out


def test_a_changed_figure_is_named_unless_ignored(tmp_path, capsys):
    write_run(tmp_path / "a" / "x", [{"round": 0, "test_acc": 0.5, "sum/model_bytes": 8}],
              [{"client": 3, "loss": 0.25, "model_bytes": 8}])
    write_run(tmp_path / "b" / "x", [{"round": 0, "test_acc": 0.5, "sum/model_bytes_up": 8}],
              [{"client": 3, "loss": 0.25, "model_bytes_up": 8}])
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "metrics.jsonl row 0: sum/model_bytes 8 against None" in capsys.readouterr().out
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b"), "--ignore", "model_bytes",
                              "model_bytes_up"]) == 0
    write_run(tmp_path / "c" / "x", [{"round": 0, "test_acc": 0.5000001, "sum/model_bytes": 8}],
              [{"client": 3, "loss": 0.25, "model_bytes": 8}])
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "c")]) == 1


def test_bad_recording_options_stop_in_one_line_before_anything_is_written(tmp_path, capsys):
    import pytest

    out = tmp_path / "runs"
    for argv in (["--rounds", "0"], ["--rounds", "two"]):
        with pytest.raises(SystemExit) as stop:
            record_runs.main([str(out), *argv])
        assert stop.value.code == 2 and "--rounds" in capsys.readouterr().err
    assert record_runs.main([str(out), "--configs", "configs/missing.yaml"]) == 2
    assert capsys.readouterr().err.startswith("error: configs: configs/missing.yaml")
    assert record_runs.main([str(out), "--root", str(tmp_path / "nowhere")]) == 2
    assert not out.exists()


def test_a_renamed_figure_is_compared_under_its_new_names(tmp_path, capsys):
    """model_bytes became model_bytes_down and model_bytes_up: equal values pass, a changed one
    under either new name is named; a malformed rename stops in one line."""
    write_run(tmp_path / "a" / "x", [{"round": 0, "sum/model_bytes": 8}], [{"client": 3, "model_bytes": 8}])
    write_run(tmp_path / "b" / "x", [{"round": 0, "sum/model_bytes_down": 8, "sum/model_bytes_up": 8}],
              [{"client": 3, "model_bytes_down": 8, "model_bytes_up": 8}])
    write_run(tmp_path / "c" / "x", [{"round": 0, "sum/model_bytes_down": 8, "sum/model_bytes_up": 9}],
              [{"client": 3, "model_bytes_down": 8, "model_bytes_up": 8}])
    rename = ["--renamed", "model_bytes=model_bytes_down,model_bytes_up"]
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b"), *rename]) == 0
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "c"), *rename]) == 1
    assert "sum/model_bytes_up 8 against 9" in capsys.readouterr().out
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b"), "--renamed", "model_bytes"]) == 2
    assert "--renamed: expected OLD=NEW" in capsys.readouterr().err


def write_checkpoint(run: Path, model: dict, class_path: str) -> None:
    import torch

    (run / "checkpoints").mkdir()
    torch.save({"model": model, "round": 1, "method": {"class_path": class_path, "init_args": {}}},
               run / "checkpoints" / "last.ckpt")


def test_checkpoints_are_compared_entry_by_entry_and_a_moved_method_is_the_same(tmp_path, capsys):
    """Every tensor of the checkpoints by dtype, shape and bits; the method record by class name,
    as a checkpoint loads (a method moved to another module writes the same checkpoint)."""
    import torch

    weight = torch.tensor([0.25, -1.5])
    for name, value, path in (("a", weight, "fl_lightning.algorithms.base.FedAvg"),
                              ("b", weight.clone(), "fl_lightning.algorithms.fedavg.FedAvg"),
                              ("c", torch.tensor([0.25, -1.5000001]), "fl_lightning.algorithms.fedavg.FedAvg"),
                              ("d", weight.double(), "fl_lightning.algorithms.fedavg.FedAvg"),
                              ("e", weight.clone(), "fl_lightning.algorithms.fedavg.FedProx")):
        write_run(tmp_path / name / "x", [{"round": 0, "test_acc": 0.5}], [{"client": 3, "loss": 0.25}])
        write_checkpoint(tmp_path / name / "x", {"w": value}, path)
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    capsys.readouterr()
    for other, named in (("c", "last.ckpt: model/w"), ("d", "last.ckpt: model/w"),
                         ("e", "last.ckpt: method/class_path")):
        assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / other)]) == 1
        assert named in capsys.readouterr().out
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "c"), "--figures-only"]) == 0


def test_an_ignored_option_added_to_the_checkpoint_hides_only_itself(tmp_path, capsys):
    """An option a change added (``eval_widths`` in the method's arguments) is left out of the
    checkpoints by ``--ignore``; a model tensor that differs behind it is still named."""
    import torch

    weight = torch.tensor([0.25, -1.5])
    for name, value, options in (("a", weight, {}), ("b", weight.clone(), {"eval_widths": [0.5, 1.0]}),
                                 ("c", torch.tensor([0.25, -1.25]), {"eval_widths": [0.5, 1.0]})):
        write_run(tmp_path / name / "x", [{"round": 0, "test_acc": 0.5}], [{"client": 3, "loss": 0.25}])
        (tmp_path / name / "x" / "checkpoints").mkdir()
        torch.save({"model": {"w": value}, "round": 1, "method": {"class_path": "FedAvg", "init_args": options}},
                   tmp_path / name / "x" / "checkpoints" / "last.ckpt")
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "method/init_args/eval_widths only in the second" in capsys.readouterr().out
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b"), "--ignore", "eval_widths"]) == 0
    capsys.readouterr()
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "c"), "--ignore", "eval_widths"]) == 1
    assert "last.ckpt: model/w" in capsys.readouterr().out
