"""Random generators keyed by a purpose: the draws a run makes once from its seed (client
budgets, partitions, server-held splits, capacity caps), each independent of the others."""

from __future__ import annotations

import zlib

import numpy as np


def seeded_rng(seed: int, purpose: str) -> np.random.Generator:
    """A numpy Generator that depends only on ``(seed, purpose)``.

    Mixing a purpose tag into the seed keeps the budget draw, the partition and the server
    splits statistically independent even when one run seed feeds all of them.
    """
    tag = zlib.crc32(purpose.encode("utf-8"))
    return np.random.default_rng(np.random.SeedSequence([int(seed) % 2**63, tag]))
