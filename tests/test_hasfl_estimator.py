"""HAS-FL's estimator where the method calls it (``HASFL.commit`` / ``finish_round``), and the
label TV it is correlated with in the label-skew analysis.

``tests/test_submodel.py`` checks ``update_divergence`` on given tensors; these tests run a real
round and check what the method feeds it: the client's update against the global state before
the round, the aggregate's change ``D_bar = new - old`` (not reversed, not read after the global
state moved), over parameters only.
"""

import math

import numpy as np
import pytest
import torch
from lightning.fabric import Fabric

from fl_lightning.algorithms import HASFL
from fl_lightning.analysis.heterogeneity import label_tv
from fl_lightning.analysis.partition_report import partition_report
from fl_lightning.elastic.bn import statistics_keys
from fl_lightning.federation.loop import Federation
from fl_lightning.federation.run_dir import RunDir

U32 = 2.0 ** -24  # unit roundoff of float32 (round to nearest)


def one_round(spec_factory, algorithm, on_commit=None):
    """Round 0 of HAS-FL with two full-width clients (all caps 1, inside the warm-up); returns
    the federation, the round's H_hat by client, and each client's returned parameters."""
    from fl_lightning.config import FederationConfig

    spec = spec_factory(algorithm=algorithm, federation=FederationConfig(rounds=1, clients_per_round=2))
    fed = Federation(Fabric(accelerator="cpu", devices=1), spec, RunDir(spec.out_dir, spec.name))
    fed._open_outputs()
    alg, returned = fed.algorithm, {}
    commit = alg.commit

    def keep(acc, task, result, plan):
        if on_commit is not None:
            on_commit(task, result)
        state = result.model.module.state_dict()
        returned[task.client] = {g: state[k].detach().clone() for k, (g, _) in result.model.regions.items()
                                 if g in alg.param_keys}
        commit(acc, task, result, plan)

    alg.commit = keep
    row, _ = fed.run_round(0)
    hats = {int(k.split("/")[1]): v for k, v in row.items() if k.startswith("H_hat/")}
    return fed, hats, returned


@pytest.mark.parametrize("bn", ["sbn", "aggregated"])
def test_two_full_width_clients_have_estimates_in_the_ratio_of_their_squared_sizes(spec_factory, bn):
    """Two full-width clients with n1 and n2 examples: the aggregate's change is their
    sample-weighted mean ``D_bar = (n1 D1 + n2 D2) / N``, so ``D1 - D_bar = n2 (D1 - D2) / N`` and
    ``D2 - D_bar = -n1 (D1 - D2) / N``; both estimates share the denominator ``||D_bar||^2 + eps``
    (the same coordinates), hence ``H1 / H2 = (n2 / n1)^2`` exactly. Reversed global states
    (``D_bar`` of the wrong sign) or states read after the update (``D_bar = 0``) break it."""
    fed, hats, returned = one_round(spec_factory, HASFL(caps=[1.0] * 6, t_warm=10, bn=bn))
    (c1, h1), (c2, h2) = sorted(hats.items())
    n1, n2 = (len(fed.ctx.shards[c]) for c in (c1, c2))
    assert n1 != n2 and h1 > 0 and h2 > 0
    # The only rounding is the new global state's cast to float32 (the accumulator sums in
    # float64): |delta| <= U32 |new| per coordinate. With e_i the exact residuals
    # (|e_1| = n2 |v| / N, |e_2| = n1 |v| / N, v = D1 - D2), the computed residuals are e_i - delta,
    # so H1 / H2 lies within ((1 + r1) / (1 - r2))^2 of (n2 / n1)^2, r_i = |delta| / |e_i|.
    new = fed.algorithm.global_state
    keys = list(returned[c1])
    v = math.sqrt(sum(float((returned[c1][k].double() - returned[c2][k].double()).pow(2).sum()) for k in keys))
    delta = U32 * math.sqrt(sum(float(new[k].double().pow(2).sum()) for k in keys))
    total = n1 + n2
    r1, r2 = delta / (n2 * v / total), delta / (n1 * v / total)
    bound = ((1 + r1) / (1 - r2)) ** 2 - 1
    assert bound < 1e-4  # the test can tell the identity from a 1e-4 departure
    assert h1 / h2 == pytest.approx((n2 / n1) ** 2, rel=bound)


def test_estimates_ignore_the_batch_norm_statistics(spec_factory):
    """H_hat is over parameters only: the same round with every client's returned BN running
    statistics moved far (tracked and aggregated under ``bn: aggregated``) gives the same
    estimates, although the aggregate's statistics do change."""
    plain, hats, _ = one_round(spec_factory, HASFL(caps=[1.0] * 6, t_warm=10, bn="aggregated"))

    def move_statistics(task, result):
        module = result.model.module
        with torch.no_grad():
            for key in statistics_keys(module):
                buffer = module.get_buffer(key)
                if buffer.is_floating_point():
                    buffer.add_(1.0 + task.client)
                else:  # num_batches_tracked
                    buffer.add_(100 * (1 + task.client))

    moved, moved_hats, _ = one_round(spec_factory, HASFL(caps=[1.0] * 6, t_warm=10, bn="aggregated"),
                                     on_commit=move_statistics)
    stats = [k for k in statistics_keys(plain.ctx.model) if plain.algorithm.global_state[k].is_floating_point()]
    assert stats and all(float((moved.algorithm.global_state[k] - plain.algorithm.global_state[k]).abs().min()) > 0.5
                         for k in stats)
    assert sorted(moved_hats) == sorted(hats)
    for client, h in hats.items():
        assert moved_hats[client] == pytest.approx(h, rel=1e-12)


def test_label_tv_is_measured_against_the_global_label_distribution():
    """An unbalanced toy partition (3 classes held 5 : 3 : 4), by hand: P = (5, 3, 4) / 12;
    client A holds labels (0, 0, 0, 0, 1): 0.5 (|4/5 - 5/12| + |1/5 - 1/4| + |0 - 1/3|) = 23/60;
    B (0, 1, 1, 2, 2): 0.5 (13 + 9 + 4) / 60 = 13/60; C (2, 2): 0.5 (25 + 15 + 40) / 60 = 2/3.
    Against a uniform distribution A would be 7/15, B 2/15, C 2/3."""
    targets = torch.tensor([0, 0, 0, 0, 1, 0, 1, 1, 2, 2, 2, 2])
    clients = [torch.arange(0, 5), torch.arange(5, 10), torch.arange(10, 12)]
    expected = [23 / 60, 13 / 60, 2 / 3]
    assert label_tv(clients, targets, 3).tolist() == pytest.approx(expected, abs=1e-15)
    report = partition_report(clients, targets, 3)
    assert report["global_distribution"] == pytest.approx([5 / 12, 3 / 12, 4 / 12], abs=1e-15)
    assert report["tv_distance"] == pytest.approx(expected, abs=1e-15)
    # a client absent from the list does not count towards P: two clients alone give P = (5, 3, 2) / 10
    assert label_tv(clients[:2], targets, 3).tolist() == pytest.approx(
        [0.5 * (abs(0.8 - 0.5) + abs(0.2 - 0.3) + abs(0 - 0.2)), 0.5 * (0.3 + 0.1 + 0.2)], abs=1e-15)
    assert np.isnan(label_tv([torch.arange(0, 5), torch.tensor([], dtype=torch.long)], targets, 3)[1])
