"""What each CLI subcommand does once its arguments are parsed: check, then run."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

from fl_lightning.config import check_fabric_available, validate, validate_run
from fl_lightning.data.partition import validate_partition_params
from fl_lightning.errors import ConfigError
from fl_lightning.federation.provenance import check_checkpoints, method_record
from fl_lightning.federation.run_lock import RunLock, launching_process
from fl_lightning.federation.run_dir import RunDir, check_resume_compatible, check_run_name, check_writable
from fl_lightning.runtime.output_files import write_file


def _check_model(model) -> None:
    from fl_lightning.elastic.models import check_model

    check_model(model)


def _check_data(data, partition) -> None:
    data.source().check(data.root, data.download)
    # The pool size is known only after loading; make_partition checks feasibility then.
    validate_partition_params(partition.method, num_examples=None, num_clients=partition.num_clients,
                              alpha=partition.alpha, gamma=partition.gamma, min_size=partition.min_size)


def fit_command(args, config_yaml: str) -> dict:
    """Validate everything that can be checked cheaply, then train."""
    from fl_lightning.cli import resolved_saved_config
    from fl_lightning.federation.builder import RunSpec
    from fl_lightning.federation.loop import run_fit

    validate_run(args.out_dir)
    check_run_name(args.name)
    validate(args.data, args.partition, args.train, args.federation, args.eval, args.fabric)
    _check_data(args.data, args.partition)
    _check_model(args.model)
    args.algorithm.check(args.train)
    run_dir = RunDir(args.out_dir, args.name)
    run_dir.check_writable()
    check_fabric_available(args.fabric)
    with RunLock(run_dir.path) if launching_process() else nullcontext():
        resume_from = run_dir.resolve_resume(args.resume)
        saved_config = run_dir.path / "config.yaml"
        if resume_from is not None and saved_config.is_file():
            check_resume_compatible(resolved_saved_config(saved_config), config_yaml)
        if resume_from is not None:  # every checkpoint the run will read, before any work
            method = method_record(args.algorithm, config_yaml)
            check_checkpoints([resume_from], method, key="resume", required=("model", "algorithm", "round", "best"))
            if run_dir.best.exists():
                check_checkpoints([run_dir.best], method, key="resume", required=("model",))
        spec = RunSpec(name=args.name, out_dir=args.out_dir, seed=args.seed, data=args.data,
                       partition=args.partition, model=args.model, train=args.train,
                       federation=args.federation, eval=args.eval, fabric=args.fabric,
                       algorithm=args.algorithm, resume_from=str(resume_from) if resume_from else None,
                       config_yaml=config_yaml, checkpoint_every=args.checkpoint_every,
                       stop_after=args.stop_after)
        summary = run_fit(spec)
    if summary is not None:
        print(json.dumps(summary, indent=2))
    return summary


def evaluate_command(args, config_yaml: str) -> dict:
    """Re-evaluate a saved checkpoint of a run on its test set and validation split (FEAST:
    every cached variant after BN recalibration)."""
    from fl_lightning.runtime.evaluation import EvaluationPhase
    from fl_lightning.saved_runs import open_saved_run

    check_fabric_available(args.fabric)
    saved = open_saved_run(Path(args.run), args.checkpoint, args.fabric)
    result = {"checkpoint": str(saved.checkpoint), "round": saved.round}
    spec = saved.spec
    evaluation = EvaluationPhase(saved.ctx.fabric, spec.algorithm, saved.ctx.data, spec.eval.batch_size,
                                 spec.eval.client_test)
    for split in ("test", "val"):
        if split == "test" or len(saved.ctx.data.val):
            metrics = evaluation(split)
            result.update({f"{split}_{k}": v for k, v in metrics.items()})
    print(json.dumps(result, indent=2))
    return result


def partition_command(args, config_yaml: str) -> dict:
    """Build the partition, print its report and save partition.json / partition.png."""
    from fl_lightning.analysis.partition_report import format_report, partition_report, save_report
    from fl_lightning.data.federated import build_federated_data

    validate_run(args.out_dir)
    validate(args.data, args.partition, args.train, args.federation, args.eval, args.fabric)
    if args.out is None:
        check_run_name(args.name)
    elif not args.out.strip():
        raise ConfigError("out", "must not be empty (or leave it unset for <out_dir>/<name>-partition)")
    out = Path(args.out or Path(args.out_dir) / f"{args.name}-partition")
    check_writable(out, "out" if args.out else "out_dir")
    _check_data(args.data, args.partition)
    fed = build_federated_data(args.data, args.partition, args.seed)
    targets = fed.bundle.train_targets
    report = partition_report(fed.clients, targets, fed.bundle.num_classes)
    out.mkdir(parents=True, exist_ok=True)
    save_report(report, out)
    write_file(out / "config.yaml", config_yaml)
    print(format_report(report))
    print(f"saved {out / 'partition.json'} and {out / 'partition.png'}")
    return report


def models_command(args, config_yaml: str) -> list:
    """Parameters and MACs of an architecture's width tiers."""
    from fl_lightning.elastic.macs import format_model_table, model_table
    from fl_lightning.elastic.models import build_model
    from fl_lightning.elastic.specs import WidthSpec

    _check_model(args.model)
    if args.input_shape is not None and not args.input_shape:
        raise ConfigError("input_shape", "must list one example's sizes, e.g. [3, 32, 32], got []")
    if args.num_classes is None or args.input_shape is None:
        bundle = args.data.source().load(args.data.root, args.data.download, args.data.augment)
        num_classes = args.num_classes or bundle.num_classes
        input_shape = tuple(args.input_shape or bundle.input_shape)
    else:
        num_classes, input_shape = args.num_classes, tuple(args.input_shape)
    model = build_model(args.model, num_classes, input_shape)
    top = model.max_spec()
    if not isinstance(top, WidthSpec):
        raise ConfigError("model", f"{type(model).__name__} has no width tiers to list")
    specs = [WidthSpec.uniform(w, len(top.widths)) for w in sorted(args.widths)]
    rows = model_table(model, specs, input_shape)
    print(f"{type(model).__name__}: {num_classes} classes, input {list(input_shape)}")
    print(format_model_table(rows))
    return rows


