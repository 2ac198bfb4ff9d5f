"""What ``fit`` says about bad options before any work: the parser's types, then the algorithm's
``check`` of the rules that relate its options."""

from __future__ import annotations

import json

from fl_lightning.cli import parse_command
from fl_lightning.errors import ConfigError


def refusal(*options: str) -> ConfigError:
    """The ConfigError that ``fit <options>`` stops on; AssertionError when it accepts them."""
    try:
        _, args, _ = parse_command(["fit", *options])
        args.algorithm.check(args.train)
    except ConfigError as error:
        return error
    raise AssertionError(f"fit {' '.join(options)} was accepted")


def option_refusal(algorithm: str, **options) -> ConfigError:
    """``refusal`` of ``--algorithm <algorithm>`` with these settings (``path.targets`` for a
    nested one), each given as the YAML a user would type."""
    given = [f"--algorithm.{key}={value if isinstance(value, str) else json.dumps(value)}"
             for key, value in options.items()]
    return refusal("--algorithm", algorithm, *given)
