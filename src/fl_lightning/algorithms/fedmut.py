"""FedMut (Hu et al., AAAI 2024): each client starts its round from a stochastic mutation of
the global model along the last global update; the returned models are averaged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from fl_lightning.algorithms.fedavg import FedAvg, Weighting
from fl_lightning.elastic.routing import Routed, load_routed_state
from fl_lightning.option_types import NonNegativeFloat, PositiveInt, number_type
from fl_lightning.runtime.kept_state import KeptTensors
from fl_lightning.runtime.seeding import derive_seed

MUTATION_STREAM = 31  # seed stream of the mutation signs (one draw per round)


def balanced_signs(generator: torch.Generator, cohort_size: int, num_layers: int,
                   negative: float = -1.0) -> torch.Tensor:
    """``[cohort_size, num_layers]`` mutation weights v: in every layer (column), half of the
    mutated clients get +1 and the other half ``negative`` (-1 for the balanced mutation), in
    a random order drawn per layer; with an odd cohort one client, drawn once per round, is
    not mutated (0 in every layer), as the original leaves the odd client out."""
    signs = torch.zeros(cohort_size, num_layers, dtype=torch.float64)
    clients = list(range(cohort_size))
    if cohort_size % 2:
        clients.pop(int(torch.randint(cohort_size, (1,), generator=generator)))
    half = len(clients) // 2
    values = torch.tensor([1.0] * half + [negative] * half, dtype=torch.float64)
    rows = torch.tensor(clients, dtype=torch.long)
    for layer in range(num_layers):
        signs[rows, layer] = values[torch.randperm(len(clients), generator=generator)]
    return signs


@dataclass(frozen=True, eq=False)
class Mutation:
    """What the server chose for a FedMut client: each mutated tensor's +1, 0 or negative weight."""

    signs: torch.Tensor


class FedMut(FedAvg):
    """Generalized FL via stochastic mutation (Hu et al., 2024).

    The server keeps the global model ``w_g`` and the previous round's ``w_prev``. In round
    ``t`` client ``i`` of the cohort receives ``w_i = w_g + alpha * v_i (.) (w_g - w_prev)``,
    where ``v_i`` holds one weight per layer (per parameter tensor): +1 or -1, balanced so that
    in every layer half of the cohort moves each way and the mutations cancel over the cohort
    (an odd cohort leaves one client unmutated). Round 0 has ``w_prev = w_g``: no mutation.
    The returned models are averaged with equal weights (the official code's plain mean), so
    the mutations cancel in the aggregate.

    ``acc_rate`` > 0 reproduces the official code's "mutation acceleration": the negative
    weight is ``-(1 - acc_rate (1 - min((t - 1) / acc_rounds, 1)))``, so early rounds lean
    along the last update. Signs come from a generator keyed by (seed, round), so they do not
    depend on ranks. Details: docs/fl_baselines.md.
    """

    def __init__(self, alpha: NonNegativeFloat = 4.0, acc_rate: number_type(float, ge=0, lt=1) = 0.0,
                 acc_rounds: PositiveInt = 50,
                 mutate_buffers: bool = False, weighting: Optional[Weighting] = None, **kwargs):
        """
        Args:
            alpha: mutation radius (the official code's ``--radius``, default 4.0).
            acc_rate: mutation acceleration of the official code (``--mut_acc_rate``, 0.3
                there); 0 gives the balanced mutation of the paper, whose mutations sum to zero.
            acc_rounds: rounds over which the acceleration decays to 0 (``--mut_bound``, 50).
            mutate_buffers: also mutate floating-point buffers (batch-norm statistics), as the
                official code mutates every state-dict entry; false (default): parameters only,
                the layers the paper mutates along their gradient (statistics have none, and
                ``var + alpha v dvar`` goes negative).
            weighting: uniform (the default when None: the official code's plain mean, under
                which the balanced mutations cancel) or samples (FedAvg's n_i: the mutations
                then leave ``alpha sum_i n_i v_i / n`` times the last update in the aggregate).
            **kwargs: FedAvg's served-statistics options (``bn``, ...).
        """
        super().__init__(weighting=weighting if weighting is not None else "uniform", **kwargs)
        self.alpha = alpha
        self.acc_rate = acc_rate
        self.acc_rounds = acc_rounds
        self.mutate_buffers = mutate_buffers

    def prepare(self, ctx):
        super().prepare(ctx)
        params = {name for name, _ in ctx.model.named_parameters()}
        self.mutated_keys = [k for k, v in self.global_state.items()
                             if v.is_floating_point() and (self.mutate_buffers or k in params)]
        self.previous = {k: v.detach().clone() for k, v in self.global_state.items() if v.is_floating_point()}
        self.keep(KeptTensors("previous/", self.previous))
        self._delta: Dict[str, torch.Tensor] = {}  # the round's w_g - w_prev, shared by its clients

    def negative_weight(self, round_idx: int) -> float:
        """The weight opposite to +1 for the models sent in ``round_idx`` (-1 without acceleration)."""
        if self.acc_rate == 0:
            return -1.0
        done = max(round_idx - 1, 0)  # the original mutates after round t - 1 for round t
        return -(1.0 - self.acc_rate * (1.0 - min(done / self.acc_rounds, 1.0)))

    # -- a round --------------------------------------------------------------------------------
    def plan(self, round_idx):
        plan = super().plan(round_idx)
        generator = torch.Generator().manual_seed(derive_seed(self.ctx.seed, MUTATION_STREAM, round_idx))
        signs = balanced_signs(generator, len(plan.tasks), len(self.mutated_keys), self.negative_weight(round_idx))
        for i, task in enumerate(plan.tasks):
            task.choice = Mutation(signs[i])
        with torch.no_grad():
            self._delta = {k: self.global_state[k] - self.previous[k] for k in self.mutated_keys}
        return plan

    def route(self, task, plan):
        """The client's mutated copy ``w_g + alpha v_i (.) (w_g - w_prev)``."""
        load_routed_state(self.worker, self.global_state, self.worker_regions)
        signs = task.choice.signs.tolist()
        local = self.worker.state_dict()
        with torch.no_grad():
            for key, sign in zip(self.mutated_keys, signs):
                if sign != 0:
                    local[key].add_(self._delta[key], alpha=self.alpha * sign)
        return self.statistics.route(Routed(self.worker, self.worker_regions))

    def finish_round(self, acc, plan):
        with torch.no_grad():
            for key, value in self.previous.items():
                value.copy_(self.global_state[key])
        return super().finish_round(acc, plan)
