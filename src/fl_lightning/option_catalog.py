"""The options of every registered dataset, read from the source without importing it.

``--help`` shows them under ``--data.options``. Importing the loaders would pull in
torchvision (seconds); parsing their source takes milliseconds. ``tests/test_cli.py`` checks
the catalog against the imported registry.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Dict, List

PACKAGE = Path(__file__).parent
DATASET_SOURCES = [PACKAGE / "data" / "datasets.py", PACKAGE / "data" / "shakespeare.py"]
DATASET_FIXED = {"root", "download", "augment"}  # data.root, data.download, data.augment


def _options(function: ast.FunctionDef, fixed: set, constants: Dict[str, str]) -> List[str]:
    """``name=default`` for every keyword option of ``function`` (fixed arguments skipped;
    module constants used as defaults shown by value)."""
    args = function.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    pairs = list(zip(positional, defaults)) + list(zip(args.kwonlyargs, args.kw_defaults))
    shown = []
    for arg, default in pairs:
        if arg.arg in fixed:
            continue
        if default is None:
            shown.append(arg.arg)
        else:
            text = ast.unparse(default)
            shown.append(f"{arg.arg}={constants.get(text, text)}")
    return shown


def _constants(tree: ast.Module) -> Dict[str, str]:
    """Module-level ``NAME = <literal>`` assignments."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is None:
                continue
            try:
                ast.literal_eval(node.value)
            except ValueError:
                continue
            for target in targets:
                if isinstance(target, ast.Name):
                    out[target.id] = ast.unparse(node.value)
    return out


def _registered_name(decorator: ast.expr, registrar: str):
    if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == registrar and decorator.args:
        first = decorator.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    return None


def _catalog(sources: List[Path], registrar: str, fixed: set) -> Dict[str, List[str]]:
    functions: Dict[str, tuple] = {}
    found: Dict[str, List[str]] = {}
    late: Dict[str, str] = {}  # name -> function registered as register("name", ...)(function)
    for source in sources:
        tree = ast.parse(source.read_text())
        constants = _constants(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                functions[node.name] = (node, constants)
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                for decorator in node.decorator_list:
                    name = _registered_name(decorator, registrar)
                    if name is None:
                        continue
                    if isinstance(node, ast.ClassDef):
                        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"),
                                    None)
                        found[name] = _options(init, fixed, constants) if init else []
                    else:
                        found[name] = _options(node, fixed, constants)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Call) and node.args:
                name = _registered_name(node.func, registrar)
                target = node.args[0]
                if name is not None and isinstance(target, ast.Name):
                    late[name] = target.id
    for name, function in late.items():
        if function in functions:
            found[name] = _options(*functions[function][:1], fixed, functions[function][1])
    return dict(sorted(found.items()))


@functools.lru_cache(maxsize=None)  # read once per process, not once per subcommand
def dataset_options() -> Dict[str, List[str]]:
    return _catalog(DATASET_SOURCES, "register", DATASET_FIXED)


def describe(catalog: Dict[str, List[str]]) -> str:
    return "; ".join(f"{name}: {', '.join(options) or 'none'}" for name, options in catalog.items())
