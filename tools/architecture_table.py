"""Print (or write into ``docs/architecture.md``) the tables of the methods, read from the code.

The first: which hooks and parts each method uses (a hook is one of ``Algorithm``'s twelve or one
of the local-training hooks ``FedAvg`` adds, which the class or one of its family bases (below
FedAvg) overrides; a part is a shared component (``runtime/``, ``algorithms/``) named in the
source of those classes). The second: what crosses between the server and one client in a round,
measured: each method (``TRAFFIC_CASES``) runs one round on a small digits federation in this
process, and every kind its clients' channels counted, down and up, is listed.

    python tools/architecture_table.py            # print both tables
    python tools/architecture_table.py --write    # replace them in docs/architecture.md

``tests/test_architecture_doc.py`` fails when the doc's first table and the code disagree,
``tests/test_link.py`` when its second does.
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
TRAFFIC_BEGIN, TRAFFIC_END = "<!-- traffic: tools/architecture_table.py -->", "<!-- end of traffic -->"

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
                return cls().bn  # the constructor resolves bn None to the method's default
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


# -- what crosses per client --------------------------------------------------------------------
def small_cache(out_dir: Path, model_section: dict) -> str:
    """A variant cache of the narrowed supernet: its global minimum and five random subnets."""
    import torch

    from fl_lightning.elastic.models import build_model
    from fl_lightning.elastic.search.cache import VariantCache

    model = build_model(model_section, 4, (3, 16, 16))
    g = torch.Generator().manual_seed(3)
    specs = {model.min_spec()} | {model.sample_spec(g) for _ in range(5)}
    path = Path(out_dir) / "cache.json"
    VariantCache.from_specs(model, sorted(specs, key=str)).save(path)
    return str(path)


def traffic_cases(out_dir) -> dict:
    """``{row: (make the method, spec overrides)}``: every method kind on a small federation
    (digits, 6 clients, 3 a round, 2 local steps; split methods on a narrow ResNet-18, supernet
    methods on a narrowed supernet and 16x16 synthetic images, ScaleFL on its narrow ResNet-18)."""
    from fl_lightning import algorithms as a
    from fl_lightning.algorithms.supernet.fednas import PathSearch
    from fl_lightning.config import BudgetConfig, DataConfig, LocalTrainConfig, PartitionConfig
    from fl_lightning.data import Digits, Synthetic

    ofa = {"class_path": "fl_lightning.elastic.models.OFAResNet",
           "init_args": {"width_scale": 0.0625, "max_extra_blocks": 1, "divisor": 2}}
    cache = small_cache(out_dir, ofa)
    supernet = {"model": ofa, "data": DataConfig(dataset=Synthetic(num_classes=4, image_size=16, num_train=400,
                                                                    num_test=80), val_size=40, calib_size=32),
                "partition": PartitionConfig(method="iid", num_clients=6,
                                             budgets=BudgetConfig(b_min=1e5, b_max=3e6, b_cap=2e6))}
    scalefl = {"model": {"class_path": "fl_lightning.elastic.models.ScaleFLResNet18", "init_args": {"width": 0.125}},
               "data": DataConfig(dataset=Digits(), val_size=100, calib_size=64),
               "partition": PartitionConfig(method="iid", num_clients=6, budgets=BudgetConfig(b_min=1e3, b_max=2e5))}

    resnet = {"model": {"class_path": "fl_lightning.elastic.models.ResNet18", "init_args": {"width": 0.125}}}
    caps = [1.0, 0.5, 0.25, 0.75, 1.0, 0.5]
    fedsga = {**resnet, "partition": PartitionConfig(method="dirichlet", num_clients=6, alpha=0.5,
                                                      budgets=BudgetConfig(b_min=3e5, b_max=6e5, b_cap=6e5))}
    return {
        "FedAvg": (a.FedAvg, {}), "FedProx": (lambda: a.FedProx(mu=0.1), {}),
        "Scaffold": (a.Scaffold, {"train": LocalTrainConfig(steps=2, batch_size=16, lr=0.05)}),
        "FedDyn": (lambda: a.FedDyn(alpha=0.1), {}),
        "FedOpt": (a.FedOpt, {}), "FedMut": (a.FedMut, {}),
        "HeteroFL": (lambda: a.HeteroFL(caps=caps), {}), "FjORD": (lambda: a.FjORD(caps=caps, sample="step"), {}),
        "FedRolex": (lambda: a.FedRolex(caps=caps), {}),
        "HASFL": (lambda: a.HASFL(caps=caps, t_warm=0, t_adapt=1), {}), "Uniform": (lambda: a.Uniform(caps=caps), {}),
        "RandomBudget": (lambda: a.RandomBudget(caps=caps, budget=0.5), {}),
        "FedBABU": (lambda: a.FedBABU(finetune_epochs=0), {}), "FedGH": (a.FedGH, {}), "FedAS": (a.FedAS, {}),
        "FIARSE": (a.FIARSE, {"data": DataConfig(dataset=Digits(), val_size=100, calib_size=64)}),
        "Feast": (lambda: a.Feast(cache=cache, mix_schedule="none"), supernet),
        "SuperFedNAS": (lambda: a.SuperFedNAS(cache=cache, mix_schedule="none"), supernet),
        "DeepFedNAS": (lambda: a.DeepFedNAS(cache=cache, mix_schedule="none",
                                            path=PathSearch(targets=8, population=16, generations=10, rho=1.0)),
                       supernet),
        "ScaleFL": (lambda: a.ScaleFL(mix_schedule="none"), scalefl),
        "SplitFed (V1)": (lambda: a.SplitFed(cut="layer2.1"), resnet),
        "SplitFed (V2)": (lambda: a.SplitFed(cut="layer2.1", version="v2"), resnet),
        "MUSplitFed": (lambda: a.MUSplitFed(cut="layer2.1"), resnet),
        "MultiSFL": (lambda: a.MultiSFL(cut="layer2.1"), resnet),
        "MergeSFL": (lambda: a.MergeSFL(cut="layer2.1"), resnet),
        "FedSGA": (lambda: a.FedSGA(calibration_every=1, probe_size=8, prompt_width=1), fedsga),
        "FedSGA (V1, additive read-out)": (lambda: a.FedSGA(calibration_every=1, probe_size=8, prompt_width=1,
                                                             server_model="copy", readout="additive_bias"), fedsga),
    }


def small_spec(out_dir, name: str, algorithm, **overrides):
    """A small run on digits: 6 clients, 3 a round, 2 rounds of 2 local steps, one CPU rank."""
    from fl_lightning.config import (DataConfig, EvalConfig, FabricConfig, FederationConfig, LocalTrainConfig,
                                     PartitionConfig)
    from fl_lightning.data import Digits
    from fl_lightning.federation.builder import RunSpec

    sections = dict(data=DataConfig(dataset=Digits(), val_size=100),
                    partition=PartitionConfig(method="dirichlet", num_clients=6, alpha=0.5),
                    model={"class_path": "fl_lightning.elastic.models.CNN"},
                    train=LocalTrainConfig(steps=2, batch_size=16, lr=0.05, momentum=0.9),
                    federation=FederationConfig(rounds=2, clients_per_round=3), eval=EvalConfig(every=1),
                    fabric=FabricConfig(accelerator="cpu", devices=1, threads_per_rank=1))
    sections.update(overrides)
    return RunSpec(name=name, out_dir=str(out_dir), seed=0, algorithm=algorithm, **sections)


def channel_kinds(uplinks) -> tuple:
    """The kinds that crossed, down and up, over some uplinks' channels (sorted, model first)."""
    order = lambda kind: (kind != "model", kind)  # noqa: E731
    down = sorted({k for u in uplinks for (d, k) in u.channel.counts if d == "down"}, key=order)
    up = sorted({k for u in uplinks for (d, k) in u.channel.counts if d == "up"}, key=order)
    return tuple(down), tuple(up)


