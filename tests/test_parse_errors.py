"""Where a refused command line goes wrong is found from the command's signature, not from the
parser's text: the walk alone, given an error with no words, names the key and the problem."""

from __future__ import annotations

import pytest

from fl_lightning.cli import main
from fl_lightning.cli.parse_errors import Typed, given_tree, locate

SILENT = ValueError("")  # a refusal whose text says nothing: the walk must not need it


def test_the_tree_merges_configs_in_order_then_the_options(tmp_path):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("train: {lr: 0.1, epochs: 2}\nalgorithm: {class_path: FedProx, init_args: {mu: 0.5}}\n")
    second.write_text("train: {epochs: 3}\n")
    tree = given_tree(["--config", str(first), "--config", str(second), "--train.lr", "0.2",
                       "--model", "fl_lightning.elastic.models.CNN", "--model.width=0.5", "--seed", "-1"])
    assert tree["train"] == {"lr": Typed("0.2"), "epochs": 3}
    assert tree["algorithm"] == {"class_path": "FedProx", "init_args": {"mu": 0.5}}
    assert tree["model"] == {"class_path": "fl_lightning.elastic.models.CNN", "width": Typed("0.5")}
    assert tree["seed"] == Typed("-1")


@pytest.mark.parametrize("argv,expected", [
    (["fit", "--federation.rounds", "0"], ("federation.rounds", "must be an integer >= 1, got 0")),
    (["fit", "--fabric.devices", "two"], ("fabric.devices", "must be an integer >= 1 or auto, got 'two'")),
    (["fit", "--train.lr_schedule", "linear"],
     ("train.lr_schedule", "must be one of constant, exponential, cosine, got 'linear'")),
    (["fit", "--algorithm", "FedProx", "--algorithm.mu=-1"], ("algorithm.mu", "must be a finite number >= 0, got -1")),
    (["fit", "--algorithm.mu", "0.1"], ("algorithm.mu", "not an option of FedAvg")),
    (["fit", "--algorithm", "Feast", "--algorithm.search.population", "1"],
     ("algorithm.search.population", "must be an integer >= 2, got 1")),
    (["fit", "--algorithm", "Uniform", "--algorithm.tier_probs", "x"],  # through **kwargs to the parent
     ("algorithm.tier_probs", "must be a list (a finite number >= 0 each), got 'x'")),
    (["fit", "--federation.roundz", "3"], ("federation.roundz", "unknown option (did you mean federation.rounds?)")),
    (["fit", "--model", "fl_lightning.elastic.models.CNN", "--model.depth", "3"], ("model.depth", "not an option of CNN")),
    (["fit", "--train", "5"], ("train", "expected a mapping of its fields or a YAML file, got '5'")),
    (["fit", "--data", "null"], ("data", "must be a mapping of its fields, got None")),
    (["fit", "--data", "null", "--data.dataset", "fl_lightning.data.Digits"],
     ("data", "must be a mapping of its fields, got None")),
    (["fit", "--algorithm.init_args", "x"], ("algorithm.init_args", "must be a mapping of the class's options, got 'x'")),
    (["fit", "--model", "fl_lightning.elastic.models.CNN", "--model.init_args", "null"],
     ("model.init_args", "must be a mapping of the class's options, got 'null'")),
    (["fit", "--data.dataset", "{init_args: {mu: 2}}", "--data.dataset", "fl_lightning.data.Digits"],
     ("data.dataset.mu", "not an option of Digits")),  # options given before their class stay with it
    (["fit", "--config", "configs/quickstart.yaml", "--federation.rounds.x", "1"],
     ("federation.rounds.x", "unknown option (federation.rounds takes a value, not options)")),
    (["evaluate"], ("run", "required")),
    (["fitt"], ("command", "unknown subcommand 'fitt'; choose one of fit, evaluate, partition, models, extract")),
])
def test_the_walk_names_the_key_without_the_parsers_text(argv, expected):
    assert locate(argv, SILENT) == expected


def test_a_config_file_value_is_named_by_its_key(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("data:\n  dataset:\n    class_path: fl_lightning.data.Synthetic\n"
                      "    init_args: {num_classes: 10, noise: -1}\n")
    assert locate(["fit", "--config", str(config)], SILENT) == (
        "data.dataset.noise", "must be a finite number >= 0, got -1")
    # an option after the file overrides it: the refusal follows the last value given
    assert locate(["fit", "--config", str(config), "--data.dataset.noise", "0.5", "--data.dataset.num_test", "0"],
                  SILENT) == ("data.dataset.num_test", "must be an integer >= 1, got 0")
    assert main(["fit", "--config", str(config), "--out_dir", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err.strip() == "error: data.dataset.noise: must be a finite number >= 0, got -1"


def test_a_section_set_to_null_gets_its_default_class():
    from fl_lightning.cli import parse_command

    import yaml

    resolved = yaml.safe_load(parse_command(["fit", "--model", "null", "--data.dataset", "null"])[2])
    assert resolved["model"]["class_path"] == "fl_lightning.elastic.models.CNN"
    assert resolved["data"]["dataset"]["class_path"] == "fl_lightning.data.Digits"
