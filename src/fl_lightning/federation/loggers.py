"""The run's loggers: any Lightning logger, by class path, writing below the run folder.

``loggers:`` in a config lists them, TensorBoard alone by default::

    loggers:
    - TensorBoardLogger                                   # <run>/tensorboard/
    - CSVLogger                                           # <run>/csv/metrics.csv
    - class_path: lightning.pytorch.loggers.WandbLogger   # pip install 'fl_lightning[wandb]'
      init_args: {project: feast}

A bare class name is looked up in ``lightning.fabric.loggers``, then ``lightning.pytorch.loggers``.
Where a logger writes defaults to the run folder (``PLACES``) unless its options say otherwise;
``loggers.json`` in the run folder records where each one wrote.

A resume continues each logger from the resumed round, so no step appears twice: TensorBoard's
writer purges the later steps of the earlier events (``purge_step``, which TensorBoard and its
event readers apply), a CSV file keeps only its earlier rows; W&B and MLflow open a new run of
their own service, as each call does by default.
"""

from __future__ import annotations

import csv
import importlib
import inspect
import json
import os
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from fl_lightning.config import LoggerSpec
from fl_lightning.errors import ConfigError
from fl_lightning.federation.run_dir import RESUME
from fl_lightning.runtime.output_files import OutputError, problem, write_file

MODULES = ("lightning.fabric.loggers", "lightning.pytorch.loggers")
PLACES = {
    "TensorBoardLogger": {"root_dir": "{run}", "save_dir": "{run}", "name": "tensorboard", "version": ""},
    "CSVLogger": {"root_dir": "{run}", "save_dir": "{run}", "name": "csv", "version": ""},
    "WandbLogger": {"save_dir": "{run}", "name": "{name}"},
    "MLFlowLogger": {"save_dir": "{run}/mlruns", "run_name": "{name}"},
}
"""The options that say where a logger writes, filled in unless given ({run}: the run folder,
{name}: the run's name); any other logger gets the run folder as its root_dir or save_dir."""
FOLDER_OPTIONS = ("root_dir", "save_dir")
EXTRAS = {"WandbLogger": "wandb", "MLFlowLogger": "mlflow"}
"""The pyproject extra that installs an optional logger's package."""


def check_loggers(specs: Sequence[LoggerSpec], run: Path, name: str) -> None:
    """Refuse, before any work, a logger that cannot be made: an unknown class, an option it
    does not take, a package not installed, two loggers writing to one folder."""
    build_loggers(specs, run, name)


def build_loggers(specs: Sequence[LoggerSpec], run: Path, name: str, start_round: int = 0) -> list:
    """The configured loggers for the run folder ``run``, each continuing from ``start_round``.
    Nothing is written until they log."""
    loggers, folders = [], {}
    for i, spec in enumerate(specs):
        cls, options = _resolve(spec, i)
        logger = _construct(cls, options, i, run, name, start_round)
        folder = logger_folder(logger)
        if folder is not None and folder in folders:
            raise ConfigError(f"loggers[{i}]", f"writes to {folder}, as loggers[{folders[folder]}] does; give it "
                                               "another name or folder in its init_args")
        folders[folder] = i
        loggers.append(logger)
    return loggers


def _resolve(spec: LoggerSpec, i: int) -> Tuple[type, dict]:
    """The logger class of ``spec`` and its options."""
    from lightning.fabric.loggers import Logger

    key = f"loggers[{i}]"
    if isinstance(spec, str):
        path, options = spec, {}
    elif isinstance(spec, dict) and isinstance(spec.get("class_path"), str) and set(spec) <= {"class_path", "init_args"}:
        path, options = spec["class_path"], spec.get("init_args") or {}
        if not isinstance(options, dict):
            raise ConfigError(f"{key}.init_args", f"must be a mapping of the logger's options, got {options!r}")
    else:
        raise ConfigError(key, f"must be a logger class or {{class_path: ..., init_args: {{...}}}}, got {spec!r}")
    cls = _import(path, key)
    if not (inspect.isclass(cls) and issubclass(cls, Logger)):
        raise ConfigError(f"{key}", f"{path} is not a Lightning logger (a lightning.fabric.loggers.Logger)")
    parameters = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        for option in options:
            if option not in parameters or option == "self":
                takes = ", ".join(n for n in parameters if n != "self")
                raise ConfigError(f"{key}.init_args.{option}", f"{cls.__name__} takes no option {option}; it takes {takes}")
    return cls, dict(options)


def _import(path: str, key: str):
    if "." not in path:
        for module in MODULES:
            found = getattr(importlib.import_module(module), path, None)
            if found is not None:
                return found
        raise ConfigError(key, f"no logger class {path} in {' or '.join(MODULES)}; give its import path")
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ConfigError(key, f"cannot import {path} ({' '.join(str(error).split())})") from None


