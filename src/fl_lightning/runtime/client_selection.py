"""Which clients take part in a round: a part of every method (``Algorithm.selector``).

The default, :class:`UniformSelection`, draws ``clients_per_round`` of the clients uniformly
without replacement from (seed, round) alone, so every rank and a resumed run draw the same
cohort. A method that selects otherwise (by availability, by utility, by label coverage)
replaces ``self.selector`` in ``prepare`` with an object that has ``cohort(round_idx)``, and
keeps it (``Algorithm.keep``) when its choices depend on what earlier rounds learned.
"""

from __future__ import annotations

from typing import List

from fl_lightning.runtime.seeding import sample_clients


class UniformSelection:
    """``per_round`` of ``num_clients`` uniformly without replacement each round, sorted
    (McMahan et al.'s FedAvg, and every paper of this project's)."""

    def __init__(self, seed: int, num_clients: int, per_round: int):
        self.seed, self.num_clients, self.per_round = seed, num_clients, per_round

    def cohort(self, round_idx: int) -> List[int]:
        return sample_clients(self.seed, round_idx, self.num_clients, self.per_round)


__all__ = ["UniformSelection"]
