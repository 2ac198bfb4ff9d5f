"""Command-line behaviour: one-line errors before any work, complete configs, shipped YAMLs."""

import json
from pathlib import Path

import pytest
import yaml

from fl_lightning.cli import build_parser, main

CONFIGS = sorted((Path(__file__).parents[1] / "configs").rglob("*.yaml"))


def run_cli(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.err


BAD = [
    (["--federation.roundz", "3"], "roundz"),
    (["--federation.rounds", "three"], "rounds"),
    (["--partition.alpha", "0"], "partition.alpha"),
    (["--partition.alpha", "-1"], "partition.alpha"),
    (["--federation.clients_per_round", "50"], "federation.clients_per_round"),
    (["--data.dataset", "fl_lightning.data.MnistTypo"], "data.dataset"),
    (["--data.name", "digits"], "data.name"),
    (["--algorithm", "NoSuchAlgorithm"], "algorithm"),
    (["--model", "fl_lightning.elastic.models.Nope"], "model"),
    (["--data.dataset", "fl_lightning.data.CIFAR10", "--data.root", "/nonexistent/dir"], "data.root"),
    (["--algorithm", "Scaffold", "--train.momentum", "0.9"], "train.momentum"),
    (["--partition.method", "shards"], "partition.method"),
    (["--train.lr_schedule", "linear"], "train.lr_schedule"),
]


@pytest.mark.parametrize("args,key", BAD)
def test_bad_config_fails_with_one_line_naming_the_key(tmp_path, capsys, args, key):
    out = tmp_path / "runs"
    code, err = run_cli(["fit", "--out_dir", str(out), *args], capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert key in lines[0], err
    assert "Traceback" not in err
    assert not out.exists(), "nothing may be written before the config is valid"


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "runs" / "x" / "checkpoints").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "checkpoints" / "last.ckpt").write_bytes(b"keep")
    code, err = run_cli(["fit", "--name", "x", "--out_dir", str(tmp_path / "runs")], capsys)
    assert code == 2 and "--resume auto" in err
    assert (tmp_path / "runs" / "x" / "checkpoints" / "last.ckpt").read_bytes() == b"keep"


def test_print_config_is_complete_and_runnable(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "configs/quickstart.yaml", "--print_config"])
    printed = capsys.readouterr().out
    cfg = yaml.safe_load(printed)
    for section in ("data", "partition", "model", "algorithm", "train", "federation", "eval", "fabric"):
        assert section in cfg
    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    parser = build_parser()
    again = parser.parse_args(["fit", "--config", str(path)])
    assert again.fit.federation.rounds == cfg["federation"]["rounds"]


def test_fit_parses_into_the_run_that_a_saved_config_reopens(tmp_path):
    """One schema: the command line gives a RunSpec, and the config it resolves to reopens as an
    equal RunSpec (sections equal, the same algorithm with the same options)."""
    from fl_lightning.cli import load_fit_config, parse_command
    from fl_lightning.federation.run_spec import RunSpec

    command, spec, resolved = parse_command(["fit", "--config", "configs/fedavg_digits.yaml", "--algorithm",
                                             "FedProx", "--algorithm.mu", "0.25", "--seed", "7"])
    assert command == "fit" and type(spec) is RunSpec and (spec.seed, spec.algorithm.mu) == (7, 0.25)
    path = tmp_path / "config.yaml"
    path.write_text(resolved)
    again = load_fit_config(path)
    assert type(again) is RunSpec
    for name in ("data", "partition", "train", "federation", "eval", "fabric", "seed", "name", "loggers"):
        assert getattr(again, name) == getattr(spec, name), name
    assert type(again.algorithm) is type(spec.algorithm) and vars(again.algorithm) == vars(spec.algorithm)
    assert (spec.resume_from, spec.config_yaml) == (None, "")  # filled in by fit, never options


def test_every_command_has_documented_options_and_a_runner():
    """Each command's dataclass: every option has a docstring (its --help), the parser takes
    exactly its options, and a function of commands.py runs it."""
    from docstring_parser import parse_from_object

    from fl_lightning.cli.commands import run
    from fl_lightning.cli.parser import shared_parser
    from fl_lightning.cli.schema import COMMANDS, options

    for name, cls in COMMANDS.items():
        documented = {p.arg_name: p.description for c in cls.__mro__[:-1] for p in parse_from_object(c).params}
        assert all(documented.get(f.name) for f in options(name)), name
        parsed = shared_parser().subcommand_parsers[name].get_defaults()
        assert set(vars(parsed)) - {"config"} == {f.name for f in options(name)}, name
        assert run.dispatch(cls) is not run.dispatch(object), name


