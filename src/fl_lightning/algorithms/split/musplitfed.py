"""MU-SplitFed (Liang et al., NeurIPS 2025): SplitFed with unbalanced server updates.

For every batch a client sends, the server half takes ``tau`` steps on the same activations
while the client half takes one, so the server's progress per client round is ``tau`` times
SplitFed's (the straggler-resilience mechanism). The rest is SplitFed (V1 by default: a server
copy per client, averaged with the fronts; V2 available). ``modules/split_variants.py`` holds
the training pass; docs/sfl_baselines.md the rules, options and departures.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

from fl_lightning.algorithms.split.splitfed import SplitFed
from fl_lightning.option_types import PositiveFloat, PositiveInt
from fl_lightning.runtime.seeding import derive_seed

ZO_STREAM = 42  # seed stream of MU-SplitFed's zeroth-order directions


class MUSplitFed(SplitFed):
    """SplitFed whose server half takes ``tau`` steps per client step."""

    def __init__(self, cut: Optional[str] = None, tau: PositiveInt = 2,
                 feedback_at: Literal["start", "last_step", "end"] = "end",
                 estimator: Literal["fo", "zo"] = "fo", zo_smoothing: PositiveFloat = 1e-3,
                 version: Literal["v1", "v2"] = "v1", server_lr: Optional[PositiveFloat] = None, **kwargs):
        """
        Args:
            cut: block name after which the model is split (None: the middle block boundary).
            tau: server steps per received activation batch (the client takes one); 1 with
                feedback_at=start is SplitFed.
            feedback_at: the server state the client's feedback comes from: start (before the
                server's tau steps), last_step (the tau-th step's gradient) or end (after the tau
                steps, one extra server forward and backward).
            estimator: fo (first order: the gradient at the cut goes down) or zo (the original's
                two-point zeroth-order estimator on both halves; lower train.lr accordingly).
            zo_smoothing: the zeroth-order perturbation scale lambda.
            version: v1 (a server copy per client, averaged) or v2 (one server half trained
                client by client).
            server_lr: learning rate of the server half (None: the clients' round rate).
            **kwargs: SplitFed's served-statistics options (``bn``, ...).
        """
        super().__init__(cut=cut, version=version, server_lr=server_lr, **kwargs)
        self.tau = tau
        self.feedback_at = feedback_at
        self.estimator = estimator
        self.zo_smoothing = zo_smoothing

    def train_pass(self, client, pair):
        """``tau`` server steps per client batch (``modules/split_variants.py``): first order as a
        server rule, zeroth order as a step of its own."""
        from fl_lightning.modules.split import split_step, train_split
        from fl_lightning.modules.split_variants import unbalanced, zeroth_order_step

        r = client.round
        if self.estimator == "zo":
            generator = torch.Generator().manual_seed(derive_seed(r.seed, ZO_STREAM, r.round_idx, r.task.client))
            step = zeroth_order_step(pair, self.tau, self.feedback_at, self.zo_smoothing, generator)
        else:
            step = split_step(pair, unbalanced(self.tau, self.feedback_at))
        fit = train_split(r.fabric, step, r.shard, r.train, r.generator())
        fit.extras["server_steps"] = fit.steps * self.tau
        return fit
