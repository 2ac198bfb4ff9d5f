"""Client partitions: IID, label-skew Dirichlet, natural groups, and FEAST's budget-aware
gamma-Dirichlet (Supp. A of ``papers/feast-federated-shared-space-training.txt``, Eq. 4-8).

Every partitioner is a pure function of (targets, parameters, seed). It returns one sorted
``torch.LongTensor`` of indices into the ``targets`` it was given per client. For ``iid``,
``dirichlet`` and ``gamma_dirichlet`` the shards are disjoint and cover every index exactly
once. When server-held splits were carved out first, pass ``targets[pool_idx]`` and map the
result back with :func:`fl_lightning.data.splits.to_dataset_indices`.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, get_args

import numpy as np
import torch

from fl_lightning.config import PartitionMethod
from fl_lightning.data.budgets import B_CAP, allocation_weights
from fl_lightning.errors import ConfigError
from fl_lightning.seeds import seeded_rng

PARTITION_METHODS = get_args(PartitionMethod)
CLASS_ORDERS = ("ascending", "random")
DEFAULT_MAX_RETRIES = 10000
MAX_CONCENTRATION = 1e100
"""Largest Dirichlet concentration drawn with. Past about 1e20 a draw equals its mean to float64
precision, and numpy's sampler returns zeros once the concentrations' sum overflows (near
1e308), so a larger alpha (a huge but finite ``partition.alpha``, i.e. near-iid) is drawn at
this bound: the same partition, the mean proportions."""


# ----------------------------------------------------------------------------- helpers


def _as_targets(targets) -> np.ndarray:
    y = np.asarray(targets.cpu() if isinstance(targets, torch.Tensor) else targets)
    if y.ndim != 1:
        raise ConfigError("partition.targets", f"must be one label per example (1-D), got shape {y.shape}")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        raise ConfigError("partition.targets", f"labels must be integers, got dtype {y.dtype}")
    return y.astype(np.int64, copy=False)


def _indices_by_class(y: np.ndarray):
    """Class labels in ascending order and, for each, its example indices (ascending)."""
    order = np.argsort(y, kind="stable")
    classes, starts = np.unique(y[order], return_index=True)
    return classes, np.split(order, starts[1:])


def _shards_from_owner(owner: np.ndarray, num_clients: int) -> List[torch.Tensor]:
    """Turn a per-example client id into one sorted index tensor per client."""
    order = np.argsort(owner, kind="stable")  # stable: indices stay ascending within a client
    sizes = np.bincount(owner, minlength=num_clients)
    return [torch.from_numpy(s.astype(np.int64)) for s in np.split(order, np.cumsum(sizes)[:-1])]


def _split_sizes(num: int, p: np.ndarray) -> np.ndarray:
    """Segment sizes of a contiguous split of ``num`` items at floor(num * cumsum(p)) (Eq. 5).

    The first N-1 split points are floored; the last segment runs to the end, so the sizes
    always sum to ``num``. Dividing by the last cumulative sum makes it exactly 1, so clients
    with p_i = 0 (masked ones included, also at the end) get exactly nothing rather than an
    example lost to rounding of a cumsum like 0.9999999999.
    """
    c = np.cumsum(p)
    cuts = np.minimum(np.floor(num * (c[:-1] / c[-1])).astype(np.int64), num)
    return np.diff(np.concatenate(([0], cuts, [num])))


def _check_positive(value, key: str) -> float:
    if value is None or not math.isfinite(float(value)) or float(value) <= 0:
        raise ConfigError(key, f"must be finite and > 0, got {value}")
    return float(value)


def _check_min_size(min_size) -> int:
    if int(min_size) != min_size or min_size < 0:
        raise ConfigError("partition.min_size", f"must be an integer >= 0, got {min_size}")
    return int(min_size)


def clients_need(num_clients: int, min_size: int) -> int:
    """The fewest pool examples a partition among ``num_clients`` can be drawn from: one per
    client, whatever ``min_size`` says, and ``min_size`` each."""
    return max(int(num_clients), int(num_clients) * int(min_size))


def _check_feasible(num_examples: int, num_clients: int, min_size: int) -> None:
    if num_clients > num_examples:  # a client needs an example, whatever min_size says
        raise ConfigError("partition.num_clients", f"{num_clients} clients, but the pool has {num_examples} examples")
    if num_examples < min_size * num_clients:
        raise ConfigError(
            "partition.num_clients",
            f"{num_clients} clients x min_size {min_size} needs {min_size * num_clients} examples, "
            f"the pool has {num_examples}",
        )


def _rejection_sample(
    draw: Callable[[], Optional[np.ndarray]], num_clients, min_size, max_retries, what, hint="increase alpha",
    key: str = "partition.alpha"
):
    """Redraw the whole partition until every client has >= min_size examples.

    ``draw`` returns a per-example owner array, or None for a degenerate draw (a class whose
    renormalized proportions vanished). One first draw plus up to ``max_retries`` redraws;
    ``key`` is the option the refusal names.
    """
    for _ in range(int(max_retries) + 1):
        owner = draw()
        if owner is not None and np.bincount(owner, minlength=num_clients).min() >= min_size:
            return _shards_from_owner(owner, num_clients)
    raise ConfigError(
        key,
        f"{what}: no draw in {int(max_retries) + 1} gave every one of {num_clients} clients "
        f">= {min_size} examples; {hint} or lower num_clients/min_size",
    )


def _dirichlet_draw(
    class_indices: Sequence[np.ndarray],
    concentrations: np.ndarray,
    rng: np.random.Generator,
    num_examples: int,
    caps: Optional[np.ndarray] = None,
    class_order: str = "ascending",
) -> Optional[np.ndarray]:
    """One sequential class-by-class Dirichlet assignment; returns owner[example] or None.

    For each class k (in ``class_order``): shuffle its indices, draw p ~ Dir(concentrations[k]),
    zero the entries of clients whose running count has reached ``caps`` and renormalize
    (Supp. A, the balancing step), then split contiguously at floor(N_k cumsum p) (Eq. 5).
    """
    num_clients = concentrations.shape[1]
    owner = np.empty(num_examples, dtype=np.int64)
    counts = np.zeros(num_clients, dtype=np.int64)
    order = np.arange(len(class_indices))
    if class_order == "random":
        order = rng.permutation(order)
    clients = np.arange(num_clients)
    for k in order:
        idx = rng.permutation(class_indices[k])
        p = rng.dirichlet(concentrations[k])
        if caps is not None:
            p = np.where(counts >= caps, 0.0, p)
            total = p.sum()
            if not total > 0:  # every open client drew exactly 0 (tiny alphas): redraw
                return None
            p = p / total
        sizes = _split_sizes(len(idx), p)
        owner[idx] = np.repeat(clients, sizes)
        counts += sizes
    return owner


# ----------------------------------------------------------------------------- partitioners


def iid_partition(num_examples: int, num_clients: int, seed: int) -> List[torch.Tensor]:
    """Shuffle all indices and cut them into ``num_clients`` contiguous, near-equal shares.

    The first ``num_examples % num_clients`` clients get one example more (``np.array_split``).
    """
    n, k = int(num_examples), int(num_clients)
    if k < 1:
        raise ConfigError("partition.num_clients", f"must be >= 1, got {num_clients}")
    if n < k:
        raise ConfigError("partition.num_clients", f"{k} clients but only {n} examples")
    perm = seeded_rng(seed, "partition/iid").permutation(n)
    return [torch.from_numpy(np.sort(s).astype(np.int64)) for s in np.array_split(perm, k)]


def dirichlet_partition(
    targets,
    num_clients: int,
    alpha: float,
    seed: int,
    min_size: int = 10,
    max_retries: int = DEFAULT_MAX_RETRIES,
    balance: bool = False,
) -> List[torch.Tensor]:
    """Standard label-skew Dirichlet partition (Hsu et al. 2019; FedML/NIID-Bench).

    For each class (ascending label), shuffle its indices, draw p ~ Dir(alpha 1_N) and split
    contiguously at floor(N_k cumsum p). The whole partition is redrawn while any client has
    fewer than ``min_size`` examples; after ``max_retries`` redraws a ConfigError names
    ``partition.alpha``. ``balance=True`` adds the FedML cap: clients that already hold
    >= n/N examples get no share of later classes (the gamma=0 case of Supp. A, Eq. 4-5).
    """
    y = _as_targets(targets)
    alpha = _check_positive(alpha, "partition.alpha")
    n, k = len(y), int(num_clients)
    if k < 1:
        raise ConfigError("partition.num_clients", f"must be >= 1, got {num_clients}")
    min_size = _check_min_size(min_size)
    _check_feasible(n, k, min_size)
    _, class_indices = _indices_by_class(y)
    conc = np.full((len(class_indices), k), min(alpha, MAX_CONCENTRATION))
    caps = np.full(k, n / k) if balance else None
    rng = seeded_rng(seed, "partition/dirichlet")
    draw = lambda: _dirichlet_draw(class_indices, conc, rng, n, caps)  # noqa: E731
    return _rejection_sample(draw, k, min_size, max_retries, f"dirichlet(alpha={alpha})")


def dirichlet_concentrations(weights_q, alpha_data: float, class_sizes) -> torch.Tensor:
    """c_{k,i} = alpha_data N_k q_i(gamma) as a float64 [K, N] tensor (Supp. A, Eq. 4).

    Each row sums to alpha_data N_k (Eq. 7) and its normalized mean is q (Eq. 6). A row whose
    largest entry would pass ``MAX_CONCENTRATION`` is scaled down to it (same mean; such a
    draw is its mean to float64 precision), so a huge alpha_data never overflows.
    """
    q = torch.as_tensor(weights_q, dtype=torch.float64).reshape(1, -1)
    n_k = torch.as_tensor(class_sizes, dtype=torch.float64).reshape(-1, 1)
    shape = n_k * q  # c / alpha_data
    scale = torch.clamp(MAX_CONCENTRATION / shape.amax(dim=1, keepdim=True), max=float(alpha_data))
    return scale * shape


def _normalized_weights(weights_q) -> np.ndarray:
    q = np.asarray(torch.as_tensor(weights_q, dtype=torch.float64).reshape(-1))
    if q.size == 0:
        raise ConfigError("partition.num_clients", "no allocation weights given")
    if not np.all(np.isfinite(q)) or np.any(q <= 0):
        raise ConfigError("partition.budgets", "allocation weights q_i must be finite and > 0")
    return q / q.sum()


def gamma_dirichlet_partition(
    targets,
    weights_q,
    alpha_data: float,
    seed: int,
    min_size: int = 10,
    max_retries: int = DEFAULT_MAX_RETRIES,
    class_order: str = "ascending",
) -> List[torch.Tensor]:
    """FEAST's budget-aware gamma-Dirichlet partition (Supp. A, Eq. 4-8).

    ``weights_q`` are q_i(gamma) from :func:`fl_lightning.data.budgets.allocation_weights`
    (Eq. 3; normalized here to sum 1); the number of clients is ``len(weights_q)``. For each
    class k in ``class_order`` ("ascending" label, or a fresh "random" order per draw):
    shuffle I_k; draw p~_k ~ Dir(c_{k,1..N}), c_{k,i} = alpha_data N_k q_i (Eq. 4); set
    p~_{k,i} = 0 for clients whose accumulated count has reached the balancing cap
    q_i N_train and renormalize; split I_k contiguously at t_{k,i} = floor(N_k sum_{j<=i} p_{k,j})
    for i < N, the last segment to the end (Eq. 5). N_train = len(targets). The complete
    partition is redrawn while any client has fewer than ``min_size`` examples.
    """
    y = _as_targets(targets)
    alpha_data = _check_positive(alpha_data, "partition.alpha")
    if class_order not in CLASS_ORDERS:
        raise ConfigError("partition.class_order", f"must be one of {CLASS_ORDERS}, got {class_order!r}")
    q = _normalized_weights(weights_q)
    n, k = len(y), len(q)
    min_size = _check_min_size(min_size)
    _check_feasible(n, k, min_size)
    _, class_indices = _indices_by_class(y)
    sizes = [len(c) for c in class_indices]
    conc = dirichlet_concentrations(q, alpha_data, sizes).numpy()
    caps = q * n
    rng = seeded_rng(seed, "partition/gamma_dirichlet")
    draw = lambda: _dirichlet_draw(class_indices, conc, rng, n, caps, class_order)  # noqa: E731
    hint = f"increase alpha, lower gamma, raise partition.budgets.b_min (smallest cap q_i*N_train is {q.min() * n:.1f})"
    # a client whose balancing cap is below min_size fills up before it reaches it: the budgets
    # (the poorest client's share) bind, not the concentration
    key = "partition.budgets.b_min" if q.min() * n < min_size else "partition.alpha"
    return _rejection_sample(draw, k, min_size, max_retries, f"gamma_dirichlet(alpha_data={alpha_data})", hint,
                             key=key)


def alpha_data_for(alpha_eff: float, n_train: int, num_classes: int, num_clients: int) -> float:
    """alpha_data giving a symmetric-equivalent alpha_eff = alpha_data N_train / (K N) (Eq. 8),
    at most ``MAX_CONCENTRATION`` (a huge alpha_eff is near-iid, not an overflow)."""
    _check_positive(alpha_eff, "partition.alpha_eff")
    return min(float(alpha_eff) * int(num_classes) * int(num_clients) / int(n_train), MAX_CONCENTRATION)


def alpha_eff_for(alpha_data: float, n_train: int, num_classes: int, num_clients: int) -> float:
    """alpha_eff = alpha_data N_train / (K N) for a balanced K-class pool (Eq. 8)."""
    return float(alpha_data) * int(n_train) / (int(num_classes) * int(num_clients))


class NaturalPartition(NamedTuple):
    """Clients built from natural groups; ``group_ids[j]`` is the group client j came from."""

    clients: List[torch.Tensor]
    group_ids: torch.Tensor


def natural_partition(
    groups: Sequence[Sequence[int]], num_clients: Optional[int] = None, seed: int = 0, min_size: int = 1
) -> NaturalPartition:
    """One client per natural group (e.g. a Shakespeare speaking role).

    Groups with fewer than ``min_size`` examples are not eligible (the default 1 drops only
    empty groups). With ``num_clients=None`` every eligible group becomes a client; otherwise
    ``num_clients`` eligible groups are sampled without replacement (seeded) and the examples
    of the other groups belong to no client. Clients are ordered by group id. Groups must be
    disjoint; indices are returned as given (sorted), so they live in the groups' index space.
    """
    min_size = _check_min_size(min_size)
    arrays = [np.asarray(g, dtype=np.int64).reshape(-1) for g in groups]
    if arrays:
        flat = np.concatenate(arrays)
        if len(np.unique(flat)) != len(flat):
            raise ConfigError("partition.groups", "natural groups overlap (an index is in two groups)")
    eligible = np.array([i for i, a in enumerate(arrays) if len(a) >= max(min_size, 1)], dtype=np.int64)
    if len(eligible) == 0:
        raise ConfigError("partition.groups", f"no group has >= {max(min_size, 1)} examples")
    if num_clients is None:
        chosen = eligible
    else:
        if int(num_clients) < 1 or int(num_clients) > len(eligible):
            raise ConfigError(
                "partition.num_clients",
                f"must be in 1..{len(eligible)} (eligible natural groups), got {num_clients}",
            )
        rng = seeded_rng(seed, "partition/natural")
        chosen = np.sort(rng.choice(eligible, size=int(num_clients), replace=False))
    clients = [torch.from_numpy(np.sort(arrays[g])) for g in chosen]
    return NaturalPartition(clients=clients, group_ids=torch.from_numpy(chosen))


# ----------------------------------------------------------------------------- dispatch


def validate_partition_params(
    method: str,
    num_examples: Optional[int],
    num_clients: Optional[int],
    alpha: Optional[float] = None,
    gamma: Optional[float] = None,
    min_size: int = 10,
    budgets=None,
    num_groups: Optional[int] = None,
    class_order: str = "ascending",
) -> None:
    """Cheap checks for the CLI, before any data is loaded or drawn; raises ConfigError.

    Checks: known method; num_clients >= 1 (may be None only for ``natural``); min_size >= 0;
    min_size * num_clients <= num_examples (not for ``natural``; skipped while ``num_examples`` is
    None, i.e. before the data are loaded); alpha > 0 for the Dirichlet
    methods; gamma >= 0 and len(budgets) == num_clients for ``gamma_dirichlet``; for
    ``natural`` with ``num_groups`` known, num_clients <= num_groups.
    """
    if method not in PARTITION_METHODS:
        raise ConfigError("partition.method", f"unknown method {method!r}; choose one of {PARTITION_METHODS}")
    min_size = _check_min_size(min_size)
    if num_clients is None:
        if method != "natural":
            raise ConfigError("partition.num_clients", f"required for method {method!r}")
    elif int(num_clients) != num_clients or int(num_clients) < 1:
        raise ConfigError("partition.num_clients", f"must be an integer >= 1, got {num_clients}")
    if method == "natural":
        if num_groups is not None and num_clients is not None and int(num_clients) > int(num_groups):
            raise ConfigError("partition.num_clients", f"{num_clients} clients but only {num_groups} natural groups")
        return
    if num_examples is not None:
        _check_feasible(int(num_examples), int(num_clients), min_size)
    if method in ("dirichlet", "gamma_dirichlet"):
        _check_positive(alpha, "partition.alpha")
    if method == "gamma_dirichlet":
        if gamma is None or not math.isfinite(float(gamma)) or float(gamma) < 0:
            raise ConfigError("partition.gamma", f"must be finite and >= 0, got {gamma}")
        if class_order not in CLASS_ORDERS:
            raise ConfigError("partition.class_order", f"must be one of {CLASS_ORDERS}, got {class_order!r}")
        if budgets is not None and len(budgets) != int(num_clients):
            raise ConfigError("partition.budgets", f"{len(budgets)} budgets for {num_clients} clients")


def _make_iid(targets, num_clients, seed, **_):
    return iid_partition(len(targets), num_clients, seed)


def _make_dirichlet(targets, num_clients, seed, alpha, min_size, max_retries, **_):
    return dirichlet_partition(targets, num_clients, alpha, seed, min_size=min_size, max_retries=max_retries)


def _make_natural(targets, num_clients, seed, groups, min_size, **_):
    if groups is None:
        raise ConfigError("partition.method", "'natural' needs a dataset with natural groups")
    part = natural_partition(groups, num_clients=num_clients, seed=seed, min_size=min_size)
    n = len(targets)
    if any(len(c) and (int(c.min()) < 0 or int(c.max()) >= n) for c in part.clients):
        raise ConfigError("partition.groups", f"group indices must lie in [0, {n})")
    return part.clients


def _make_gamma(targets, num_clients, seed, alpha, gamma, budgets, b_cap, min_size, max_retries, class_order, **_):
    if budgets is None:
        raise ConfigError("partition.budgets", "'gamma_dirichlet' needs client budgets (see zipf_budgets)")
    if len(budgets) != num_clients:
        raise ConfigError("partition.budgets", f"{len(budgets)} budgets for {num_clients} clients")
    q = allocation_weights(budgets, gamma, b_cap=b_cap)
    return gamma_dirichlet_partition(
        targets, q, alpha, seed, min_size=min_size, max_retries=max_retries, class_order=class_order
    )


PARTITIONERS: Dict[str, Callable[..., List[torch.Tensor]]] = {
    "iid": _make_iid,
    "dirichlet": _make_dirichlet,
    "natural": _make_natural,
    "gamma_dirichlet": _make_gamma,
}


def make_partition(
    method: str,
    targets,
    num_clients: Optional[int],
    seed: int,
    alpha: float = 0.5,
    gamma: float = 1.0,
    budgets=None,
    groups: Optional[Sequence[Sequence[int]]] = None,
    min_size: int = 10,
    b_cap: float = B_CAP,
    max_retries: int = DEFAULT_MAX_RETRIES,
    class_order: str = "ascending",
) -> List[torch.Tensor]:
    """Partition ``targets`` among clients by method name; one index tensor per client.

    - ``iid``: near-equal random shares.
    - ``dirichlet``: label skew, p ~ Dir(alpha 1_N) per class.
    - ``natural``: one client per group in ``groups`` (indices into ``targets``); groups with
      fewer than ``min_size`` examples are skipped; ``num_clients`` (or None for all) groups are
      used. Which groups: :func:`natural_partition` with the same arguments.
    - ``gamma_dirichlet``: FEAST Supp. A Eq. 3-8 with q = allocation_weights(budgets, gamma,
      b_cap); here ``alpha`` is alpha_data (see :func:`alpha_data_for`).
    """
    num_groups = None if groups is None else len(groups)
    validate_partition_params(
        method, len(targets), num_clients, alpha=alpha, gamma=gamma, min_size=min_size,
        budgets=budgets, num_groups=num_groups, class_order=class_order,
    )
    return PARTITIONERS[method](
        targets=targets, num_clients=num_clients, seed=seed, alpha=alpha, gamma=gamma, budgets=budgets,
        groups=groups, min_size=min_size, b_cap=b_cap, max_retries=max_retries, class_order=class_order,
    )


__all__ = [
    "CLASS_ORDERS",
    "DEFAULT_MAX_RETRIES",
    "NaturalPartition",
    "PARTITIONERS",
    "PARTITION_METHODS",
    "alpha_data_for",
    "alpha_eff_for",
    "dirichlet_concentrations",
    "dirichlet_partition",
    "gamma_dirichlet_partition",
    "iid_partition",
    "make_partition",
    "natural_partition",
    "validate_partition_params",
]