def recording_uplinks(algorithm) -> list:
    """Every uplink the method's ``fit_cohort`` yields from now on, appended to the returned list."""
    seen, fit_cohort = [], algorithm.fit_cohort

    def recorded(plan, owned):
        for task, uplink in fit_cohort(plan, owned):
            seen.append(uplink)
            yield task, uplink

    algorithm.fit_cohort = recorded
    return seen


def measure_traffic(out_dir) -> dict:
    """``{row: (kinds down, kinds up)}`` of one round of every traffic case."""
    from lightning.fabric import Fabric

    from fl_lightning.federation.loop import Federation
    from fl_lightning.federation.run_dir import RunDir

    out = {}
    for row, (make, overrides) in traffic_cases(out_dir).items():
        spec = small_spec(Path(out_dir), re.sub(r"\W+", "_", row), make(), **overrides)
        fed = Federation(Fabric(accelerator="cpu", devices=1), spec, RunDir(spec.out_dir, spec.name))
        fed._open_outputs()
        uplinks = recording_uplinks(fed.algorithm)
        fed.run_round(0)
        out[row] = channel_kinds(uplinks)
    return out


TRAFFIC_NOTES = {
    "model": "the routed model's regions (a slice, a front, a body, a header) that cross",
    "c": "SCAFFOLD's server control variate", "delta_c": "SCAFFOLD's change of the client's control variate",
    "fisher": "FedAS's Fisher-trace aggregation weight", "prototypes": "FedGH's class prototypes and their labels",
    "cut": "activations up and their gradients down at the cut",
    "probe": "FedSGA's probe interfaces of the received model and the trained shallow interface, with labels",
    "align": "FedSGA's alignment gradient at the cut (prompt_gradient: task)",
}


def traffic_table(kinds: dict) -> str:
    rows = ["| method | down (server to client) | up (client to server) |", "|---|---|---|"]
    rows += [f"| {row} | {', '.join(down) or '-'} | {', '.join(up) or '-'} |" for row, (down, up) in kinds.items()]
    used = sorted({k for down, up in kinds.values() for k in down + up})
    rows += ["", "Kinds: " + "; ".join(f"`{k}` {TRAFFIC_NOTES.get(k, '')}".rstrip() for k in used) + "."]
    return "\n".join(rows)


def with_table(text: str, body: str, begin: str = BEGIN, end: str = END) -> str:
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[:start] + "\n" + body + "\n" + text[stop:]


def main(argv=None) -> int:
    import tempfile

    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the tables in docs/architecture.md")
    args = parser.parse_args(argv)
    body = table()
    with tempfile.TemporaryDirectory() as out:
        traffic = traffic_table(measure_traffic(out))
    if args.write:
        DOC.write_text(with_table(with_table(DOC.read_text(), body), traffic, TRAFFIC_BEGIN, TRAFFIC_END))
    else:
        print(body + "\n\n" + traffic)
    return 0


if __name__ == "__main__":
    sys.exit(main())
