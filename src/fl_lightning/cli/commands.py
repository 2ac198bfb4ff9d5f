"""What each subcommand does once its options are parsed: check, then run. :func:`run` picks
the command by the type of its options (one function per dataclass of ``schema.COMMANDS``)."""

from __future__ import annotations

import functools
import json
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from fl_lightning.algorithms import DeepFedNAS, Feast, SuperFedNAS
from fl_lightning.algorithms.supernet.feast_extraction import extract_subnet, parse_macs
from fl_lightning.analysis.partition_report import format_report, partition_report, save_report
from fl_lightning.cli.parser import resolved_saved_config
from fl_lightning.cli.saved_runs import load_run_spec, open_saved_run
from fl_lightning.cli.schema import EvaluateOptions, ExtractOptions, ModelsOptions, PartitionOptions
from fl_lightning.config import DataConfig, PartitionConfig, check_fabric_available, validate, validate_run
from fl_lightning.data.federated import build_federated_data
from fl_lightning.data.partition import validate_partition_params
from fl_lightning.elastic.macs import format_model_table, model_table
from fl_lightning.elastic.models import build_model, check_model
from fl_lightning.elastic.specs import WidthSpec
from fl_lightning.errors import ConfigError
from fl_lightning.federation.loggers import check_loggers
from fl_lightning.federation.loop import run_fit
from fl_lightning.federation.provenance import check_checkpoints, method_record
from fl_lightning.federation.run_dir import RunDir, check_resume_compatible, check_run_name, check_writable
from fl_lightning.federation.run_lock import RunLock, launching_process
from fl_lightning.federation.run_spec import RunSpec
from fl_lightning.runtime.evaluation import EvaluationPhase
from fl_lightning.runtime.output_files import write_file


@functools.singledispatch
def run(options, config_yaml: str):
    """Run the command that ``options`` (a dataclass of ``schema.COMMANDS``) are the options of;
    ``config_yaml`` is their resolved config."""
    raise TypeError(f"no command takes {type(options).__name__}")


def _check_data(data: DataConfig, partition: PartitionConfig) -> None:
    data.source().check(data.root, data.download)
    # The pool size is known only after loading; make_partition checks feasibility then.
    validate_partition_params(partition.method, num_examples=None, num_clients=partition.num_clients,
                              alpha=partition.alpha, gamma=partition.gamma, min_size=partition.min_size)


@run.register
def fit_command(spec: RunSpec, config_yaml: str) -> dict:
    """Validate everything that can be checked cheaply, then train."""
    validate_run(spec.out_dir)
    check_run_name(spec.name)
    validate(spec.data, spec.partition, spec.train, spec.federation, spec.eval, spec.fabric)
    _check_data(spec.data, spec.partition)
    check_model(spec.model)
    spec.algorithm.check(spec.train)
    run_dir = RunDir(spec.out_dir, spec.name)
    run_dir.check_writable()
    check_loggers(spec.loggers, run_dir.path, spec.name)
    check_fabric_available(spec.fabric)
    with RunLock(run_dir.path) if launching_process() else nullcontext():
        resume_from = run_dir.resolve_resume(spec.resume)
        saved_config = run_dir.path / "config.yaml"
        if resume_from is not None and saved_config.is_file():
            check_resume_compatible(resolved_saved_config(saved_config), config_yaml)
        if resume_from is not None:  # every checkpoint the run will read, before any work
            method = method_record(spec.algorithm, config_yaml)
            check_checkpoints([resume_from], method, key="resume", required=("model", "algorithm", "round", "best"))
            if run_dir.best.exists():
                check_checkpoints([run_dir.best], method, key="resume", required=("model",))
        spec = replace(spec, resume_from=str(resume_from) if resume_from else None, config_yaml=config_yaml)
        return run_fit(spec)  # the summary is in summary.json; the console ends with the method's table