def extract_command(args, config_yaml: str) -> dict:
    """Search, extract, recalibrate and score a subnet of a trained FEAST supernet."""
    from fl_lightning.algorithms.supernet.cached_variants import ServesCachedVariants
    from fl_lightning.algorithms.supernet.feast_extraction import extract_subnet, parse_macs
    from fl_lightning.saved_runs import load_run_spec, open_saved_run

    budget = parse_macs(args.budget)
    if args.out is not None:
        if not args.out.strip() or args.out.endswith("/"):
            raise ConfigError("out", f"must be a file path for the extracted subnet, got {args.out!r}")
        check_writable(Path(args.out), "out", folder=False)
    check_fabric_available(args.fabric)
    run = Path(args.run)
    if not isinstance(load_run_spec(run).algorithm, ServesCachedVariants):
        raise ConfigError("run", "post-hoc extraction needs a supernet trained with FEAST, SuperFedNAS or DeepFedNAS")
    saved = open_saved_run(run, args.checkpoint, args.fabric)
    result = extract_subnet(saved.spec.algorithm, budget, args.rho, args.population, args.generations, args.seed,
                            saved.spec.eval.batch_size, Path(args.out) if args.out else None, args.space,
                            args.reuse_cache)
    result["checkpoint"] = str(saved.checkpoint)
    print(json.dumps(result, indent=2))
    return result


COMMANDS = {"fit": fit_command, "evaluate": evaluate_command, "partition": partition_command,
            "models": models_command, "extract": extract_command}
