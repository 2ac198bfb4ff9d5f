"""The genetic search of FEAST Supp. B.1 / E.3: ``argmax F(a)`` s.t. ``MAC(a) <= B``,
``rho(a) <= rho_0`` (Supp. Eq. 10) over genomes ``[d, e, w]`` (see :mod:`.cost`).

Only feasible architectures ever enter the population:

- *initialization*: random genomes (each drawn under its own random fraction of the gene
  maxima, so small networks are sampled too) are repaired by random descent: while the MAC
  limit is exceeded, a random nonzero gene is decremented; while ``rho`` is too high, a random
  nonzero depth gene is (dropping blocks usually lowers ``rho``). Genomes that cannot be repaired
  are dropped and more are drawn;
- *crossover* (single point, always applied): a child that breaks a limit is repaired by the
  same descent, and replaced by the parent that gave it its head if that fails;
- *mutation* (probability ``mutation`` per child, DeepFedNAS's per-individual rate): one random
  gene gets a new random value; if that breaks a limit, descent on the *other* genes repairs
  it (so one gene can grow at the expense of the others), else the child stays as it was.

Parents come from ``tournament``-size tournaments (contenders drawn with replacement); the
``elitism`` fittest individuals pass unchanged to the next generation. Everything runs on
numpy arrays with one seeded generator, so a search is deterministic given its seed.

Post-hoc extraction adds two options: gene bounds (every draw, repair and mutation stays within
a range per gene) and starting architectures that join the initial population where feasible.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import numpy as np

from fl_lightning.elastic.models.ofa_resnet import OFAResNet, OFASpec
from fl_lightning.elastic.search.cost import CostModel, DeepFedNASArch, cost_model
from fl_lightning.elastic.search.fitness import Fitness, FitnessConfig


class SearchResult(NamedTuple):
    """The best architecture found: ``spec, macs, fitness = search(...)``."""

    spec: OFASpec
    macs: int
    fitness: float


class InfeasibleError(ValueError):
    """No architecture satisfying both limits was found."""


class Problem:
    """One constrained target: the limits plus the cost and fitness models that check them.
    ``lower`` / ``upper`` (optional, one value per gene) bound the genes searched; by default
    every choice of the space."""

    def __init__(self, cost: CostModel, fitness: Fitness, mac_limit: float, rho_limit: float,
                 lower: Optional[np.ndarray] = None, upper: Optional[np.ndarray] = None):
        self.cost, self.fitness = cost, fitness
        self.mac_limit, self.rho_limit = float(mac_limit), float(rho_limit)
        self.lower = np.zeros(cost.num_genes, dtype=np.int64) if lower is None else np.asarray(lower, dtype=np.int64)
        self.upper = np.asarray(cost.upper if upper is None else upper, dtype=np.int64)
        if self.lower.shape != (cost.num_genes,) or self.upper.shape != (cost.num_genes,) \
                or np.any(self.lower < 0) or np.any(self.upper > cost.upper) or np.any(self.lower > self.upper):
            raise ValueError(f"gene bounds must satisfy 0 <= lower <= upper <= {cost.upper.tolist()}, "
                             f"got {self.lower.tolist()} / {self.upper.tolist()}")

    def evaluate(self, genes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(feasible, fitness, macs)`` per row."""
        macs = self.cost.macs(genes)
        fitness, rho = self.fitness.evaluate(genes)
        return (macs <= self.mac_limit) & (rho <= self.rho_limit), fitness, macs


def sample_feasible(problem: Problem, count: int, rng: np.random.Generator,
                    max_rounds: int = 50) -> np.ndarray:
    """Up to ``count`` random feasible genomes (fewer only if ``max_rounds`` batches of draws
    and repairs did not find that many)."""
    cost = problem.cost
    found: list[np.ndarray] = []
    total = 0
    span = problem.upper - problem.lower
    for _ in range(max_rounds):
        n = max(64, 2 * (count - total))
        scale = rng.random((n, 1))
        genes = problem.lower + np.floor(rng.random((n, cost.num_genes)) * (np.floor(scale * span) + 1)).astype(np.int64)
        genes = genes[_repair(problem, genes, rng)]
        found.append(genes)
        total += len(genes)
        if total >= count:
            break
    genes = np.concatenate(found)[:count]
    return genes


