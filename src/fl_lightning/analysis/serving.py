"""Any run of the supernet comparison in one form: operating points, clients, training compute.

FEAST (and the SuperFedNAS / DeepFedNAS transfers evaluated as FEAST), ScaleFL, FIARSE and
HeteroFL save different artifacts; :func:`load_run` reads a run directory into a
:class:`ServingRun`:

- ``points``: the method's measured operating points, cheapest first: name, served MACs in the
  method's own convention (``macs_convention``), parameters where the run records them, test
  accuracy (the best-validation checkpoint's when the run has one, else the final model's);
- the population: every client's MAC budget and shard size (``partition.pt``), the point it is
  served under largest-affordable serving and whether that is the minimum-tier fallback (a
  client that affords no point gets the method's cheapest one, FEAST Supp. E.1);
- training compute: the analytic forward-plus-backward proxy (Eq. 26, ``kappa`` times forward
  MACs) of what each client executes per example, times its realized shard size, local epochs
  and the expected participations ``rounds x clients_per_round / num_clients`` (Supp. E.4).
  FEAST's total is its own accounting (``accounting.json``); a baseline's is computed here
  from what it executes: ScaleFL its level model with every exit, HeteroFL its tier, FIARSE the
  dense model (executed; the masked, logical count is reported beside it).

Adapters are registered by the algorithm's class name (``config.yaml``'s
``algorithm.class_path``); :data:`ADAPTERS` is the only place that knows a method's files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import yaml

from fl_lightning.feast_protocol import KAPPA_FB
from fl_lightning.saved_configs import dataset_of, upgrade_tree


class RunFormatError(ValueError):
    """A folder that is not a run this module can read (one line naming the folder and the gap)."""


@dataclass(frozen=True)
class Point:
    """One measured operating point."""

    name: str
    macs: float
    """Served (inference) MACs per example, in the run's ``macs_convention``."""
    params: Optional[float]
    acc: Optional[float]
    """Test accuracy in [0, 1]; None where the run did not score the point."""


@dataclass
class ServingRun:
    path: Path
    method: str
    """Display name (``FEAST``, ``ScaleFL``, ``SFN, constrained``, ``FEAST (min_only)`` ...)."""
    kind: str
    """Adapter: feast, transfer, scalefl, heterofl, fiarse."""
    config: dict
    points: List[Point]
    macs_convention: str
    budgets: np.ndarray
    sizes: np.ndarray
    served: np.ndarray
    """Index into ``points`` per client (largest affordable, or the cheapest as fallback)."""
    fallback: np.ndarray
    reported_acc: Optional[float]
    """The run's own population accuracy (``test_acc``)."""
    forward_macs: Optional[np.ndarray] = None
    """Per client, forward MACs one training example costs per local epoch (executed)."""
    forward_macs_logical: Optional[np.ndarray] = None
    proxy: Optional[float] = None
    """Expected total training proxy over the run (kappa x forward MACs, executed)."""
    proxy_logical: Optional[float] = None
    kappa: float = KAPPA_FB
    notes: List[str] = field(default_factory=list)

    # -- config ---------------------------------------------------------------------------------
    def get(self, dotted: str, default=None):
        """A value of the saved config by dotted key (``partition.budgets.zipf_s``)."""
        node = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def dataset(self) -> str:
        """The dataset's short name (``synthetic``, ``cifar100``, ...)."""
        return dataset_of(self.config)[0].name

    @property
    def seed(self) -> int:
        return int(self.get("seed", 0))

    @property
    def rounds(self) -> int:
        return int(self.get("federation.rounds"))

    @property
    def clients_per_round(self) -> int:
        return int(self.get("federation.clients_per_round"))

    @property
    def epochs(self) -> int:
        return int(self.get("train.epochs", 1))

    @property
    def num_clients(self) -> int:
        return len(self.budgets)

    # -- serving --------------------------------------------------------------------------------
    @property
    def point_macs(self) -> np.ndarray:
        return np.array([p.macs for p in self.points], dtype=np.float64)

    @property
    def point_accs(self) -> np.ndarray:
        return np.array([np.nan if p.acc is None else p.acc for p in self.points], dtype=np.float64)

    def client_accs(self) -> np.ndarray:
        """Accuracy of the point each client is served."""
        return self.point_accs[self.served]

    @property
    def population_acc(self) -> float:
        """Mean over clients of their served point's accuracy (Table 1)."""
        return float(self.client_accs().mean())


