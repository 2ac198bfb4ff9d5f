"""Server-held splits (validation, BN calibration) carved out of the training pool.

FEAST (Supp. E.1) keeps e.g. 4,500 validation and 500 BN-calibration examples of CIFAR-100's
training set on the server and partitions the remaining 45,000 among clients. The carving
happens before partitioning:

    pool, val, calib = carve_server_splits(targets, 4500, 500, seed)
    local = make_partition(method, targets[pool], num_clients, seed, ...)   # indices into pool
    clients = to_dataset_indices(local, pool)                               # indices into dataset
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np
import torch

from fl_lightning.errors import ConfigError
from fl_lightning.seeds import seeded_rng


def _largest_remainder(total: int, weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Integers proportional to integer ``weights`` that sum to ``total`` (Hamilton's method).

    Each share is floor(total w_k / sum w); the leftover units go to the largest fractional
    remainders, ties broken by a seeded random order so no class id is systematically favoured.
    Shares never exceed the weight when weights are counts and total <= sum(weights).
    """
    weights = np.asarray(weights, dtype=np.int64)
    denom = int(weights.sum())
    if total == 0 or denom == 0:
        return np.zeros(len(weights), dtype=np.int64)
    # exact integer arithmetic: floor and remainder of total * w_k / sum(w)
    base, remainder = np.divmod(int(total) * weights, denom)
    tie_break = rng.permutation(len(weights))
    order = np.lexsort((tie_break, -remainder))  # largest remainder first, then random
    base[order[: total - int(base.sum())]] += 1
    return base


def _check_size(value, key: str, n: int) -> int:
    if int(value) != value or value < 0:
        raise ConfigError(key, f"must be an integer >= 0, got {value}")
    if value > n:
        raise ConfigError(key, f"{value} exceeds the {n} training examples")
    return int(value)


def carve_server_splits(
    targets, val_size: int, calib_size: int, seed: int, stratified: bool = True
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split dataset indices into (client_pool, val, calib), disjoint, union = all, each sorted.

    Stratified (default): validation takes v_k examples of class k with v proportional to the
    class sizes N_k (largest remainder, so sum v_k = val_size exactly); calibration then takes
    c_k proportional to the remaining N_k - v_k (same rounding), so neither can exceed a class.
    Within a class the examples are a seeded random choice. Balanced data gives exactly
    val_size/K and calib_size/K per class when those divide. Unstratified: one seeded shuffle,
    the first val_size go to validation, the next calib_size to calibration.
    """
    y = np.asarray(targets.cpu() if isinstance(targets, torch.Tensor) else targets).reshape(-1)
    n = len(y)
    val_size = _check_size(val_size, "data.val_size", n)
    calib_size = _check_size(calib_size, "data.calib_size", n)
    if val_size + calib_size > n:
        raise ConfigError("data.calib_size", f"val_size + calib_size = {val_size + calib_size} exceeds {n} examples")
    rng = seeded_rng(seed, "splits")
    if not stratified:
        perm = rng.permutation(n)
        val, calib, pool = np.split(perm, [val_size, val_size + calib_size])
    else:
        order = np.argsort(y, kind="stable")
        _, starts, counts = np.unique(y[order], return_index=True, return_counts=True)
        per_class = [rng.permutation(c) for c in np.split(order, starts[1:])]
        v = _largest_remainder(val_size, counts, rng)
        c = _largest_remainder(calib_size, counts - v, rng)
        val = np.concatenate([idx[:vk] for idx, vk in zip(per_class, v)])
        calib = np.concatenate([idx[vk : vk + ck] for idx, vk, ck in zip(per_class, v, c)])
        pool = np.concatenate([idx[vk + ck :] for idx, vk, ck in zip(per_class, v, c)])
    as_tensor = lambda a: torch.from_numpy(np.sort(a).astype(np.int64))  # noqa: E731
    return as_tensor(pool), as_tensor(val), as_tensor(calib)


def to_dataset_indices(client_indices: Sequence[torch.Tensor], pool_idx: torch.Tensor) -> List[torch.Tensor]:
    """Map a partition of ``targets[pool_idx]`` (positions in the pool) back to dataset indices."""
    pool_idx = torch.as_tensor(pool_idx, dtype=torch.long)
    return [pool_idx[torch.as_tensor(c, dtype=torch.long)] for c in client_indices]


def groups_to_pool(groups: Sequence[Sequence[int]], pool_idx: torch.Tensor) -> List[torch.Tensor]:
    """Re-express natural groups of dataset indices as positions in the client pool.

    Examples that were carved out for the server are dropped from their group, so a group can
    shrink or become empty (``natural_partition`` skips groups below its ``min_size``).
    """
    pool = np.asarray(torch.as_tensor(pool_idx, dtype=torch.long)).reshape(-1)
    sorter = np.argsort(pool, kind="stable")
    sorted_pool = pool[sorter]
    result = []
    for g in groups:
        g = np.asarray(g, dtype=np.int64).reshape(-1)
        at = np.minimum(np.searchsorted(sorted_pool, g), max(len(pool) - 1, 0))
        keep = sorted_pool[at] == g if len(pool) else np.zeros(len(g), dtype=bool)
        result.append(torch.from_numpy(np.sort(sorter[at[keep]]).astype(np.int64)))
    return result


def label_matched_shards(split_targets, client_targets: Sequence[torch.Tensor], seed: int) -> List[torch.Tensor]:
    """Share a split's examples among clients so that each client's share has its training mix.

    The examples of class k (a seeded random order) go to the clients in proportion to how many
    examples of class k each holds for training (largest remainder, so every example of a class
    some client holds is given out); a class no client holds is given to none. This is how
    personalized methods are scored on "the client's own test data" (FedBABU, FedGH, FedAS).
    Returns positions in ``split_targets``, one sorted tensor per client (possibly empty).
    """
    y = np.asarray(torch.as_tensor(split_targets).cpu()).reshape(-1)
    num_classes = int(max([y.max(initial=-1)] + [int(t.max()) for t in client_targets if len(t)])) + 1
    held = np.stack([np.bincount(np.asarray(t.cpu()).reshape(-1), minlength=num_classes) for t in client_targets])
    rng = seeded_rng(seed, "client_eval_shards")
    shares: List[List[np.ndarray]] = [[] for _ in client_targets]
    for k in range(num_classes):
        examples = np.flatnonzero(y == k)
        if len(examples) == 0 or held[:, k].sum() == 0:
            continue
        examples = examples[rng.permutation(len(examples))]
        counts = _largest_remainder(len(examples), held[:, k], rng)
        for client, part in enumerate(np.split(examples, np.cumsum(counts)[:-1])):
            shares[client].append(part)
    return [torch.from_numpy(np.sort(np.concatenate(s)).astype(np.int64)) if s else torch.zeros(0, dtype=torch.long)
            for s in shares]


__all__ = ["carve_server_splits", "groups_to_pool", "label_matched_shards", "to_dataset_indices"]