def _repair(problem: Problem, genes: np.ndarray, rng: np.random.Generator,
            frozen: Optional[np.ndarray] = None) -> np.ndarray:
    """Repair ``genes`` in place by random descent; returns the mask of feasible rows.

    ``frozen`` (rows x genes, optional) marks genes the descent must not touch: a mutation's
    new value is kept and the other genes make room for it.
    """
    cost = problem.cost
    S = cost.num_stages
    is_depth = np.zeros(cost.num_genes, dtype=bool)
    is_depth[:S] = True
    alive = np.ones(len(genes), dtype=bool)
    ok = np.zeros(len(genes), dtype=bool)
    while True:
        todo = np.flatnonzero(alive & ~ok)
        if len(todo) == 0:
            return ok
        sub = genes[todo]
        macs = cost.macs(sub)
        rho = problem.fitness.rho(sub)
        over = macs > problem.mac_limit
        dense = ~over & (rho > problem.rho_limit)
        ok[todo[~over & ~dense]] = True
        movable = (sub > problem.lower) & (over[:, None] | (dense[:, None] & is_depth[None, :]))
        if frozen is not None:
            movable &= ~frozen[todo]
        need = over | dense
        stuck = need & ~movable.any(axis=1)
        alive[todo[stuck]] = False
        step = need & ~stuck
        if not step.any():
            continue
        # A uniformly random movable gene per row: the largest of random keys on movable genes.
        keys = rng.random(movable.shape) * movable
        gene = np.argmax(keys, axis=1)
        rows = np.flatnonzero(step)
        genes[todo[rows], gene[rows]] -= 1


def _tournament(fitness: np.ndarray, count: int, size: int, rng: np.random.Generator) -> np.ndarray:
    contenders = rng.integers(0, len(fitness), size=(count, size))
    return contenders[np.arange(count), np.argmax(fitness[contenders], axis=1)]


def _mutate(problem: Problem, children: np.ndarray, rate: float, rng: np.random.Generator) -> None:
    """Single-gene mutation with probability ``rate`` per child, in place. A proposal that
    breaks a limit is repaired by descent on the *other* genes (so a gene can grow at the
    expense of the rest); one that cannot be repaired is dropped and the child stays as is."""
    rows = np.flatnonzero(rng.random(len(children)) < rate)
    if len(rows) == 0:
        return
    proposal = children[rows].copy()
    gene = rng.integers(0, problem.cost.num_genes, size=len(rows))
    low, span = problem.lower[gene], problem.upper[gene] - problem.lower[gene]
    # A different value, uniform over the other choices (genes without choices stay put).
    shift = 1 + np.floor(rng.random(len(rows)) * np.maximum(span, 1)).astype(np.int64)
    at = np.arange(len(rows))
    moved = low + (proposal[at, gene] - low + shift) % (span + 1)
    proposal[at, gene] = np.where(span > 0, moved, proposal[at, gene])
    frozen = np.zeros(proposal.shape, dtype=bool)
    frozen[at, gene] = True
    ok = _repair(problem, proposal, rng, frozen)
    children[rows[ok]] = proposal[ok]


