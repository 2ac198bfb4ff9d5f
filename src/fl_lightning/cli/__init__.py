"""Command line: ``python -m fl_lightning <fit|evaluate|partition|models|extract> --config file.yaml``.

From the bottom up: ``schema.py`` (each command's options as a dataclass; ``fit``'s is the run,
``federation/run_spec.py``), ``config_files.py`` (config files checked before parsing),
``parse_errors.py`` (which key a refused command line gets wrong), ``parser.py`` (command line
or saved config to options), ``saved_runs.py`` (a run reopened for evaluate and extract),
``commands.py`` (what each command does) and ``entry_point.py`` (``main``). Importing the
package imports neither torch nor Lightning.
"""

from fl_lightning.cli.entry_point import main
from fl_lightning.cli.parser import build_parser, load_fit_config, parse_command, shared_parser
from fl_lightning.cli.schema import COMMANDS

__all__ = ["COMMANDS", "build_parser", "load_fit_config", "main", "parse_command", "shared_parser"]
