"""Partitions, client budgets, server-held splits and the partition report."""

import json

import numpy as np
import pytest
import torch

from fl_lightning.analysis.partition_report import format_report, partition_report, save_report
from fl_lightning.data.budgets import (
    allocation_weights,
    zipf_budgets,
    zipf_draw,
    zipf_rank_probabilities,
)
from fl_lightning.data.partition import (
    alpha_data_for,
    alpha_eff_for,
    dirichlet_concentrations,
    dirichlet_partition,
    gamma_dirichlet_partition,
    iid_partition,
    make_partition,
    natural_partition,
    validate_partition_params,
)
from fl_lightning.data.splits import carve_server_splits, groups_to_pool, to_dataset_indices
from fl_lightning.errors import ConfigError


def random_targets(n=3000, k=10, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, k, n))


def assert_exact_cover(parts, n):
    flat = torch.cat(parts)
    assert len(flat) == n, "some index is missing or repeated"
    assert torch.equal(torch.sort(flat).values, torch.arange(n))
    assert all(p.dtype == torch.long for p in parts)


def label_matrix(parts, y, k):
    return np.stack([np.bincount(y[p.numpy()], minlength=k) for p in parts])


PARTITIONERS = {
    "iid": lambda y, seed: make_partition("iid", y, 20, seed),
    "dirichlet": lambda y, seed: make_partition("dirichlet", y, 20, seed, alpha=0.3),
    "gamma_dirichlet": lambda y, seed: make_partition(
        "gamma_dirichlet", y, 20, seed, alpha=0.05, gamma=1.0, budgets=zipf_budgets(20, seed=7)
    ),
}


# ----------------------------------------------------------------------------- partitions


@pytest.mark.parametrize("method", sorted(PARTITIONERS))
def test_exact_cover_disjoint_and_min_size(method):
    y = random_targets()
    parts = PARTITIONERS[method](y, 0)
    assert len(parts) == 20
    assert_exact_cover(parts, len(y))
    assert min(len(p) for p in parts) >= 10
    assert all(torch.equal(p, torch.sort(p).values) for p in parts)


@pytest.mark.parametrize("method", sorted(PARTITIONERS))
def test_deterministic_in_seed(method):
    y = random_targets()
    a, b, c = PARTITIONERS[method](y, 1), PARTITIONERS[method](y, 1), PARTITIONERS[method](y, 2)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert any(not torch.equal(u, v) for u, v in zip(a, c))


def test_iid_near_equal_shares():
    parts = iid_partition(103, 10, seed=0)
    assert_exact_cover(parts, 103)
    assert sorted(len(p) for p in parts) == [10] * 7 + [11] * 3


def test_dirichlet_is_label_skewed_and_large_alpha_is_not():
    y = random_targets(n=5000, k=10)
    tv = lambda parts: partition_report(parts, y, 10)["summary"]["mean_tv"]  # noqa: E731
    assert tv(dirichlet_partition(y, 10, 0.1, seed=0)) > 0.4
    assert tv(dirichlet_partition(y, 10, 1000.0, seed=0)) < 0.1


@pytest.mark.parametrize("alpha", [1e38, 3.4e38, 1e308])
def test_a_huge_alpha_is_near_iid_not_an_overflow(alpha):
    """Dir(alpha 1) tends to the uniform split as alpha grows; past float64's reach the draw is
    made at MAX_CONCENTRATION, where it equals its mean: every class splits as its mean
    proportions do, up to the one example per class that floor(N_k cumsum p) moves when p is a
    rounding below an integer cut (numpy's sampler returned zeros at 1e308 before)."""
    y = torch.arange(200) % 5  # 5 classes of 40 over 4 clients: 10 each
    shards = dirichlet_partition(y, 4, alpha, seed=0, min_size=1)
    assert_exact_cover(shards, 200)
    assert max(abs(len(s) - 50) for s in shards) <= 5
    q = np.array([0.1, 0.2, 0.3, 0.4])  # gamma-Dirichlet: the mean proportions q
    shards = gamma_dirichlet_partition(y, q, alpha, seed=0, min_size=1)
    assert max(abs(len(s) - want) for s, want in zip(shards, (20, 40, 60, 80))) <= 5
    c = dirichlet_concentrations(q, alpha, [40] * 5)
    assert torch.isfinite(c).all() and torch.allclose(c / c.sum(1, keepdim=True), torch.as_tensor(q).expand(5, 4))
    assert alpha_data_for(alpha, 200, 5, 4) <= 1e100


