"""The command line before the parser reads it: options whose value starts with '-', values that
name a fifo, and every ``--config`` file, checked so that a bad one ends in one line naming the
file and key rather than a parser's traceback or a wait on a pipe."""

from __future__ import annotations

import dataclasses
import os
import stat
from typing import List

import yaml

from fl_lightning.cli.schema import COMMANDS, sections
from fl_lightning.errors import ConfigError


def join_negative_values(argv: List[str]) -> List[str]:
    """``--train.lr -inf`` as ``--train.lr=-inf``: argparse reads a value that starts with '-' and
    is not a plain negative integer (-inf, -1e-3, -.5) as an option of its own."""
    out: List[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        following = argv[i + 1] if i + 1 < len(argv) else None
        if arg.startswith("--") and "=" not in arg and following is not None and following.startswith("-") \
                and _is_number(following):
            arg, i = f"{arg}={following}", i + 1
        out.append(arg)
        i += 1
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_argument_files(argv: List[str]) -> None:
    """An option's value that names a fifo or socket would be opened as a YAML file and wait
    forever (``--train some_fifo``): refused at once, naming the option."""
    for option, value in zip(argv, argv[1:]):
        if not option.startswith("--") or "=" in option or option == "--config":
            continue
        try:
            mode = os.stat(value).st_mode
        except (OSError, ValueError):
            continue
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            raise ConfigError(option[2:], f"{value} is {_file_kind(mode)}, not a YAML file or a value")


def _config_paths(argv: List[str]) -> List[str]:
    paths = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def check_config_files(argv: List[str]) -> None:
    """Every ``--config`` file exists, is UTF-8 YAML text holding a mapping, and gives each
    config section (``train:``, ``partition.budgets:``...) a mapping of its fields."""
    command = next((a for a in argv if a in COMMANDS), None)
    keys = sections(COMMANDS[command]) if command is not None else {}
    for path in _config_paths(argv):
        tree = read_config_file(path)
        for key, cls in keys.items():
            node, parts = tree, key.split(".")
            for part in parts:
                node = node.get(part) if isinstance(node, dict) else None
            if node is None and _holds_key(tree, parts):
                raise ConfigError(key, f"is empty in {path}; give its fields (or remove the line '{parts[-1]}:')")
            if node is not None and not isinstance(node, dict):
                fields = ", ".join(f.name for f in dataclasses.fields(cls)[:3])
                raise ConfigError(key, f"must be a mapping of its fields ({fields}, ...), got {node!r} in {path}")


def _holds_key(tree: dict, parts: List[str]) -> bool:
    for part in parts[:-1]:
        tree = tree.get(part)
        if not isinstance(tree, dict):
            return False
    return parts[-1] in tree


MAX_CONFIG_BYTES = 4 * 2**20  # a config is a page or two of YAML; more is the wrong file


def read_config_file(path: str) -> dict:
    """The YAML mapping in ``path``; ConfigError (key ``config``) for anything else: a missing
    file, something that is not a regular file (a folder, /dev/zero, a fifo: read at once, never
    waited on), a file of megabytes, bytes that are not text, invalid YAML, a key given twice."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ConfigError("config", f"no such file: {path}") from None
    except OSError as error:
        raise ConfigError("config", f"cannot read {path}: {error.strerror or error}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError("config", f"{path} is a folder, not a YAML file")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError("config", f"{path} is {_file_kind(info.st_mode)}, not a regular YAML file")
    if info.st_size > MAX_CONFIG_BYTES:
        raise ConfigError("config", f"{path} is {info.st_size / 2**20:.0f} MiB, not a config file "
                                    f"(at most {MAX_CONFIG_BYTES // 2**20} MiB of YAML)")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError("config", f"cannot read {path}: {error.strerror or error}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError("config", f"{path} is not a YAML text file (byte {error.start} is not UTF-8)") from None
    if "\x00" in text:
        raise ConfigError("config", f"{path} is not a YAML text file (it holds NUL bytes)")
    try:
        tree = yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKey as error:
        raise ConfigError(error.key, f"is given twice in {path} (lines {error.lines[0]} and {error.lines[1]}); "
                                     "keep one") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError("config", f"{path} is not valid YAML{where}: {problem}") from None
    if tree is None:
        raise ConfigError("config", f"{path} is empty; a config is a YAML mapping of sections "
                                    "(data:, partition:, model:, ...), see configs/quickstart.yaml")
    if not isinstance(tree, dict):
        raise ConfigError("config", f"{path} holds a YAML {type(tree).__name__}, not a mapping of sections "
                                    "(data:, partition:, model:, ...)")
    return tree


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a fifo (pipe)"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a file")


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: str, lines: tuple):
        super().__init__(key)
        self.key, self.lines = key, lines


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a mapping holding one key twice (PyYAML keeps the last),
    naming the dotted key (``train.lr``) and both lines."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    path = ".".join(self._path_to(node) + [str(key)])
                    raise _DuplicateKey(path, (seen[key], key_node.start_mark.line + 1))
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def _path_to(self, target) -> list:
        """Keys from the document's root mapping down to the mapping node ``target``."""
        def walk(node, trail):
            if node is target:
                return trail
            if isinstance(node, yaml.MappingNode):
                for key_node, value_node in node.value:
                    found = walk(value_node, trail + [str(key_node.value)])
                    if found is not None:
                        return found
            elif isinstance(node, yaml.SequenceNode):
                for i, item in enumerate(node.value):
                    found = walk(item, trail[:-1] + [f"{trail[-1]}[{i}]"] if trail else [f"[{i}]"])
                    if found is not None:
                        return found
            return None
        return walk(self._root, []) or []

    def compose_document(self):
        self._root = super().compose_document()
        return self._root