# -- the rules every method shares ---------------------------------------------------------------

def largest_affordable(point_macs: Sequence[float], budgets: Sequence[float]) -> Tuple[np.ndarray, np.ndarray]:
    """Largest-affordable serving with the minimum-tier fallback (FEAST Supp. E.1).

    Returns (index of the served point per client, fallback flag per client): the point with
    the most MACs within the client's budget (ties: the later point), or the cheapest point
    (ties: the earlier), flagged, when the client affords none.
    """
    macs = np.asarray(point_macs, dtype=np.float64)
    if macs.size == 0:
        raise ValueError("no operating points to serve")
    order_desc = sorted(range(len(macs)), key=lambda j: (macs[j], j), reverse=True)
    cheapest = min(range(len(macs)), key=lambda j: (macs[j], j))
    served, fallback = [], []
    for b in np.asarray(budgets, dtype=np.float64):
        pick = next((j for j in order_desc if macs[j] <= b), None)
        served.append(cheapest if pick is None else pick)
        fallback.append(pick is None)
    return np.array(served, dtype=np.int64), np.array(fallback, dtype=bool)


def expected_participations(rounds: int, clients_per_round: int, num_clients: int) -> float:
    """Expected rounds each client takes part in under uniform cohorts (Supp. E.4)."""
    return rounds * clients_per_round / num_clients


def training_proxy(forward_macs: Sequence[float], sizes: Sequence[int], rounds: int, clients_per_round: int,
                   epochs: int = 1, kappa: float = KAPPA_FB) -> float:
    """``kappa x epochs x E[participations] x sum_i n_i m_i``: the analytic forward-plus-backward
    proxy of a federation whose client ``i`` executes ``m_i`` forward MACs per example on its
    ``n_i`` examples (FEAST Eq. 26 with one variant per pass)."""
    m = np.asarray(forward_macs, dtype=np.float64)
    n = np.asarray(sizes, dtype=np.float64)
    return float(kappa * epochs * expected_participations(rounds, clients_per_round, len(n)) * (n * m).sum())


# -- reading a run folder ---------------------------------------------------------------------

@dataclass
class RunFiles:
    """The files every run has, read once."""

    path: Path
    config: dict
    block: dict
    """``summary.json``'s best block when it holds test scores, else its final block."""
    budgets: np.ndarray
    sizes: np.ndarray

    def read_json(self, name: str, required: bool = True) -> Optional[dict]:
        file = self.path / name
        if not file.is_file():
            if required:
                raise RunFormatError(f"{self.path}: no {name}")
            return None
        return json.loads(file.read_text())

    def init_args(self) -> dict:
        return (self.config.get("algorithm") or {}).get("init_args") or {}

    def test(self, key: str) -> Optional[float]:
        value = self.block.get(f"test_{key}")
        return None if value is None else float(value)


def read_files(path: Path) -> RunFiles:
    from fl_lightning.runtime.checkpoint import load_checkpoint

    path = Path(path)
    for name in ("config.yaml", "summary.json", "partition.pt"):
        if not (path / name).is_file():
            raise RunFormatError(f"{path}: no {name} (not a finished run)")
    config = yaml.safe_load((path / "config.yaml").read_text())
    config = upgrade_tree(config) or config  # a run saved with a named model or dataset
    summary = json.loads((path / "summary.json").read_text())
    best, final = summary.get("best") or {}, summary.get("final") or {}
    block = best if "test_acc" in best else final
    if "test_acc" not in block:
        raise RunFormatError(f"{path}: summary.json holds no test scores")
    part = load_checkpoint(path / "partition.pt", key="run")
    if "budgets" not in part:
        raise RunFormatError(f"{path}: partition.pt holds no client budgets (not a budgeted population)")
    clients = sorted((k for k in part if k.startswith("client/")), key=lambda k: int(k.split("/")[1]))
    sizes = np.array([len(part[k]) for k in clients], dtype=np.int64)
    budgets = part["budgets"].double().numpy()
    return RunFiles(path, config, block, budgets, sizes)


def algorithm_name(config: dict) -> str:
    return str((config.get("algorithm") or {}).get("class_path", "")).rsplit(".", 1)[-1]