def test_dirichlet_gives_up_with_config_error_naming_alpha():
    y = random_targets(n=300, k=10)
    with pytest.raises(ConfigError) as err:
        dirichlet_partition(y, 25, 0.001, seed=0, min_size=10, max_retries=5)
    assert err.value.key == "partition.alpha"


def test_gamma_zero_gives_uniform_expected_shares():
    y = random_targets(n=20000, k=20)
    q = allocation_weights(zipf_budgets(20, seed=3), gamma=0.0)
    assert torch.allclose(q, torch.full((20,), 1 / 20, dtype=torch.float64))
    shares = realized_shares(y, q, seeds=range(30))
    assert np.abs(shares - 1 / 20).max() < 0.01


def test_gamma_one_gives_shares_proportional_to_capped_budget():
    y = random_targets(n=20000, k=20)
    b = zipf_budgets(20, seed=3)
    q = allocation_weights(b, gamma=1.0).numpy()
    capped = np.minimum(b.numpy(), 600e6)
    assert np.allclose(q, capped / capped.sum())
    shares = realized_shares(y, torch.from_numpy(q), seeds=range(30))
    assert np.abs(shares - q).max() < 0.01
    assert np.corrcoef(shares, q)[0, 1] > 0.98
    assert np.abs(shares - 1 / 20).max() > 0.02  # and it is really not uniform


def realized_shares(y, q, seeds):
    alpha_data = alpha_data_for(0.45, len(y), 20, len(q))
    sizes = [[len(p) for p in gamma_dirichlet_partition(y, q, alpha_data, seed=s)] for s in seeds]
    return np.mean(sizes, axis=0) / len(y)


def test_pre_integer_expectation_is_q():
    q = allocation_weights(zipf_budgets(10, seed=5), gamma=1.0)
    class_sizes = torch.tensor([100, 250, 40])
    c = dirichlet_concentrations(q, 0.2, class_sizes)
    assert torch.allclose(c / c.sum(dim=1, keepdim=True), q.expand(3, -1))  # Eq. 6
    assert torch.allclose(c.sum(dim=1), 0.2 * class_sizes.double())  # Eq. 7
    draws = np.random.default_rng(0).dirichlet(c[1].numpy(), size=20000)
    assert np.abs(draws.mean(axis=0) - q.numpy()).max() < 0.01


def test_balancing_cap_masks_clients_for_later_classes():
    # Few large classes and a tiny alpha: clients overshoot their cap q_i N_train early.
    y = torch.arange(20).repeat_interleave(100)
    q = allocation_weights(zipf_budgets(10, seed=1), gamma=1.0).numpy()
    parts = gamma_dirichlet_partition(y, q, alpha_data=0.01, seed=0, min_size=0)
    assert_exact_cover(parts, len(y))
    counts = label_matrix(parts, y.numpy(), 20)  # [client, class], classes processed ascending
    before = np.cumsum(counts, axis=1) - counts  # count accumulated before each class
    reached = before >= q[:, None] * len(y)
    assert reached[:, :-1].any(), "the test case should exercise the cap"
    assert (counts[reached] == 0).all()


