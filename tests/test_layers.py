"""The package's layering: methods and analyses sit above the runtime, never above the round
loop, and the elastic models know no method's protocol. Read from the sources' imports."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "src" / "fl_lightning"


def imported_modules(path: Path) -> set:
    """Every module a file imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("layer, forbidden", [
    ("algorithms", ("fl_lightning.federation",)),
    ("analysis", ("fl_lightning.federation",)),
    ("elastic", ("fl_lightning.federation", "fl_lightning.algorithms", "fl_lightning.feast_protocol")),
    ("runtime", ("fl_lightning.federation", "fl_lightning.algorithms")),
])
def test_layer_does_not_import_above_itself(layer, forbidden):
    offenders = [f"{path.relative_to(PACKAGE)} imports {name}"
                 for path in sorted((PACKAGE / layer).rglob("*.py"))
                 for name in sorted(imported_modules(path))
                 if any(name == f or name.startswith(f + ".") for f in forbidden)]
    assert not offenders, "; ".join(offenders)