def evolve(problem: Problem, population: int = 256, generations: int = 512, mutation: float = 0.3,
           tournament: int = 3, elitism: int = 1, seed: int = 0,
           start: Optional[np.ndarray] = None) -> tuple[np.ndarray, float, int]:
    """Run the GA on ``problem``; returns ``(genome, fitness, macs)`` of the best individual.

    ``start`` (genomes, optional): candidates that join the initial population when they lie
    within the gene bounds and satisfy both limits (post-hoc extraction passes the trained
    cache's variants), so the
    result is never less fit than the fittest feasible one of them; the random draws fill the
    rest and are drawn as without them.
    """
    if population < 2 or generations < 0 or not 0 <= mutation <= 1 or tournament < 1:
        raise ValueError("need population >= 2, generations >= 0, 0 <= mutation <= 1, tournament >= 1")
    if not 0 <= elitism < population:
        raise ValueError(f"elitism must be in [0, population), got {elitism}")
    rng = np.random.default_rng(seed)
    pop = sample_feasible(problem, population, rng)
    if start is not None and len(start):
        start = np.unique(np.atleast_2d(np.asarray(start, dtype=np.int64)), axis=0)
        inside = np.all((start >= problem.lower) & (start <= problem.upper), axis=1)
        start = start[inside][problem.evaluate(start[inside])[0]][:population]
        pop = np.concatenate([start, pop])[:population]
    if len(pop) == 0:
        smallest = int(problem.cost.macs(problem.lower)[0])
        raise InfeasibleError(f"no architecture with MACs <= {problem.mac_limit:.4g} and "
                              f"rho <= {problem.rho_limit:g} was found (the smallest subnet searched has "
                              f"{smallest} MACs)")
    if len(pop) < population:  # a tiny feasible region: fill up with copies
        pop = pop[np.arange(population) % len(pop)]
    _, fit, macs = problem.evaluate(pop)
    G = problem.cost.num_genes
    n_child = population - elitism
    n_pairs = (n_child + 1) // 2
    positions = np.arange(G)[None, :]
    best = int(np.argmax(fit))
    best_genes, best_fit, best_macs = pop[best].copy(), float(fit[best]), int(macs[best])
    for _ in range(generations):
        elite = np.argsort(-fit, kind="stable")[:elitism]
        parents = _tournament(fit, 2 * n_pairs, tournament, rng)
        first, second = parents[:n_pairs], parents[n_pairs:]
        head = positions < rng.integers(1, G, size=(n_pairs, 1))
        children = np.concatenate([np.where(head, pop[first], pop[second]),
                                   np.where(head, pop[second], pop[first])])[:n_child]
        donors = np.concatenate([first, second])[:n_child]
        ok = _repair(problem, children, rng)
        children[~ok] = pop[donors[~ok]]
        _mutate(problem, children, mutation, rng)
        _, child_fit, child_macs = problem.evaluate(children)
        pop = np.concatenate([pop[elite], children])
        fit = np.concatenate([fit[elite], child_fit])
        macs = np.concatenate([macs[elite], child_macs])
        best = int(np.argmax(fit))
        if fit[best] > best_fit:  # kept apart from the population so elitism = 0 loses nothing
            best_genes, best_fit, best_macs = pop[best].copy(), float(fit[best]), int(macs[best])
    return best_genes, best_fit, best_macs


def search(model: Union[OFAResNet, DeepFedNASArch, CostModel], mac_limit: float, rho_limit: float,
           population: int = 256, generations: int = 512, mutation: float = 0.3, tournament: int = 3,
           elitism: int = 1, seed: int = 0, input_shape: Optional[Sequence[int]] = None,
           fitness: FitnessConfig = FitnessConfig(), start: Sequence[OFASpec] = (),
           bounds: Optional[tuple[np.ndarray, np.ndarray]] = None) -> SearchResult:
    """``argmax F(a)`` over the model's architectures with ``MAC(a) <= mac_limit`` and
    ``rho(a) <= rho_limit`` (MACs counted at ``input_shape``, default the model's).
    ``start``: architectures that join the initial population where they satisfy both limits
    (:func:`evolve`); ``bounds``: ``(lower, upper)`` gene values searched (:class:`Problem`).

    ``model`` is an :class:`OFAResNet` (fvcore MACs), a :class:`DeepFedNASArch` (DeepFedNAS's
    convention, the paper's) or a cost model of either; genomes with one expansion per stage.

    The paper's settings are the defaults (population 256, 512 generations, mutation 0.3;
    population 512 for post-hoc extraction, Supp. E.3); ``fitness`` chooses the objective's
    terms. The spec is named canonically (:meth:`OFACostModel.canonical`). Raises
    :class:`InfeasibleError` when no feasible architecture is found.
    """
    cost = cost_model(model, input_shape)
    problem = Problem(cost, Fitness(cost, fitness), mac_limit, rho_limit, *(bounds or (None, None)))
    initial = cost.encode_many(start) if len(start) else None
    genes, best, macs = evolve(problem, population, generations, mutation, tournament, elitism, seed, initial)
    return SearchResult(cost.decode(cost.canonical(genes)[0]), macs, best)