def test_random_class_order_and_balanced_dirichlet_options():
    y = random_targets(n=3000, k=10)
    q = allocation_weights(zipf_budgets(10, seed=0), gamma=1.0)
    asc = gamma_dirichlet_partition(y, q, 0.1, seed=0)
    rnd = gamma_dirichlet_partition(y, q, 0.1, seed=0, class_order="random")
    assert_exact_cover(rnd, len(y))
    assert any(not torch.equal(u, v) for u, v in zip(asc, rnd))
    with pytest.raises(ConfigError, match="partition.class_order"):
        gamma_dirichlet_partition(y, q, 0.1, seed=0, class_order="by_size")
    # balance=True: the FedML cap n/N, i.e. the gamma = 0 case of the budget-aware procedure
    parts = dirichlet_partition(y, 10, 0.05, seed=0, min_size=0, balance=True)
    counts = label_matrix(parts, y.numpy(), 10)
    reached = (np.cumsum(counts, axis=1) - counts) >= len(y) / 10
    assert reached.any() and (counts[reached] == 0).all()


def test_gamma_dirichlet_redraws_until_every_client_has_min_size():
    y = random_targets(n=4000, k=10)
    q = allocation_weights(zipf_budgets(20, seed=0), gamma=1.0)
    first_draw = gamma_dirichlet_partition(y, q, alpha_data=0.05, seed=0, min_size=0)
    assert min(len(p) for p in first_draw) < 10  # this seed's first draw must be rejected
    parts = gamma_dirichlet_partition(y, q, alpha_data=0.05, seed=0, min_size=10)
    assert min(len(p) for p in parts) >= 10
    assert_exact_cover(parts, len(y))


def test_alpha_data_for_matches_paper_settings():
    assert alpha_data_for(0.45, 45000, 100, 100) == pytest.approx(0.1)  # CIFAR-100
    assert alpha_data_for(0.45, 90000, 10, 100) == pytest.approx(0.005)  # CINIC-10
    assert alpha_data_for(0.45, 90000, 200, 100) == pytest.approx(0.1)  # TinyImageNet
    assert alpha_eff_for(0.1, 45000, 100, 100) == pytest.approx(0.45)


def test_natural_partition_all_and_sampled_groups():
    groups = [[0, 1, 2], [], [3, 4], [5], [6, 7, 8, 9]]
    part = natural_partition(groups)
    assert part.group_ids.tolist() == [0, 2, 3, 4]  # empty group skipped
    assert [p.tolist() for p in part.clients] == [[0, 1, 2], [3, 4], [5], [6, 7, 8, 9]]
    a = natural_partition(groups, num_clients=2, seed=4)
    b = natural_partition(groups, num_clients=2, seed=4)
    assert torch.equal(a.group_ids, b.group_ids) and len(a.clients) == 2
    assert [groups[g] for g in a.group_ids.tolist()] == [p.tolist() for p in a.clients]
    assert len(make_partition("natural", torch.zeros(10), 2, 4, groups=groups, min_size=1)) == 2
    with pytest.raises(ConfigError):
        natural_partition(groups, num_clients=5)
    with pytest.raises(ConfigError):
        natural_partition([[0, 1], [1, 2]])


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan")])
def test_config_error_for_bad_alpha(alpha):
    y = random_targets()
    with pytest.raises(ConfigError, match="partition.alpha"):
        dirichlet_partition(y, 10, alpha, seed=0)
    with pytest.raises(ConfigError, match="partition.alpha"):
        gamma_dirichlet_partition(y, torch.full((10,), 0.1), alpha, seed=0)
    with pytest.raises(ConfigError, match="partition.alpha"):
        make_partition("dirichlet", y, 10, 0, alpha=alpha)


def test_validate_partition_params():
    validate_partition_params("gamma_dirichlet", 1000, 100, alpha=0.1, gamma=1.0)
    validate_partition_params("natural", 0, None)
    cases = [
        (("nope", 1000, 10), {}, "partition.method"),
        (("iid", 1000, 0), {}, "partition.num_clients"),
        (("iid", 99, 10), {"min_size": 10}, "partition.num_clients"),
        (("dirichlet", 1000, 10), {"alpha": 0}, "partition.alpha"),
        (("gamma_dirichlet", 1000, 10), {"alpha": 0.1, "gamma": -0.5}, "partition.gamma"),
        (("gamma_dirichlet", 1000, 10), {"alpha": 0.1, "gamma": 1, "budgets": [1e8] * 9}, "partition.budgets"),
        (("natural", 100, 5), {"num_groups": 4}, "partition.num_clients"),
    ]
    for args, kwargs, key in cases:
        with pytest.raises(ConfigError) as err:
            validate_partition_params(*args, **kwargs)
        assert err.value.key == key
    with pytest.raises(ConfigError, match="partition.budgets"):
        make_partition("gamma_dirichlet", random_targets(), 10, 0, alpha=0.1)


