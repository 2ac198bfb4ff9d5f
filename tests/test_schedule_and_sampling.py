"""The learning-rate schedule, client sampling and the sub-model width draws, tested directly at
non-default settings, each against a figure computed here by hand (or a probability worked out
here), with inputs where a neighbouring formula gives another figure; both are stated."""

import math
from collections import Counter
from itertools import combinations
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fl_lightning.algorithms import FedAvg, FjORD
from fl_lightning.algorithms.submodel import matched_widths
from fl_lightning.config import LocalTrainConfig
from fl_lightning.runtime.client_selection import UniformSelection
from fl_lightning.runtime.schedule import round_lr
from fl_lightning.runtime.seeding import sample_clients


# -- the learning rate over rounds --------------------------------------------------------------

def test_exponential_schedule_is_lr_times_decay_to_the_round():
    """lr 0.2, decay 0.8, round 3 (the fourth): 0.2 * 0.8^3 = 0.1024; decay^(round + 1) would give
    0.08192 and decay^(round - 1) 0.128."""
    assert round_lr(0.2, "exponential", 3, 10, decay=0.8) == pytest.approx(0.1024, rel=1e-12)
    assert round_lr(0.2, "exponential", 0, 10, decay=0.8) == 0.2  # round 0 runs at the base rate


def test_cosine_schedule_is_half_a_cosine_over_the_run():
    """lr 0.1 over 4 rounds: round 1 at 0.05 (1 + cos(pi/4)) = 0.0853553; a period of
    total_rounds - 1 would give 0.075 and a period of 2 total_rounds 0.0961940. Round 3 (the last)
    at 0.05 (1 + cos(3 pi / 4)) = 0.0146447, never 0."""
    assert round_lr(0.1, "cosine", 1, 4) == pytest.approx(0.05 * (1 + math.sqrt(0.5)), rel=1e-12)
    assert round_lr(0.1, "cosine", 1, 4) == pytest.approx(0.0853553, abs=1e-7)
    assert round_lr(0.1, "cosine", 3, 4) == pytest.approx(0.0146447, abs=1e-7)
    assert round_lr(0.1, "cosine", 0, 4) == 0.1


def test_constant_schedule_ignores_round_and_decay():
    assert round_lr(0.3, "constant", 7, 10, decay=0.5) == 0.3


def test_a_method_reads_the_configured_decay():
    """lr_decay 0.5 (default 0.995), round 2: 0.4 * 0.25 = 0.1; the default decay would give
    0.396."""
    algorithm = FedAvg()
    algorithm.ctx = SimpleNamespace(train=LocalTrainConfig(lr=0.4, lr_schedule="exponential", lr_decay=0.5),
                                    rounds=10)
    assert algorithm.round_lr(2) == pytest.approx(0.1, rel=1e-12)


# -- which clients a round trains ----------------------------------------------------------------

ROUNDS = 3000


def cohorts(seed=5, num_clients=10, per_round=4, rounds=ROUNDS):
    return [sample_clients(seed, r, num_clients, per_round) for r in range(rounds)]


def test_a_cohort_is_distinct_sorted_clients():
    for cohort in cohorts(per_round=8, rounds=200):  # 8 of 10: with replacement nearly every draw repeats one
        assert len(cohort) == 8 and len(set(cohort)) == 8 and cohort == sorted(cohort)
        assert all(0 <= c < 10 for c in cohort)
    assert sample_clients(5, 0, 10, 10) == list(range(10))


def test_each_client_takes_part_in_per_round_over_num_clients_of_the_rounds():
    """4 of 10 per round over 3000 rounds: each client in 0.4 of them (standard deviation of the
    observed share sqrt(0.4 * 0.6 / 3000) = 0.0089; five of them allowed). Always the first four
    would give 1 and 0; a cohort of per_round - 1, 0.3."""
    counts = Counter(c for cohort in cohorts() for c in cohort)
    for client in range(10):
        assert counts[client] / ROUNDS == pytest.approx(0.4, abs=5 * math.sqrt(0.4 * 0.6 / ROUNDS))