OVERLAY_BASE = Path(__file__).parents[1] / "configs" / "quickstart.yaml"


def leaves(tree, prefix=()):
    """(key path, value) of every leaf of a YAML mapping (lists and empty mappings are leaves)."""
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def plain(value):
    return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value


@pytest.fixture(scope="module")
def shared_parser():
    """One parser for the shipped configs (building it takes longer than parsing a file with it)."""
    return build_parser()


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(p.parents[1])) for p in CONFIGS])
def test_every_shipped_config_parses_to_the_values_it_holds(path, shared_parser):
    """Full configs parse alone; overlays (first line '# overlay') on top of a FEAST config.
    Every value the file sets is the value the parsed config holds (nothing dropped, renamed
    or coerced to something else), and the algorithm's checks accept it."""
    parser = shared_parser
    configs = ["--config", str(path)]
    if path.read_text().startswith("# overlay"):
        configs = ["--config", str(OVERLAY_BASE)] + configs
    cfg = parser.parse_args(["fit", *configs])
    parsed = cfg.fit.as_dict()
    written = yaml.safe_load(path.read_text())
    assert written, path
    for keys, value in leaves(written):
        held = parsed
        for key in keys:
            assert isinstance(held, dict) and key in held, (keys, "missing from the parsed config")
            held = held[key]
        assert plain(held) == plain(value), (keys, held, value)
    args = parser.instantiate(cfg).fit
    args.algorithm.check(args.train)


FEAST_PAPER = {"feast_cifar100": ("cifar100", "train", 4500, 500, False),
               "feast_cinic10": ("cinic10", "valid", 81000, 9000, True),
               "feast_tinyimagenet": ("tinyimagenet", "train", 9000, 1000, True)}


@pytest.mark.parametrize("name", sorted(FEAST_PAPER))
def test_feast_paper_configs_hold_the_papers_protocol(name):
    """Sec. 4.1 and Supp. A/B/E.1: 100 clients, 10 per round, one local epoch of batch 64, 4000
    rounds, Zipf(1.2) budgets over 25M-1500M MACs capped at 600M for allocation, gamma 1,
    alpha_eff 0.45, RandAugment(2, 6) with alternating Mixup 0.4 / CutMix 1.0, SGD lr 0.025 with
    momentum 0.9, weight decay 1e-4, cosine, clipping at 10; the full rule with rho_KD 0.5,
    routing on; the shipped CIFAR-100 cache (retargeted on the other data sets)."""
    from fl_lightning.algorithms import Feast

    parser = build_parser()
    args = parser.instantiate(parser.parse_args(["fit", "--config", f"configs/{name}.yaml"])).fit
    dataset, source, val, calib, retarget = FEAST_PAPER[name]
    assert (args.data.dataset.name, args.data.server_source, args.data.val_size, args.data.calib_size) == \
        (dataset, source, val, calib)
    assert list(args.data.randaugment) == [2, 6]
    p = args.partition
    assert (p.method, p.num_clients, p.alpha_eff, p.gamma) == ("gamma_dirichlet", 100, 0.45, 1.0)
    assert (p.budgets.zipf_s, p.budgets.b_min, p.budgets.b_max, p.budgets.b_cap) == (1.2, 25e6, 1500e6, 600e6)
    assert (args.federation.rounds, args.federation.clients_per_round) == (4000, 10)
    t = args.train
    assert (t.epochs, t.batch_size, t.lr, t.momentum, t.weight_decay, t.grad_clip, t.lr_schedule) == \
        (1, 64, 0.025, 0.9, 1e-4, 10.0, "cosine")
    assert args.model.class_path == "fl_lightning.elastic.models.OFAResNet" and args.model.init_args.block == "basic_pair"
    a = args.algorithm
    assert isinstance(a, Feast)
    assert (a.cache_path, a.retarget, a.routing, a.rule, a.rho_kd) == \
        ("configs/caches/feast_cifar100.json", retarget, True, "full", 0.5)
    assert (a.mixup_alpha, a.cutmix_alpha, a.mix_schedule) == (0.4, 1.0, "alternate")
    assert args.seed == 4508837 and args.eval.every == 20