def test_allocation_weights_formula_and_errors():
    b = torch.tensor([25e6, 100e6, 600e6, 1500e6], dtype=torch.float64)
    for gamma in [0.0, 0.5, 1.0, 1.5]:
        capped = torch.clamp(b, max=600e6) ** gamma
        assert torch.allclose(allocation_weights(b, gamma), capped / capped.sum())
    q = allocation_weights(b, 1.0)
    assert q[2] == q[3]  # capability above B_cap adds no allocation weight
    assert torch.isfinite(allocation_weights(b, 200.0)).all()
    with pytest.raises(ConfigError, match="partition.gamma"):
        allocation_weights(b, -0.1)


# ----------------------------------------------------------------------------- budgets


def test_zipf_budgets_range_jitter_and_determinism():
    draw = zipf_draw(500, seed=0)
    b = draw.budgets
    assert b.dtype == torch.float64 and b.shape == (500,)
    assert (b >= 25e6).all() and (b <= 1500e6).all()
    assert draw.delta_b == pytest.approx((1500e6 - 25e6) / 499)
    assert (draw.jitter.abs() <= draw.delta_b / 2).all()
    unclipped = 25e6 + (draw.ranks - 1).double() * draw.delta_b + draw.jitter
    assert torch.allclose(b, unclipped.clamp(25e6, 1500e6))
    assert torch.equal(zipf_budgets(500, seed=0), b)
    assert not torch.equal(zipf_budgets(500, seed=1), b)
    # Low-end heavy: the share below 300M is Eq. 1's probability of the ranks whose jittered
    # budget (Eq. 2) falls below it, written out here; within 4 standard errors of 500 draws.
    ranks = np.arange(1, 501)
    prob = ranks ** -1.2 / (ranks ** -1.2).sum()
    delta = (1500e6 - 25e6) / 499
    below = np.clip((300e6 - (25e6 + (ranks - 1) * delta - delta / 2)) / delta, 0, 1)
    p = float((prob * below).sum())
    assert p > 0.5 and abs(float((b < 300e6).double().mean()) - p) < 4 * np.sqrt(p * (1 - p) / 500)


def test_zipf_rank_distribution_chi_square():
    levels, n = 10, 50000
    draw = zipf_draw(n, seed=0, num_levels=levels)
    observed = np.bincount(draw.ranks.numpy() - 1, minlength=levels)
    ranks = np.arange(1, levels + 1)
    eq_1 = ranks ** -1.2 / (ranks ** -1.2).sum()  # Supp. A Eq. 1: Pr[rank = r] = r^-s / sum_l l^-s
    assert np.allclose(zipf_rank_probabilities(levels, 1.2), eq_1, rtol=1e-12, atol=0)
    expected = n * eq_1
    chi2 = ((observed - expected) ** 2 / expected).sum()
    assert chi2 < 27.9  # chi-square, 9 degrees of freedom, p = 0.001


def test_zipf_bad_parameters():
    with pytest.raises(ConfigError):
        zipf_budgets(0, seed=0)
    with pytest.raises(ConfigError):
        zipf_budgets(10, seed=0, b_min=2e9)
    assert torch.equal(zipf_budgets(3, seed=0, num_levels=1), torch.full((3,), 25e6, dtype=torch.float64))


# ----------------------------------------------------------------------------- splits


def test_stratified_splits_are_disjoint_exact_and_stratified():
    y = torch.arange(10).repeat(100)
    pool, val, calib = carve_server_splits(y, 200, 50, seed=0)
    assert_exact_cover([pool, val, calib], len(y))
    assert (len(val), len(calib), len(pool)) == (200, 50, 750)
    assert np.bincount(y[val].numpy()).tolist() == [20] * 10
    assert np.bincount(y[calib].numpy()).tolist() == [5] * 10