def _construct(cls: type, options: dict, i: int, run: Path, name: str, start_round: int):
    from lightning.fabric.loggers import TensorBoardLogger

    parameters = inspect.signature(cls.__init__).parameters
    place = PLACES.get(cls.__name__, {option: "{run}" for option in FOLDER_OPTIONS})
    for option, value in place.items():
        if option in parameters and option not in options:
            options[option] = value.format(run=run, name=name) if isinstance(value, str) else value
    if issubclass(cls, TensorBoardLogger):  # later steps of earlier events are superseded
        options.setdefault("purge_step", start_round)
    try:
        return cls(**options)
    except ImportError as error:
        extra = EXTRAS.get(cls.__name__)
        hint = f"pip install 'fl_lightning[{extra}]'" if extra else " ".join(str(error).split())
        raise ConfigError(f"loggers[{i}]", f"{cls.__name__} needs a package that is not installed: {hint}") from None
    except (TypeError, ValueError) as error:
        raise ConfigError(f"loggers[{i}].init_args", f"{cls.__name__}: {' '.join(str(error).split())}") from None


def logger_folder(logger) -> Optional[Path]:
    """The local folder a logger writes to, if it has one."""
    for attribute in ("log_dir", "save_dir", "root_dir"):
        folder = getattr(logger, attribute, None)
        if isinstance(folder, (str, os.PathLike)) and str(folder):
            return Path(os.path.normpath(folder))
    return None


def class_path(logger) -> str:
    cls = type(logger)
    return f"{cls.__module__}.{cls.__qualname__}"


class RunLoggers:
    """Rank 0's writes to the run's loggers. A write the operating system refuses (a full disk)
    is an OutputError naming the logger's folder, raised at the round it happened."""

    def __init__(self, loggers: Sequence, run: Path):
        self.loggers, self.run = list(loggers), Path(run)

    def open(self, layout: Mapping, start_round: int) -> None:
        """Before the first round of this call: each logger starts (a W&B or MLflow run is
        created), a CSV file keeps the rows before ``start_round``, TensorBoard gets the
        custom-scalars ``layout`` (written once, with round 0), and ``loggers.json`` says where
        each logger writes (and the run id of a service's logger)."""
        from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

        for logger in self.loggers:
            with self.writes(logger):
                rows = _csv_rows_before(logger, start_round) if isinstance(logger, CSVLogger) else []
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # CSV: "Previous log files ... will be deleted"
                    logger.experiment
                for step, row in rows:  # as they were: Lightning's CSV writer starts its file anew
                    logger.log_metrics(row, step=step)
                if isinstance(logger, TensorBoardLogger) and start_round == 0:
                    logger.experiment.add_custom_scalars({k: dict(v) for k, v in layout.items()})
        where = []
        for logger in self.loggers:
            version = logger.version
            where.append({"class_path": class_path(logger), "folder": self._shown(logger_folder(logger)),
                          **({"version": str(version)} if version not in (None, "") else {})})
        write_file(self.run / "loggers.json", json.dumps(where, indent=2) + "\n", then=RESUME)

    def _shown(self, folder: Optional[Path]) -> Optional[str]:
        if folder is None:
            return None
        try:
            return str(folder.resolve().relative_to(self.run.resolve()))
        except ValueError:
            return str(folder)

    def log(self, figures: Mapping[str, float], step: int) -> None:
        """Log ``figures`` at ``step`` and put them on disk now (a kill loses no logged round)."""
        for logger in self.loggers:
            with self.writes(logger):
                logger.log_metrics(dict(figures), step=step)
                logger.save()

    def log_end(self, params: Mapping[str, object], metrics: Mapping[str, float], step: int) -> None:
        """The run's flattened config as hyperparameters, with its end figures (TensorBoard's
        HParams tab compares runs by them)."""
        for logger in self.loggers:
            with self.writes(logger):
                if "metrics" in inspect.signature(logger.log_hyperparams).parameters:
                    logger.log_hyperparams(dict(params), metrics=dict(metrics), step=step)
                else:
                    try:
                        logger.log_hyperparams(dict(params))
                    except NotImplementedError:  # Fabric's CSVLogger keeps no hyperparameters
                        pass
                    logger.log_metrics(dict(metrics), step=step)
                logger.save()

    def finalize(self) -> None:
        for logger in self.loggers:
            with self.writes(logger):
                logger.finalize("success")

    @contextmanager
    def writes(self, logger) -> Iterator[None]:
        """An OSError from ``logger`` (TensorBoard's writer raises it at a later flush) as an
        OutputError naming its folder; the writer thread's own traceback is left out."""
        _quiet_event_writer_thread()
        try:
            yield
        except OSError as error:
            folder = logger_folder(logger) or self.run
            raise OutputError(problem(error, folder / "events", None, "the earlier logs are kept", RESUME)) from None


def _csv_rows_before(logger, start_round: int) -> List[Tuple[int, Dict[str, float]]]:
    """``(step, figures)`` of the rows of ``logger``'s CSV file before ``start_round``."""
    path = Path(logger.log_dir) / "metrics.csv"
    if start_round == 0 or not path.is_file():
        return []
    with open(path, newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("step") and float(row["step"]) < start_round]
    return [(int(float(row["step"])), {k: float(v) for k, v in row.items() if k != "step" and v != ""}) for row in rows]


def _quiet_event_writer_thread() -> None:
    if getattr(threading.excepthook, "quiet_event_writer", False):
        return
    default = threading.excepthook

    def hook(args) -> None:
        if not (issubclass(args.exc_type, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            default(args)

    hook.quiet_event_writer = True
    threading.excepthook = hook


__all__ = ["RunLoggers", "build_loggers", "check_loggers", "logger_folder"]
