"""HAS-FL (Algorithm 1 of ``papers/hasfl-capacity-confounds-coverage.md``): widths from update
divergence, with the coverage guarantee."""

from __future__ import annotations

from typing import Dict, Literal

import torch

from fl_lightning.algorithms.submodel.base import SubmodelAlgorithm
from fl_lightning.runtime.kept_state import KeptAttributes
from fl_lightning.option_types import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    UnitFraction,
    number_type,
)


class HASFL(SubmodelAlgorithm):
    """HAS-FL (Algorithm 1): allocation by normalised update divergence, with coverage guarantee.

    - Estimate, for each client trained this round (parameters only):
      ``H_hat = ||m * (D_i - D_bar)||^2 / (||m * D_bar||^2 + eps)`` with ``D_i`` the client's
      update, ``D_bar`` the coordinate-wise aggregate's change, ``m`` the client's coordinates.
    - EMA ``H_tilde <- beta H_tilde + (1 - beta) H_hat`` for the clients trained,
      ``H_tilde(0) = 1``; every ``t_norm`` rounds all estimates are rescaled to unit mean.
      With ``ema: adapt`` (the paper's Algorithm 1, lines 20-31) the EMA takes only the
      estimates of the rounds that end an adaptation step; ``ema: round`` takes every round's.
    - Widths: ``p_max`` for the first ``t_warm`` rounds; then, recomputed every ``t_adapt``
      rounds, ``p = min(p_max, p_min + gamma H_tilde / (H_bar + eps))`` with ``H_bar`` the mean
      over all clients; with ``coverage``, clients whose cap is the federation's largest get it.

    An adaptation step ends the completed round ``done`` (1-based count) when
    ``done >= t_warm`` and ``(done - t_warm) % t_adapt == 0``; the new widths apply from the
    next round on.
    """

    def __init__(self, p_min: UnitFraction = 0.4, gamma: NonNegativeFloat = 0.25,
                 beta: number_type(float, ge=0, lt=1) = 0.9, t_warm: NonNegativeInt = 10,
                 t_adapt: PositiveInt = 5, t_norm: PositiveInt = 20, coverage: bool = True, eps: PositiveFloat = 1e-8,
                 ema: Literal["adapt", "round"] = "adapt", **kwargs):
        """
        Args:
            p_min: base width of the allocation rule.
            gamma: sensitivity to the relative heterogeneity estimate.
            beta: EMA factor of the estimates.
            t_warm: warm-up rounds at the caps.
            t_adapt: rounds between allocation updates after the warm-up.
            t_norm: rounds between rescalings of the estimates to unit mean.
            coverage: the coverage guarantee (clients with the largest cap train at it).
            eps: stabiliser of the ratios.
            ema: when the estimates enter the moving average: adapt (only in the rounds that
                end an adaptation step, after the warm-up: the paper's Algorithm 1, where the
                estimate and its EMA sit inside the every-t_adapt block) or round (every round,
                warm-up included: about t_adapt times more updates, so H_tilde follows recent
                rounds more closely and drifts further between rescalings).
        """
        super().__init__(**kwargs)
        self.p_min, self.gamma, self.beta = float(p_min), float(gamma), float(beta)
        self.t_warm, self.t_adapt, self.t_norm = int(t_warm), int(t_adapt), int(t_norm)
        self.coverage, self.eps, self.ema = bool(coverage), float(eps), ema

    def prepare(self, ctx):
        super().prepare(ctx)
        n = ctx.num_clients
        self.h_tilde = torch.ones(n, dtype=torch.float64)
        # Warm-up at the caps; without one, the rule applies from the first round (H_tilde = 1).
        self.widths = self.caps.clone() if self.t_warm > 0 else self.allocate()
        self.keep(KeptAttributes(self, {"h_tilde": "h_tilde", "widths": "widths"}, torch.float64))

    # -- allocation rule --------------------------------------------------------------------
    def allocate(self) -> torch.Tensor:
        return allocation_rule(self.h_tilde, self.caps, self.p_min, self.gamma, self.coverage, self.eps)

    def widths_for(self, round_idx, cohort):
        return {c: float(self.widths[c]) for c in cohort}

    def adapts_after(self, done: int) -> bool:
        """Whether the round that completes ``done`` rounds ends an adaptation step."""
        return done >= self.t_warm and (done - self.t_warm) % self.t_adapt == 0

    # -- estimation -------------------------------------------------------------------------
    def new_accumulator(self, plan):
        """Besides the model: each committed client's update on its own coordinates stays on
        its rank until the aggregate D_bar is known; then the owners' H_hat, one vector summed
        over ranks (a late sum), makes the estimates identical everywhere."""
        acc = super().new_accumulator(plan)
        acc.after_reduce(self.estimates)
        return acc

    def commit(self, acc, task, result, plan):
        super().commit(acc, task, result, plan)
        local = result.model.module.state_dict()
        delta = {}
        for local_key, (global_key, region) in result.model.regions.items():
            if global_key in self.ever:
                old = region.gather(self.global_state[global_key]).to(torch.float64)
                delta[global_key] = (local[local_key].detach().to(torch.float64) - old, region)
        acc.hold("delta", task.client, delta)

    def estimates(self, acc) -> Dict[str, torch.Tensor]:
        """H_hat of the clients this rank committed (zeros for the others), and which they are;
        the global state is still the round's old one."""
        h_hat = torch.zeros(self.ctx.num_clients, dtype=torch.float64)
        trained = torch.zeros(self.ctx.num_clients, dtype=torch.float64)
        new_state = acc.result()
        for client, delta in acc.held.get("delta", {}).items():
            h_hat[client] = update_divergence(delta, new_state, self.global_state, self.eps)
            trained[client] = 1.0
        device = self.ctx.fabric.device
        return {"h_hat": h_hat.to(device), "trained": trained.to(device)}

    def finish_round(self, acc, plan):
        h_hat, trained = acc["h_hat"].cpu(), acc["trained"].cpu() > 0
        figures = super().finish_round(acc, plan)
        done = plan.round_idx + 1  # rounds completed
        adapting = self.adapts_after(done)
        if adapting or self.ema == "round":
            self.h_tilde = torch.where(trained, self.beta * self.h_tilde + (1 - self.beta) * h_hat, self.h_tilde)
        if done % self.t_norm == 0:
            self.h_tilde = self.h_tilde / self.h_tilde.mean().clamp_min(self.eps)
        if adapting:
            self.widths = self.allocate()
        figures["H_bar"] = float(self.h_tilde.mean())
        for task in plan.tasks:
            c = task.client
            figures[f"H_hat/{c}"] = float(h_hat[c])
        for c in range(self.ctx.num_clients):
            figures[f"H_tilde/{c}"] = float(self.h_tilde[c])
            figures[f"p/{c}"] = float(self.widths[c])
        return figures



