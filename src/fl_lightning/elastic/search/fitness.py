"""Training-free fitness ``F(a)`` and effectiveness ``rho(a)`` of an OFAResNet architecture.

FEAST (Supp. Eq. 10) selects each cached variant as ``argmax F(a)`` subject to
``MAC(a) <= B`` and ``rho(a) <= rho_0`` and takes ``F`` and ``rho`` from DeepFedNAS without
stating them. This module is a *reconstruction*: DeepMAD's network entropy and effectiveness
(Shen et al., CVPR 2023) with the extra terms of DeepFedNAS's public fitness code, written for
this supernet. See docs/variant_cache.md for the reasoning.

Every convolution ``i`` has a DeepMAD width ``w_i = c_in,i * k_i^2`` (input channels times
kernel area; no grouped convs here). With ``S_l = sum_{i in stage l} log w_i``:

- stage entropy ``H_l = log(h_l * w_l * c_l) * S_l`` (``h_l x w_l``: the stage's output
  resolution, ``c_l``: its output channels);
- effectiveness ``rho = L / exp(mean_i log w_i)``: ``L`` convs (stem included) over their
  geometric-mean width; small ``rho`` = wide and shallow, large = deep and narrow;
- fitness ``F = sum_l alpha_l H_l - beta * exp(Var_l(1 + d_l)) + lambda * rho
  - gamma * sum_l max(0, c_l - c_{l+1})``: multi-scale entropy, a depth-uniformity penalty,
  a reward for using the effectiveness allowance, and a penalty for stages narrower than
  their predecessor.

Which convs a block contributes is :attr:`FitnessConfig.layers`:

- ``"deepfednas"`` (default): DeepFedNAS's accounting, written for its block of two 3x3
  convs and applied to this space's ``(d, e, w)`` unchanged, as FEAST reuses that procedure:
  widths ``9 c_in`` and ``9 mid``, plus the projection's ``c_in`` in a stage's first block.
  The caches it gives reproduce FEAST's published parameter footprints (docs/variant_cache.md);
- ``"bottleneck"``: this model's own convs: 1x1 reduce (``c_in``), 3x3 (``9 mid``), 1x1
  expand (``mid``), and the 1x1 projection (``c_in``) in a stage's first block.

Everything is vectorized over genome batches with tables built once per cost model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

from fl_lightning.elastic.models.ofa_resnet import OFASpec
from fl_lightning.elastic.search.cost import CostModel

LAYER_ACCOUNTINGS = ("deepfednas", "bottleneck")


@dataclass(frozen=True)
class FitnessConfig:
    """Terms of the fitness (weights default to DeepFedNAS's public cache generator)."""

    alpha: Optional[Sequence[float]] = None
    """Per-stage entropy weights ``alpha_l``; None = 1 for every stage."""
    depth_penalty: float = 10.0
    """``beta``: weight of ``exp(Var(1 + d_l))``, which keeps stage depths uniform."""
    effectiveness_weight: float = 1000.0
    """``lambda``: reward per unit of ``rho``; pushes toward the ``rho_0`` ceiling."""
    channel_penalty: float = 1.0
    """``gamma``: cost per channel by which a stage is narrower than the stage before it."""
    layers: str = "deepfednas"
    """Which convs enter the entropy and ``rho``: ``deepfednas`` or ``bottleneck`` (above)."""

    def to_dict(self) -> dict:
        out = asdict(self)
        out["alpha"] = None if self.alpha is None else list(self.alpha)
        return out


class Fitness:
    """``F`` and ``rho`` for genome batches of one cost model (:class:`OFACostModel`, or
    :class:`DeepFedNASCostModel` whose blocks are DeepFedNAS's, so only the ``deepfednas``
    accounting applies; its block-layout genomes, one expansion per block, are handled too)."""

    def __init__(self, cost: CostModel, config: FitnessConfig = FitnessConfig()):
        self.cost = cost
        self.config = config
        S = cost.num_stages
        alpha = config.alpha if config.alpha is not None else (1.0,) * S
        if len(alpha) != S:
            raise ValueError(f"alpha needs {S} stage weights, got {len(alpha)}")
        if config.layers not in LAYER_ACCOUNTINGS:
            raise ValueError(f"layers must be one of {LAYER_ACCOUNTINGS}, got {config.layers!r}")
        if config.layers not in cost.layer_accountings:
            raise ValueError(f"layers={config.layers!r} does not apply to {type(cost).__name__} "
                             f"(use one of {cost.layer_accountings})")
        self.alpha = np.asarray(alpha, dtype=np.float64)
        k2, log = 9.0, np.log
        self._stem_log_width = log(cost.in_channels * k2)
        # Convs in a stage's first block and in each later one.
        self._counts = (4, 3) if config.layers == "bottleneck" else (3, 2)
        self._first, self._other, self._volume = [], [], []
        for l in range(S):
            c_in = (cost.stem_channels if l == 0 else cost.out_channels[l - 1]).astype(np.float64)
            out = cost.out_channels[l].astype(np.float64)
            mid = cost.mid_channels[l].astype(np.float64)  # (w, e)
            if config.layers == "bottleneck":
                # Later blocks: 1x1 from the stage width, 3x3 and 1x1 from the middle width;
                # the first block's 1x1 reduce and projection both read the stage input.
                other = log(out)[:, None] + log(k2 * mid) + log(mid)
                first = 2 * log(c_in)[:, None, None] + (log(k2 * mid) + log(mid))[None]
            else:
                other = log(k2 * out)[:, None] + log(k2 * mid)
                first = (log(k2 * c_in) + log(c_in))[:, None, None] + log(k2 * mid)[None]
            self._first.append(first)  # (w_in, w_out, e)
            self._other.append(other)  # (w_out, e)
            h, w = cost.stage_out_hw[l]
            self._volume.append(log(h * w * out))  # (w_out,)

    # -- components -------------------------------------------------------------------------
    def _stage_logs(self, genes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-stage ``S_l`` and conv counts, both (n, S)."""
        d, e, w = self.cost.split(genes)
        sums = np.empty(d.shape, dtype=np.float64)
        if self.cost.expansion_per == "stage":
            for l in range(self.cost.num_stages):
                sums[:, l] = (self._first[l][w[:, l], w[:, l + 1], e[:, l]]
                              + d[:, l] * self._other[l][w[:, l + 1], e[:, l]])
        else:  # one expansion per block slot; slots beyond the stage's depth are inactive
            for l, slots in enumerate(self.cost.block_expansions(genes)):
                sums[:, l] = self._first[l][w[:, l], w[:, l + 1], slots[:, 0]]
                for b in range(1, slots.shape[1]):
                    sums[:, l] += (d[:, l] >= b) * self._other[l][w[:, l + 1], slots[:, b]]
        first, other = self._counts
        return sums, first + other * d

    def _rho(self, sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
        layers = 1 + counts.sum(axis=1)
        return layers * np.exp(-(self._stem_log_width + sums.sum(axis=1)) / layers)

    def _entropy(self, genes: np.ndarray, sums: np.ndarray) -> np.ndarray:
        w = self.cost.split(genes)[2]
        volume = np.stack([self._volume[l][w[:, l + 1]] for l in range(self.cost.num_stages)], axis=1)
        return (volume * sums) @ self.alpha

    def entropy(self, genes: np.ndarray) -> np.ndarray:
        """Multi-scale entropy ``sum_l alpha_l H_l`` of each genome row."""
        genes = _rows(genes)
        return self._entropy(genes, self._stage_logs(genes)[0])

    def rho(self, genes: np.ndarray) -> np.ndarray:
        """Effectiveness ``L / exp(mean log width)`` (stem included) of each genome row."""
        return self._rho(*self._stage_logs(_rows(genes)))

    def evaluate(self, genes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(F, rho)`` of each genome row."""
        genes = _rows(genes)
        cost, cfg = self.cost, self.config
        d, _, w = cost.split(genes)
        sums, counts = self._stage_logs(genes)
        rho = self._rho(sums, counts)
        depth = cfg.depth_penalty * np.exp(np.var(1 + d, axis=1))
        channels = np.stack([cost.out_channels[l][w[:, l + 1]] for l in range(cost.num_stages)], axis=1)
        shrink = np.clip(channels[:, :-1] - channels[:, 1:], 0, None).sum(axis=1)
        fitness = (self._entropy(genes, sums) - depth + cfg.effectiveness_weight * rho
                   - cfg.channel_penalty * shrink)
        return fitness, rho

    # -- single specs -----------------------------------------------------------------------
    def spec_fitness(self, spec: OFASpec) -> float:
        return float(self.evaluate(self.cost.encode(spec))[0][0])

    def spec_rho(self, spec: OFASpec) -> float:
        return float(self.rho(self.cost.encode(spec))[0])


def _rows(genes: np.ndarray) -> np.ndarray:
    return np.atleast_2d(np.asarray(genes, dtype=np.int64))