def _finish(files: RunFiles, method: str, kind: str, points: List[Point], convention: str,
            forward=None, forward_logical=None, proxy=None, notes=()) -> ServingRun:
    """Serve the population, and compute the proxy from per-client forward MACs where the
    adapter did not give a total."""
    served, fallback = largest_affordable([p.macs for p in points], files.budgets)
    run = ServingRun(files.path, method, kind, files.config, points, convention, files.budgets, files.sizes,
                     served, fallback, files.test("acc"), notes=list(notes))
    kappa = float(files.init_args().get("kappa", KAPPA_FB)) if kind == "feast" else KAPPA_FB
    run.kappa = kappa
    if files.config.get("train", {}).get("steps"):
        run.notes.append("train.steps is set: the proxy counts train.epochs passes over each shard, as FEAST's "
                         "accounting does")
    args = (files.config["federation"]["rounds"], files.config["federation"]["clients_per_round"], run.epochs)
    if forward is not None:
        run.forward_macs = np.asarray(forward, dtype=np.float64)
        run.proxy = training_proxy(run.forward_macs, run.sizes, *args, kappa=kappa) if proxy is None else proxy
    else:
        run.proxy = proxy
    if forward_logical is not None:
        run.forward_macs_logical = np.asarray(forward_logical, dtype=np.float64)
        run.proxy_logical = training_proxy(run.forward_macs_logical, run.sizes, *args, kappa=kappa)
    return run


def _variant_points(files: RunFiles) -> Tuple[List[Point], object]:
    from fl_lightning.elastic.search.cache import VariantCache

    if not (files.path / "cache.json").is_file():
        raise RunFormatError(f"{files.path}: no cache.json")
    cache = VariantCache.load(files.path / "cache.json", key="run")
    points = [Point(f"variant{j:02d}", float(m), float(p), files.test(f"variant{j:02d}_acc"))
              for j, (m, p) in enumerate(zip(cache.macs, cache.params))]
    return points, cache


def feast_form(files: RunFiles) -> ServingRun:
    """FEAST: the cached variants; the proxy is the run's own Eq. 26 accounting."""
    from fl_lightning.algorithms.supernet.feast_accounting import affordable_sets, pass_macs_per_example

    points, cache = _variant_points(files)
    rule = files.init_args().get("rule", "full")
    method = "FEAST" if rule == "full" else f"FEAST ({rule})"
    sets = affordable_sets(cache, files.budgets.tolist())
    if any(not s for s in sets):
        raise RunFormatError(f"{files.path}: a client affords no cached variant (FEAST refuses such populations)")
    forward = [pass_macs_per_example(cache, s, rule) for s in sets]
    accounting = files.read_json("accounting.json", required=False) or {}
    proxy = (accounting.get("computation") or {}).get("feast_train_macs")
    return _finish(files, method, "feast", points, "feast cache (convolutions and classifier)", forward=forward,
                   proxy=None if proxy is None else float(proxy))


def transfer_form(files: RunFiles) -> ServingRun:
    """SuperFedNAS / DeepFedNAS transfers: evaluated as FEAST (cached variants); their random
    samplers have no closed-form per-client cost, so no proxy."""
    points, _ = _variant_points(files)
    short = {"SuperFedNAS": "SFN", "DeepFedNAS": "DFN"}[algorithm_name(files.config)]
    constrained = bool(files.init_args().get("constrained", False))
    method = f"{short}, {'constrained' if constrained else 'unconstrained'}"
    return _finish(files, method, "transfer", points, "feast cache (convolutions and classifier)")


def tiered_form(files: RunFiles, method: str, kind: str, artifact: str = "levels.json",
                acc_key: str = "level") -> ServingRun:
    """Fixed native tiers with a ScaleFL-style artifact: ``{"levels": [{"served_macs",
    "train_macs" (optional: the served MACs), "served_params" or "params"}, ...]}`` (smallest
    first) and test keys ``test_{acc_key}{k}_acc`` (k from 1). Training executes the served
    tier's ``train_macs`` (ScaleFL: the level model with every exit)."""
    saved = files.read_json(artifact)
    levels = saved["levels"]
    points = []
    for k, level in enumerate(levels, start=1):
        params = level.get("served_params", level.get("params"))
        points.append(Point(f"{acc_key}{k}", float(level["served_macs"]), None if params is None else float(params),
                            files.test(f"{acc_key}{k}_acc")))
    train = np.array([float(level.get("train_macs", level["served_macs"])) for level in levels])
    served, _ = largest_affordable([p.macs for p in points], files.budgets)
    notes = []
    assigned = [c.get("level") for c in saved.get("clients", [])]
    if assigned and assigned != [int(k) + 1 for k in served]:
        notes.append(f"{artifact}'s client levels differ from largest-affordable serving of its levels")
    return _finish(files, method, kind, points, "fvcore", forward=train[served], notes=notes)