def allocation_rule(h_tilde: torch.Tensor, caps: torch.Tensor, p_min: float, gamma: float,
                    coverage: bool, eps: float = 1e-8) -> torch.Tensor:
    """Eq. (6) and the coverage guarantee: ``min(p_max, p_min + gamma H / (H_bar + eps))``;
    with ``coverage``, clients whose cap equals the largest cap get their cap."""
    h_tilde, caps = h_tilde.to(torch.float64), caps.to(torch.float64)
    p = torch.minimum(caps, p_min + gamma * h_tilde / (h_tilde.mean() + eps))
    if coverage:
        top = caps == caps.max()
        p = torch.where(top, caps, p)
    return p


def update_divergence(delta: Dict[str, tuple], new_state, old_state, eps: float = 1e-8) -> float:
    """``||m (D_i - D_bar)||^2 / (||m D_bar||^2 + eps)`` over the client's coordinates ``m``.

    ``delta`` maps global keys to (the client's update on its region, the region); the
    aggregate's change ``D_bar = new - old`` is read on the same region only.
    """
    num = den = 0.0
    for key, (d_i, region) in delta.items():
        d_bar = region.gather(new_state[key]).to(torch.float64) - region.gather(old_state[key]).to(torch.float64)
        num += float((d_i - d_bar).pow(2).sum())
        den += float(d_bar.pow(2).sum())
    return num / (den + eps)
