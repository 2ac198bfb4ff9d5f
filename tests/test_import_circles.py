"""No two modules of the package import each other, directly or round a longer loop: each
module can be read (and tested) with only what is below it. Read from the sources' imports at
any depth (function-level and TYPE_CHECKING ones included)."""

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src"
PACKAGE = "fl_lightning"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set) -> set:
    """The package's modules that the file at ``path`` imports (``from a import b`` counts as
    a.b when that is a module, else as a)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                         for alias in node.names)
    return {name for name in found if name in modules}


def circles(graph: dict) -> list:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_circles_finds_a_loop_of_three_and_nothing_in_a_chain():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_module_imports_one_that_imports_it_back():
    files = {module_name(path): path for path in sorted((SRC / PACKAGE).rglob("*.py"))}
    graph = {name: imports(path, set(files)) - {name} for name, path in files.items()}
    assert circles(graph) == []