def scalefl_form(files: RunFiles) -> ServingRun:
    return tiered_form(files, "ScaleFL", "scalefl")


# ---- HeteroFL adapter ----------------------------------------------------------------------
# The FEAST-protocol HeteroFL run (five width tiers 1/16 .. 1, largest-affordable tier per
# client) is expected to save a ScaleFL-like tier artifact and ``test_level{k}_acc`` keys. Fill
# in the two names below with what it writes (artifact file, key stem); if its artifact differs
# in shape, translate it here into ``tiered_form``'s. A HeteroFL run of the sub-model study
# (caps.json, no budgets) is not a population run and is refused.
HETEROFL_ARTIFACT = "levels.json"
HETEROFL_ACC_KEY = "level"


def heterofl_form(files: RunFiles) -> ServingRun:
    if not (files.path / HETEROFL_ARTIFACT).is_file():
        raise RunFormatError(f"{files.path}: HeteroFL run without its tier artifact {HETEROFL_ARTIFACT} "
                             f"(a sub-model-study run, or set HETEROFL_ARTIFACT in analysis/serving.py)")
    return tiered_form(files, "HeteroFL", "heterofl", HETEROFL_ARTIFACT, HETEROFL_ACC_KEY)
# ---- end of the HeteroFL adapter ------------------------------------------------------------


def fiarse_form(files: RunFiles) -> ServingRun:
    """FIARSE: its evaluated mask grid at logical MACs (what serving compares with budgets).
    Training executes the dense model (the mask acts on dense tensors, Supp. E.4); the logical
    count is each client's training fraction read off the trained grid (linear interpolation of
    logical MACs in kept fraction; ``budget_match: macs`` keeps it within the budget)."""
    info = files.read_json("fiarse.json")
    points, curve = [], {0.0: 0.0, 1.0: float(info["dense_macs"])}
    for j in range(len(info["grid"])):
        macs = files.test(f"point{j:02d}_logical_macs")
        if macs is None:
            continue
        points.append(Point(f"point{j:02d}", macs, None, files.test(f"point{j:02d}_acc")))
        curve[files.test(f"point{j:02d}_fraction")] = macs
    if not points:
        raise RunFormatError(f"{files.path}: summary.json holds no FIARSE test grid")
    dense = float(info["dense_macs"])
    if files.init_args().get("budget_match", "params") == "macs":
        logical = np.clip(files.budgets, min(p.macs for p in points), dense)
    else:
        kept = sorted(curve)
        logical = np.interp(np.asarray(info["fractions"], dtype=np.float64), kept, [curve[k] for k in kept])
    notes = []
    if not np.allclose(np.asarray(info["budgets"], dtype=np.float64), files.budgets):
        notes.append("fiarse.json budgets differ from the partition's (algorithm.fractions set?)")
    return _finish(files, "FIARSE", "fiarse", points, info.get("macs_convention", "paper"),
                   forward=np.full(len(files.budgets), dense), forward_logical=logical, notes=notes)


ADAPTERS: Dict[str, Callable[[RunFiles], ServingRun]] = {
    "Feast": feast_form,
    "SuperFedNAS": transfer_form,
    "DeepFedNAS": transfer_form,
    "ScaleFL": scalefl_form,
    "HeteroFL": heterofl_form,
    "FIARSE": fiarse_form,
}
"""Algorithm class name -> adapter."""


def load_run(path) -> ServingRun:
    """Read one run directory into the common form (RunFormatError for what cannot be read)."""
    files = read_files(Path(path))
    name = algorithm_name(files.config)
    if name not in ADAPTERS:
        raise RunFormatError(f"{path}: no serving adapter for algorithm {name or '?'} "
                             f"(known: {', '.join(ADAPTERS)})")
    return ADAPTERS[name](files)


__all__ = ["Point", "ServingRun", "RunFormatError", "largest_affordable", "expected_participations",
           "training_proxy", "load_run", "ADAPTERS", "HETEROFL_ARTIFACT", "HETEROFL_ACC_KEY"]