def test_stratified_splits_with_unbalanced_classes():
    y = random_targets(n=1037, k=7, seed=3)
    y[:5] = 9  # a rare class
    pool, val, calib = carve_server_splits(y, 101, 33, seed=1)
    assert_exact_cover([pool, val, calib], len(y))
    assert (len(val), len(calib)) == (101, 33)
    n_k = np.bincount(y.numpy())
    v_k = np.bincount(y[val].numpy(), minlength=len(n_k))
    assert np.abs(v_k - 101 * n_k / len(y)).max() < 1  # largest-remainder rounding
    a = carve_server_splits(y, 101, 33, seed=1)
    assert all(torch.equal(u, v) for u, v in zip(a, (pool, val, calib)))


def test_unstratified_splits_and_errors():
    y = random_targets(n=500)
    pool, val, calib = carve_server_splits(y, 40, 10, seed=0, stratified=False)
    assert_exact_cover([pool, val, calib], 500)
    assert (len(val), len(calib)) == (40, 10)
    with pytest.raises(ConfigError):
        carve_server_splits(y, 400, 200, seed=0)
    with pytest.raises(ConfigError):
        carve_server_splits(y, -1, 0, seed=0)


def test_partition_of_pool_maps_back_to_dataset_indices():
    y = random_targets(n=2000)
    pool, val, calib = carve_server_splits(y, 100, 20, seed=0)
    local = make_partition("dirichlet", y[pool], 10, 0, alpha=0.5)
    clients = to_dataset_indices(local, pool)
    assert torch.equal(torch.sort(torch.cat(clients)).values, pool)
    for loc, glob in zip(local, clients):
        assert torch.equal(y[pool][loc], y[glob])
    groups = [list(range(0, 1000)), list(range(1000, 2000))]
    in_pool = groups_to_pool(groups, pool)
    assert sum(len(g) for g in in_pool) == len(pool)
    assert torch.equal(torch.cat(to_dataset_indices(in_pool, pool)), pool)


# ----------------------------------------------------------------------------- report


def test_report_tv_zero_for_balanced_toy_case():
    y = torch.arange(4).repeat(10)  # 40 examples, labels 0..3 balanced
    rep = partition_report([torch.arange(0, 20), torch.arange(20, 40)], y, 4)
    assert rep["tv_distance"] == [0.0, 0.0] and rep["summary"]["mean_tv"] == 0.0


@pytest.mark.parametrize("k", [2, 4, 100])
def test_report_tv_maximal_for_disjoint_single_class_clients(k):
    # A client's own examples are part of the global distribution, so TV_i <= 1 - n_i / n;
    # disjoint single-class clients attain that bound, 1 - 1/K, which tends to 1 with K.
    y = torch.arange(k).repeat(5)
    single = [torch.nonzero(y == c).flatten() for c in range(k)]
    rep = partition_report(single, y, k)
    assert rep["tv_distance"] == pytest.approx([1 - 1 / k] * k)
    assert rep["num_labels"] == [1] * k


def test_report_contents_text_and_files(tmp_path):
    y = random_targets(n=5000, k=100)
    parts = dirichlet_partition(y, 100, 0.5, seed=0, min_size=5)
    rep = partition_report(parts, y, 100, budgets=zipf_budgets(100, seed=0))
    assert rep["sizes"] == [len(p) for p in parts]
    assert len(rep["label_counts"]) == 100 and len(rep["label_counts"][0]) == 100
    assert rep["summary"]["min_size"] == min(rep["sizes"])
    text = format_report(rep)
    assert len(text.splitlines()) == 2 + 100
    paths = save_report(rep, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["sizes"] == rep["sizes"]
    assert paths["png"].stat().st_size > 0
    few = partition_report(iid_partition(60, 3, seed=0), torch.arange(60) % 5, 5)
    assert save_report(few, tmp_path / "few")["png"].exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["partition.json", "partition.png"]
