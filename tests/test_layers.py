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
    # methods compute what they need themselves or in neutral parts; reports read runs; no
    # method talks to other ranks (the loop reduces the round's accumulator once)
    ("algorithms", ("fl_lightning.federation", "fl_lightning.analysis", "fl_lightning.runtime.collectives",
                    "torch.distributed")),
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


# the rounds other methods build on: FedAvg's (fedavg), split learning's (split.splitfed) and the
# sub-model family's (submodel.base: SubmodelAlgorithm)
FAMILY_BASES = {"fl_lightning.algorithms.fedavg", "fl_lightning.algorithms.split.splitfed",
                "fl_lightning.algorithms.submodel.base"}


def module_file(module: str) -> Path:
    return PACKAGE.parent / (module.replace(".", "/") + ".py")


def test_no_method_file_imports_another_method_file():
    """Methods share code through components (levels, cached variants, calibration, ...) and
    the family bases, never by importing another method's module."""
    import fl_lightning.algorithms as algorithms

    methods = {getattr(algorithms, name).__module__ for name in algorithms.__all__
               if isinstance(getattr(algorithms, name), type)
               and issubclass(getattr(algorithms, name), algorithms.Algorithm)} - FAMILY_BASES
    assert "fl_lightning.algorithms.supernet.feast" in methods and "fl_lightning.algorithms.supernet.fednas" in methods
    offenders = [f"{module} imports {name}" for module in sorted(methods)
                 for name in sorted(imported_modules(module_file(module)))
                 if any(name == other or name.startswith(other + ".") for other in methods - {module})]
    assert not offenders, "; ".join(offenders)


def test_no_method_calls_a_collective():
    """The loop reduces a round's accumulator over ranks, once; a method never does."""
    calls = (".all_reduce(", ".all_gather(", ".broadcast(", ".barrier(", "all_reduce_sum(", "all_gather_objects(")
    offenders = [f"{path.relative_to(PACKAGE)}: {call}" for path in sorted((PACKAGE / "algorithms").rglob("*.py"))
                 for call in calls if call in path.read_text()]
    assert not offenders, "; ".join(offenders)


def test_clients_never_see_the_method_that_made_them():
    """The protocol runs one way: a client object is made from a frozen ``ClientRound``, its
    method's options and parts (frozen dataclasses) and, for split learning, the rank's engine;
    it neither holds nor reads the method (no ``method`` parameter or attribute), and
    ``algorithms/client.py`` imports no method."""
    import dataclasses
    import inspect
    import re

    import fl_lightning.algorithms as algorithms
    from fl_lightning.algorithms.client import Client, ClientRound
    from fl_lightning.algorithms.personalized.fedas import Alignment, FedASClient
    from fl_lightning.algorithms.personalized.fedgh import FedGHClient
    from fl_lightning.algorithms.split.common import SplitClient
    from fl_lightning.algorithms.split.fedsga_client import FedSGAClient, FedSGASettings
    from fl_lightning.algorithms.split.multisfl import BranchClient, BranchRound

    assert algorithms  # every client class is imported above
    clients = [Client, *Client.__subclasses__()]
    for cls in list(clients):
        clients += [c for c in cls.__subclasses__() if c not in clients]
    assert {FedASClient, FedGHClient, SplitClient, FedSGAClient, BranchClient} <= set(clients)
    for cls in clients:
        assert "method" not in inspect.signature(cls.__init__).parameters, cls.__name__
        assert not re.search(r"\bself\.method\b", inspect.getsource(cls)), f"{cls.__name__} reads the method"
    for given in (ClientRound, FedSGASettings, BranchRound, Alignment):
        assert dataclasses.fields(given) and given.__dataclass_params__.frozen, given.__name__
    assert "fedavg" not in (PACKAGE / "algorithms" / "client.py").read_text()