def test_partition_command_writes_report(tmp_path, capsys):
    code = main(["partition", "--config", "configs/quickstart.yaml", "--out", str(tmp_path / "p")])
    out = capsys.readouterr().out
    assert code == 0 and "TV" in out
    assert (tmp_path / "p" / "partition.json").is_file() and (tmp_path / "p" / "partition.png").is_file()


def test_models_command_shows_quadratic_law(capsys):
    code = main(["models", "--model", "fl_lightning.elastic.models.ResNet18", "--num_classes", "100", "--input_shape", "[3, 32, 32]",
                 "--widths", "[0.25, 0.5, 1.0]"])
    out = capsys.readouterr().out
    assert code == 0 and "width=0.25" in out and "6.3" in out and "25.1" in out


def test_help_shows_field_docstrings(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert "Clients m sampled uniformly without replacement" in out


def test_help_lists_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    for choices in ("{own,global}", "{iid,dirichlet,natural,gamma_dirichlet}",
                    "{constant,exponential,cosine}", "{every,final}", "{train,valid}",
                    "{auto,cpu,cuda,gpu,mps,tpu}", "{auto,ddp,", "bf16-mixed"):
        assert choices in out, choices


def test_choice_types_match_the_registries(capsys):
    """config.py spells the choices out (no torch or Lightning at parse time); they must follow
    the code."""
    from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
    from lightning.fabric.plugins.precision import precision as fabric_precision
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from typing import get_args

    from fl_lightning import config

    assert set(config.ACCELERATORS) == set(ACCELERATOR_REGISTRY.available_accelerators()) | {"auto", "gpu"}
    assert set(config.STRATEGIES) == set(STRATEGY_REGISTRY.available_strategies()) | {"auto"}
    fabric_strings = set(get_args(fabric_precision._PRECISION_INPUT_STR)) | set(
        get_args(fabric_precision._PRECISION_INPUT_STR_ALIAS))
    assert set(get_args(config.Precision)) == fabric_strings
    assert set(get_args(config.PrecisionInt)) == set(get_args(fabric_precision._PRECISION_INPUT_INT))
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "ddp_find_unused_parameters_true" in text and "bf16-mixed" in text and "transformer-engine" in text
    assert main(["fit", "--fabric.strategy", "ddq"]) == 2
    assert "error: fabric.strategy: must be one of auto, ddp," in capsys.readouterr().err


def test_cli_imports_neither_torch_nor_lightning():
    import subprocess
    import sys

    code = ("import sys, fl_lightning.cli; "
            "print(sorted(m for m in ('torch', 'lightning', 'fl_lightning.algorithms') if m in sys.modules))")
    src = str(Path(__file__).parents[1] / "src")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PYTHONPATH": src}).stdout
    assert out.strip() == "[]"


def test_runs_saved_with_a_named_model_and_dataset_resume_and_evaluate(tmp_path, capsys):
    """A run directory written when models and datasets were named (model: {name, kwargs}, data:
    {name, options}) is read as the same class_path sections: the same command continues it,
    another model or dataset option is refused, and evaluate rebuilds it."""
    out = str(tmp_path / "runs")
    base = ["fit", "--data.dataset", "fl_lightning.data.Synthetic", "--data.dataset.num_train", "200",
            "--data.dataset.num_test", "40", "--data.dataset.image_size", "8", "--partition.num_clients", "4",
            "--federation.clients_per_round", "2", "--federation.rounds", "3", "--fabric.accelerator", "cpu",
            "--out_dir", out, "--name", "r", "--model.channels", "[8, 16]"]
    saved = tmp_path / "runs" / "r" / "config.yaml"

    def write_old_form():
        tree = yaml.safe_load(saved.read_text())
        assert tree["model"]["class_path"] == "fl_lightning.elastic.models.CNN"
        assert tree["data"]["dataset"]["class_path"] == "fl_lightning.data.Synthetic"
        tree["model"] = {"name": "cnn", "kwargs": {"channels": [8, 16]}}
        rest = {k: v for k, v in tree["data"].items() if k != "dataset"}
        tree["data"] = {"name": "synthetic", "options": {"num_train": 200, "num_test": 40, "image_size": 8}, **rest}
        saved.write_text(yaml.safe_dump(tree, sort_keys=False))

    assert main(base + ["--stop_after", "1"]) == 0
    write_old_form()
    capsys.readouterr()
    assert main(base[:-1] + ["[8, 32]", "--resume", "auto", "--stop_after", "2"]) == 2
    assert "model.channels ([8, 16] -> [8, 32])" in capsys.readouterr().err
    other_data = [("300" if a == "200" else a) for a in base]
    assert main(other_data + ["--resume", "auto", "--stop_after", "2"]) == 2
    assert "data.dataset.init_args.num_train (200 -> 300)" in capsys.readouterr().err
    assert main(base + ["--resume", "auto", "--stop_after", "2"]) == 0
    rounds = [json.loads(line)["round"] for line in (tmp_path / "runs" / "r" / "metrics.jsonl").open()]
    assert sorted(set(rounds)) == [0, 1]  # the second round, after the first
    write_old_form()
    assert main(["evaluate", "--run", str(tmp_path / "runs" / "r"), "--checkpoint", "last",
                 "--fabric.accelerator", "cpu"]) == 0
    capsys.readouterr()
    assert main(["fit", "--model", "{name: cnn}"]) == 2  # a config of the old form says the new one
    assert "error: model: models are chosen by class_path" in capsys.readouterr().err
    assert main(["fit", "--data", "{name: synthetic, options: {num_classes: 5}}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data.name") and "datasets are chosen by class_path" in err


def test_resume_with_another_round_count_or_model_is_refused(tmp_path, capsys):
    out = str(tmp_path / "runs")
    base = ["fit", "--data.dataset", "fl_lightning.data.Digits", "--partition.num_clients", "4", "--federation.clients_per_round", "2",
            "--federation.rounds", "3", "--stop_after", "1", "--fabric.accelerator", "cpu", "--out_dir", out,
            "--name", "r"]
    assert main(base) == 0
    last = tmp_path / "runs" / "r" / "checkpoints" / "last.ckpt"
    saved = last.read_bytes()
    for change, key in ((["--federation.rounds", "5"], "federation.rounds"),
                        (["--model.channels", "[8, 16, 32]"], "model.channels")):
        capsys.readouterr()
        code = main(base + ["--resume", "auto"] + change)
        err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
        assert code == 2 and len(err) == 1 and err[0].startswith("error: resume:") and key in err[0], err
        assert last.read_bytes() == saved
    capsys.readouterr()
    assert main(base + ["--resume", "auto"]) == 2  # stop_after 1: the checkpoint is already at round 1
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and err[0].startswith("error: stop_after:") and last.read_bytes() == saved
    # A safe change (evaluation schedule) continues the run.
    assert main(base[:-4] + ["--name", "r", "--out_dir", out, "--resume", "auto", "--eval.every", "2",
                             "--stop_after", "3"]) == 0


def test_help_lists_every_model_and_dataset_option(capsys):
    """Model and dataset options come from the class signatures: ``--model.help CLASS`` and
    ``--data.dataset.help CLASS`` list every one, and ``--help`` names every class."""
    import inspect

    import fl_lightning.data as data
    import fl_lightning.elastic.models as models
    from fl_lightning.data.sources import SOURCES

    def names(function, fixed):
        return [p for p in inspect.signature(function).parameters if p not in fixed]

    for name in (n for n in models.__all__ if n[0].isupper()):
        with pytest.raises(SystemExit):
            main(["fit", "--model.help", f"{models.__name__}.{name}"])
        shown = capsys.readouterr().out
        options = names(getattr(models, name), {"self"} | models.NOT_OPTIONS)
        assert options and all(f"--model.{option} " in shown for option in options), name
        assert "--model.num_classes" not in shown and "--model.max_widths" not in shown
    assert {f"{data.__name__}.{cls.__name__}" for cls in SOURCES} == {
        f"{data.__name__}.{n}" for n in data.__all__ if n != "DatasetSource"}
    for cls in SOURCES:  # the options are the loader's: tests/test_datasets.py checks the two signatures agree
        options = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        with pytest.raises(SystemExit):
            main(["fit", "--data.dataset.help", f"{data.__name__}.{cls.__name__}"])
        shown = capsys.readouterr().out
        assert all(f"--data.dataset.{option} " in shown for option in options), cls.__name__
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Classes in fl_lightning.elastic.models: CNN, CharLSTM" in text
    assert "Classes in fl_lightning.data: Digits (the default), MNISTSubset" in text


def test_option_types_accept_what_they_name_and_refuse_the_rest():
    from fl_lightning.option_types import INT_LIMIT, PositiveInt, Range, UnitFraction, number_type, parse_number

    def parse(base, span, value):
        wanted = ("an integer " if base is int else "a finite number ") + span.words()
        try:
            return parse_number(base, span, wanted, value)
        except ValueError as error:
            return str(error)

    at_least_one, unit = Range(low=1), Range(low=0, high=1, low_open=True)
    assert parse(int, at_least_one, "5") == 5 and type(parse(int, at_least_one, "5")) is int
    assert parse(float, unit, 1) == 1.0 and type(parse(float, unit, 1)) is float
    assert parse(int, at_least_one, 0) == "must be an integer >= 1, got 0"
    assert parse(int, at_least_one, 1.5).startswith("must be an integer")  # no silent truncation
    assert parse(int, at_least_one, True).startswith("must be an integer")  # YAML true is not 1
    assert parse(int, at_least_one, "ten") == "must be an integer >= 1, got 'ten'"
    assert "2,147,483,647" in parse(int, at_least_one, INT_LIMIT + 1)
    for value in ("nan", "inf", "1e400", float("-inf"), 0.0, 1.0000001):
        assert parse(float, unit, value).startswith("must be a finite number in (0, 1]"), value
    assert UnitFraction.__name__ == "float in (0, 1]" and PositiveInt is number_type(int, ge=1)
    assert number_type(int, ge=0, lt=2**63).__name__ == "int in [0, 2**63)"


def _numbers_without_range(hint) -> list:
    """Plain int / float inside a type hint: a number no type bounds."""
    from typing import get_args

    if hint in (int, float):
        return [hint]
    return [n for arg in get_args(hint) for n in _numbers_without_range(arg)]


def test_every_numeric_option_carries_its_range():
    """Options of the config sections, the commands, every model and every algorithm are typed by
    option_types (a plain int or float would go unchecked); free-form mappings excepted."""
    import dataclasses
    import typing

    from fl_lightning import cli, config
    from fl_lightning.algorithms import Algorithm
    from fl_lightning.cli.parse_errors import algorithm_names
    import fl_lightning.algorithms as algorithms

    unranged = []

    def visit(where, hints):
        for name, hint in hints.items():
            if dataclasses.is_dataclass(hint):
                visit(f"{where}.{name}", typing.get_type_hints(hint))
            elif name != "return" and _numbers_without_range(hint):
                unranged.append(f"{where}.{name}")

    for section in (config.DataConfig, config.PartitionConfig, config.LocalTrainConfig, config.FederationConfig,
                    config.EvalConfig, config.FabricConfig):
        visit(section.__name__, typing.get_type_hints(section))
    from fl_lightning.elastic import models
    from fl_lightning.elastic.models.base import ElasticModel

    for name, command in cli.COMMANDS.items():
        visit(name, typing.get_type_hints(command, localns={"Algorithm": Algorithm, "ElasticModel": ElasticModel}))
    for name in (n for n in models.__all__ if n[0].isupper()):
        hints = typing.get_type_hints(getattr(models, name).__init__)
        visit(name, {option: hint for option, hint in hints.items() if option not in models.NOT_OPTIONS})
    for name in algorithm_names():
        cls = getattr(algorithms, name, None)
        if cls is not None and issubclass(cls, Algorithm):
            visit(name, typing.get_type_hints(cls.__init__))
    assert not unranged, unranged


def test_help_shows_ranges_and_errors_say_them(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(type: int >= 1, default: 50)" in text  # federation.rounds
    assert "Optional[float > 0]" in text  # partition.alpha_eff
    assert main(["fit", "--fabric.devices", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: fabric.devices: must be an integer >= 1 or auto, got 0"
    assert main(["fit", "--algorithm", "FedProx", "--algorithm.mu=-1"]) == 2
    assert capsys.readouterr().err.strip() == "error: algorithm.mu: must be a finite number >= 0, got -1"
    assert main(["fit", "--model.channels", "abc"]) == 2  # a model's option, its class exported lazily
    assert capsys.readouterr().err.strip() == "error: model.channels: must be a list (an integer >= 1 each), got 'abc'"