@run.register
def evaluate_command(options: EvaluateOptions, config_yaml: str) -> dict:
    """Re-evaluate a saved checkpoint of a run on its test set and validation split (FEAST:
    every cached variant after BN recalibration)."""
    check_fabric_available(options.fabric)
    saved = open_saved_run(Path(options.run), options.checkpoint, options.fabric)
    # the round the checkpoint holds, counted from 0 as in metrics.jsonl and summary.json
    result = {"checkpoint": str(saved.checkpoint), "round": saved.round - 1}
    spec = saved.spec
    evaluation = EvaluationPhase(saved.ctx.fabric, spec.algorithm, saved.ctx.data, spec.eval.batch_size,
                                 spec.eval.client_test)
    for split in ("test", "val"):
        if split == "test" or len(saved.ctx.data.val):
            metrics = evaluation(split)
            result.update({f"{split}_{k}": v for k, v in metrics.items()})
    print(json.dumps(result, indent=2))
    return result


@run.register
def partition_command(options: PartitionOptions, config_yaml: str) -> dict:
    """Build the partition, print its report and save partition.json / partition.png."""
    validate_run(options.out_dir)
    validate(options.data, options.partition, options.train, options.federation, options.eval, options.fabric)
    if options.out is None:
        check_run_name(options.name)
    elif not options.out.strip():
        raise ConfigError("out", "must not be empty (or leave it unset for <out_dir>/<name>-partition)")
    out = Path(options.out or Path(options.out_dir) / f"{options.name}-partition")
    check_writable(out, "out" if options.out else "out_dir")
    _check_data(options.data, options.partition)
    fed = build_federated_data(options.data, options.partition, options.seed)
    targets = fed.bundle.train_targets
    show_budgets = options.show_budgets if options.show_budgets is not None \
        else options.partition.method == "gamma_dirichlet"
    report = partition_report(fed.clients, targets, fed.bundle.num_classes, fed.budgets if show_budgets else None)
    out.mkdir(parents=True, exist_ok=True)
    save_report(report, out)
    write_file(out / "config.yaml", config_yaml)
    print(format_report(report))
    print(f"saved {out / 'partition.json'} and {out / 'partition.png'}")
    return report


@run.register
def models_command(options: ModelsOptions, config_yaml: str) -> list:
    """Parameters and MACs of an architecture's width tiers."""
    check_model(options.model)
    if options.input_shape is not None and not options.input_shape:
        raise ConfigError("input_shape", "must list one example's sizes, e.g. [3, 32, 32], got []")
    if options.num_classes is None or options.input_shape is None:
        data = options.data
        bundle = data.source().load(data.root, data.download, data.augment)
        num_classes = options.num_classes or bundle.num_classes
        input_shape = tuple(options.input_shape or bundle.input_shape)
    else:
        num_classes, input_shape = options.num_classes, tuple(options.input_shape)
    model = build_model(options.model, num_classes, input_shape)
    top = model.max_spec()
    if not isinstance(top, WidthSpec):
        raise ConfigError("model", f"{type(model).__name__} has no width tiers to list")
    specs = [WidthSpec.uniform(w, len(top.widths)) for w in sorted(options.widths)]
    rows = model_table(model, specs, input_shape)
    print(f"{type(model).__name__}: {num_classes} classes, input {list(input_shape)}")
    print(format_model_table(rows))
    return rows


@run.register
def extract_command(options: ExtractOptions, config_yaml: str) -> dict:
    """Search, extract, recalibrate and score a subnet of a trained FEAST supernet."""
    budget = parse_macs(options.budget)
    if options.out is not None:
        if not options.out.strip() or options.out.endswith("/"):
            raise ConfigError("out", f"must be a file path for the extracted subnet, got {options.out!r}")
        check_writable(Path(options.out), "out", folder=False)
    check_fabric_available(options.fabric)
    run_path = Path(options.run)
    if not isinstance(load_run_spec(run_path).algorithm, (Feast, SuperFedNAS, DeepFedNAS)):
        raise ConfigError("run", "post-hoc extraction needs a supernet trained with FEAST, SuperFedNAS or DeepFedNAS")
    saved = open_saved_run(run_path, options.checkpoint, options.fabric)
    result = extract_subnet(saved.spec.algorithm, budget, options.rho, options.population, options.generations,
                            options.seed, saved.spec.eval.batch_size, Path(options.out) if options.out else None,
                            options.space, options.reuse_cache)
    result["checkpoint"] = str(saved.checkpoint)
    print(json.dumps(result, indent=2))
    return result
