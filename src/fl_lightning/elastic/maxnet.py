"""MaxNet aggregation (SuperFedNAS, Khare et al. 2024), as SuperFedNAS's and DeepFedNAS's code compute it.

MaxNet gives one client of the cohort, the one that trains the largest subnet that round (the
"max role", see ``algorithms/supernet/fednas.py``), the aggregation weight ``c(t)``, and every other
client ``(1 - c(t)) / (K - 1)``. The weights are then applied *position by position*: every
global position ``u`` becomes the weighted mean over the clients whose subnet covers ``u``,

    theta[u] <- sum_{i covers u} w_i theta_i[u] / sum_{i covers u} w_i,

and a position that no client covers keeps its value. This is the "overlap-aware" part: the
normaliser is the sum of the weights of the clients that overlap at ``u``, not the sum over
the cohort. It is :class:`~fl_lightning.elastic.aggregation.SparseAccumulator` with the MaxNet
weights in place of the sample counts (the originals' ``_aggregate`` / ``add_subnet``: a sum
and a count tensor per key, ``sum / count`` where ``count > 0``, the old value elsewhere).

``c(t)`` is the originals' ``maxnet_cos_all_subnet`` schedule:

    c(t) = init * ((1 - a) * 0.5 * (1 + cos(pi * min(t, T) / T)) + a),   a = final / init,

i.e. ``final + (init - final) * 0.5 * (1 + cos(pi * min(t, T) / T))``: ``init`` at round 0,
``final`` from round ``T`` on. See docs/fednas_transfers.md for sources and uncertain points.
"""

from __future__ import annotations

import math
from typing import List, Optional

MAXNET_INIT, MAXNET_FINAL = 0.9, 0.125
"""FEAST Supp. E.2 and DeepFedNAS's CIFAR-100 scripts (``"init": 0.9, "final": 0.125``)."""


def maxnet_coefficient(round_idx: int, num_steps: int, init: float = MAXNET_INIT,
                       final: float = MAXNET_FINAL) -> float:
    """``c(t)``: the max-role client's weight in round ``round_idx`` (cosine from ``init`` at
    round 0 to ``final`` at round ``num_steps``, constant afterwards)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if not (0 < init <= 1 and 0 < final <= 1):
        raise ValueError(f"init and final must be in (0, 1], got {init}, {final}")
    t = min(max(int(round_idx), 0), int(num_steps))
    alpha = final / init
    cos_decay = 0.5 * (1.0 + math.cos(math.pi * t / num_steps))
    return init * ((1.0 - alpha) * cos_decay + alpha)


def maxnet_weights(num_clients: int, max_position: Optional[int], coefficient: float) -> List[float]:
    """The cohort's aggregation weights in plan order: ``coefficient`` for the client at
    ``max_position`` and ``(1 - coefficient) / (K - 1)`` for each of the others (the originals'
    ``top_k_maxnet = 1``). A cohort of one gets ``[coefficient]``; without a max-role client
    (``None``) every client gets ``1 / K``."""
    if num_clients < 1:
        raise ValueError("a cohort needs at least one client")
    if max_position is None:
        return [1.0 / num_clients] * num_clients
    if not 0 <= max_position < num_clients:
        raise ValueError(f"max_position {max_position} outside a cohort of {num_clients}")
    other = (1.0 - coefficient) / (num_clients - 1) if num_clients > 1 else 0.0
    return [coefficient if i == max_position else other for i in range(num_clients)]
