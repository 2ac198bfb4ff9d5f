"""Randomness keyed by (seed, round, client), so results never depend on rank layout."""

from __future__ import annotations

import numpy as np
import torch


def derive_seed(*keys: int) -> int:
    """A 63-bit seed that is a pure function of the integer keys."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, dtype=np.uint64)[0] >> 1)


# Stream tags keep the server's draws and each client's draws independent of one another.
SAMPLING, CLIENT = 1, 2


def sample_clients(seed: int, round_idx: int, num_clients: int, per_round: int) -> list[int]:
    """The round's cohort: ``per_round`` of ``num_clients`` uniformly without replacement, sorted."""
    generator = torch.Generator().manual_seed(derive_seed(seed, SAMPLING, round_idx))
    return sorted(torch.randperm(num_clients, generator=generator)[:per_round].tolist())


def client_generator(seed: int, round_idx: int, client: int) -> torch.Generator:
    """A fresh generator for one client's local work in one round (shuffling, sampling)."""
    return torch.Generator().manual_seed(derive_seed(seed, CLIENT, round_idx, client))


def seed_client(seed: int, round_idx: int, client: int) -> None:
    """Seed torch's global RNGs (dropout, per-example augmentation) for one client's round."""
    torch.manual_seed(derive_seed(seed, CLIENT, round_idx, client))


def shard_for_rank(items: list, rank: int, world_size: int) -> list:
    """The contiguous share of a round's clients that one rank trains."""
    per, extra = divmod(len(items), world_size)
    start = rank * per + min(rank, extra)
    return items[start:start + per + (1 if rank < extra else 0)]


def balanced_share(items: list, work: list, rank: int, world_size: int) -> list:
    """One rank's share of a round's clients, the estimated ``work`` of each balanced over
    ranks (longest first, each to the least-loaded rank, ties to the lower rank and the
    earlier item), kept in plan order. A pure function of its arguments, so every rank
    derives the same split; which rank trains a client never changes what it computes."""
    loads = [0.0] * world_size
    owner = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: (-float(work[i]), i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += float(work[i])
    return [item for item, r in zip(items, owner) if r == rank]