def test_pairs_take_part_together_as_without_replacement():
    """2 of 4: without replacement two given clients share a cohort with probability
    m (m - 1) / (n (n - 1)) = 2 / 12 = 0.1667; independent draws per client at rate 0.5 would
    give 0.25 (standard deviation of the observed share over 3000 rounds 0.0068; 0.03 allowed)."""
    together = Counter(pair for cohort in cohorts(num_clients=4, per_round=2) for pair in combinations(cohort, 2))
    for pair in combinations(range(4), 2):
        assert together[pair] / ROUNDS == pytest.approx(2 / 12, abs=0.03)


def test_cohorts_depend_on_seed_and_round_only():
    a, b = cohorts(rounds=50), cohorts(rounds=50)
    assert a == b
    assert len({tuple(c) for c in a}) > 25  # redrawn each round (210 possible cohorts)
    assert cohorts(seed=6, rounds=50) != a
    selection = UniformSelection(seed=5, num_clients=10, per_round=4)
    assert [selection.cohort(r) for r in range(50)] == a


# -- sub-model widths ---------------------------------------------------------------------------

def test_random_budget_widths_solve_for_the_scale_under_the_caps():
    """u = (0.1, 0.5, 0.9), caps (1, 1, 0.3), p_lo 0.1, target 0.4: with the third client at its
    cap, 0.1 + 0.1 s + 0.1 + 0.5 s + 0.3 = 1.2 gives s = 7/6 and widths (0.21667, 0.68333, 0.3).
    Solving without the caps and capping after (s = 0.6) would give (0.16, 0.4, 0.3), mean 0.287."""
    widths = matched_widths(np.array([0.1, 0.5, 0.9]), np.array([1.0, 1.0, 0.3]), 0.4, 0.1)
    s = 7 / 6
    assert widths == pytest.approx([0.1 + 0.1 * s, 0.1 + 0.5 * s, 0.3], abs=1e-9)
    assert widths == pytest.approx([0.2166667, 0.6833333, 0.3], abs=1e-7)


def test_random_budget_keeps_p_lo_below_its_floor():
    """A target under p_lo's mean gives p_lo (capped): caps (0.05, 1), p_lo 0.2, target 0.1 ->
    (0.05, 0.2)."""
    assert matched_widths(np.array([0.3, 0.7]), np.array([0.05, 1.0]), 0.1, 0.2) == pytest.approx([0.05, 0.2])


def test_fjord_redraws_each_width_uniformly_from_the_tiers_within_the_cap():
    """Caps 1, 0.75, 0.25 over 3000 rounds: the 0.75 client trains 0.25, 0.5 and 0.75 a third of
    the rounds each (never 1); the full-width client each of the four tiers a quarter; the 0.25
    client always 0.25. Tiers strictly below the cap would give the 0.75 client halves of 0.25
    and 0.5; a draw that never takes the last allowed tier, the same."""
    fjord = FjORD(caps=[1.0, 0.75, 0.25])
    fjord.caps = torch.tensor([1.0, 0.75, 0.25], dtype=torch.float64)
    fjord.ctx = SimpleNamespace(seed=11)
    draws = [fjord.widths_for(r, [0, 1, 2]) for r in range(ROUNDS)]
    for client, tiers in ((0, (0.25, 0.5, 0.75, 1.0)), (1, (0.25, 0.5, 0.75)), (2, (0.25,))):
        seen = Counter(d[client] for d in draws)
        assert set(seen) == set(tiers), client
        p = 1 / len(tiers)
        for tier in tiers:
            assert seen[tier] / ROUNDS == pytest.approx(p, abs=5 * math.sqrt(p * (1 - p) / ROUNDS)), (client, tier)
    assert fjord.widths_for(7, [0, 1, 2]) == draws[7]  # a function of (seed, round)
