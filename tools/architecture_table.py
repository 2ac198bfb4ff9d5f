"""Print (or write into ``docs/architecture.md``) the table of which hooks and parts each method
uses, read from the code: a hook is one of ``Algorithm``'s twelve or one of the local-training
hooks ``FedAvg`` adds, which the class or one of its family bases (below FedAvg) overrides; a
part is a shared component (``runtime/``, ``algorithms/``) named in the source of those classes.

    python tools/architecture_table.py            # print the table
    python tools/architecture_table.py --write    # replace the table in docs/architecture.md

``tests/test_architecture_doc.py`` fails when the doc's table and the code disagree.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

from fl_lightning.tool_parser import ToolParser

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- table: tools/architecture_table.py -->", "<!-- end of table -->"

# shared components a method composes, with the module that holds each
PARTS = {
    "ServedStatistics": "algorithms/bn_protocol.py",
    "ServerOptimizer": "runtime/server_optimizer.py",
    "ClientStateStore": "runtime/client_store.py",
    "KeptTensors": "runtime/kept_state.py",
    "KeptAttributes": "runtime/kept_state.py",
    "KeptModule": "runtime/kept_state.py",
    "KeptRecord": "runtime/kept_state.py",
    "ServerCalibration": "runtime/calibration.py",
    "CachedVariants": "algorithms/supernet/cached_variants.py",
    "LevelAssignment": "algorithms/levels.py",
    "SplitEngine": "algorithms/split/engine.py",
    "SplitHalves": "algorithms/split/engine.py",
}


BASE_OWN = ("setup", "keep", "state_dict", "load_state_dict")
"""``Algorithm``'s methods that are not hooks: the set-up template and the checkpointing of
kept parts, which no method overrides."""


def public_methods(cls):
    return [n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")]


def algorithm_hooks():
    """The abstract interface's extension points: ``Algorithm``'s public methods but its own."""
    from fl_lightning.algorithms import Algorithm

    return [n for n in public_methods(Algorithm) if n not in BASE_OWN]


def hooks():
    """Every extension point: ``Algorithm``'s hooks, then those FedAvg adds (local training)."""
    from fl_lightning.algorithms import FedAvg

    names = algorithm_hooks()
    return names + [n for n in public_methods(FedAvg) if n not in names and n not in BASE_OWN]


def methods():
    """(name, class) of every method the package exports, in the order of ``__all__``."""
    import fl_lightning.algorithms as algorithms
    from fl_lightning.algorithms import Algorithm, SubmodelAlgorithm

    abstract = {Algorithm, SubmodelAlgorithm}
    return [(n, getattr(algorithms, n)) for n in algorithms.__all__
            if inspect.isclass(getattr(algorithms, n)) and issubclass(getattr(algorithms, n), Algorithm)
            and getattr(algorithms, n) not in abstract]


def family(cls) -> str:
    module = cls.__module__.split(".")
    return module[2] if len(module) > 3 else "plain"


def own_classes(cls):
    """The class and its bases below ``FedAvg`` (the concrete default every method extends)."""
    from fl_lightning.algorithms import Algorithm, FedAvg

    return [c for c in cls.__mro__ if issubclass(c, Algorithm) and c not in (Algorithm, FedAvg)]


def overridden(cls, names):
    return [n for n in names if any(n in vars(c) for c in own_classes(cls))]


def parts_used(cls):
    source = "\n".join(inspect.getsource(c) for c in own_classes(cls))
    used = ["ServedStatistics"]  # every method has one (the template builds it)
    used += [p for p in PARTS if p != "ServedStatistics" and re.search(rf"\b{p}\b", source)]
    return used


def client_class(cls) -> str:
    """The client object the method's ``new_client`` returns, read from its source."""
    for c in own_classes(cls) + [cls.__mro__[-2]]:
        if "new_client" in vars(c):
            found = re.findall(r"return (\w+)\(", inspect.getsource(vars(c)["new_client"]))
            return found[-1] if found else "?"
    return "LocalClient"


def served(cls) -> str:
    """The method's default served-statistics protocol when it has the ``bn`` option; the
    methods without it serve each client its own model, or recalibrate what they serve
    themselves (their ``evaluate``)."""
    from fl_lightning.algorithms import Algorithm

    below = [c for c in cls.__mro__ if issubclass(c, Algorithm) and c is not Algorithm]
    for c in below:  # the constructors' options, as the parser follows **kwargs
        if "__init__" in vars(c):
            params = inspect.signature(c.__init__).parameters
            if "bn" in params:
                return cls.default_bn
            if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                break
    return "clients' own models" if any("client_models" in vars(c) for c in own_classes(cls)) else "own recalibration"


def table() -> str:
    names = hooks()
    rows = ["| method | family | base | client | default `bn` | hooks it overrides | parts |",
            "|---|---|---|---|---|---|---|"]
    for name, cls in methods():
        base = cls.__mro__[1].__name__
        over = overridden(cls, names)
        rows.append(f"| {name} | {family(cls)} | {base} | {client_class(cls)} | {served(cls)} | "
                    f"{', '.join(over) or '-'} | {', '.join(parts_used(cls))} |")
    counts = {n: sum(n in overridden(c, names) for _, c in methods()) for n in names}
    own = algorithm_hooks()
    rows += ["", f"Hooks of `Algorithm` ({len(own)}), with how many of the {len(methods())} methods override each "
             "beyond FedAvg: " + ", ".join(f"`{n}` {counts[n]}" for n in own) + ".",
             "", f"Local-training hooks `FedAvg` adds ({len(names) - len(own)}): "
             + ", ".join(f"`{n}` {counts[n]}" for n in names if n not in own) + "."]
    return "\n".join(rows)


def with_table(text: str, body: str) -> str:
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + body + "\n" + text[stop:]


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/architecture.md")
    args = parser.parse_args(argv)
    body = table()
    if args.write:
        DOC.write_text(with_table(DOC.read_text(), body))
    else:
        print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
