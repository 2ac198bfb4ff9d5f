"""FEAST's population in the paper's convention: the cache of the DeepFedNAS construction
(built analytically, tests/data/feast_cifar100_deepfednas_cache.json), the seed search for the
published population statistics, and the accounting computed without a module."""

from pathlib import Path

import numpy as np
import pytest
import torch

from fl_lightning.analysis import feast_accounting as acc
from fl_lightning.data.budgets import (PAPER_CIFAR100_POPULATION, afford_counts, budget_statistics,
                                       population_shard_sizes, search_population_seeds, zipf_budgets)
from fl_lightning.data.partition import alpha_data_for, make_partition
from fl_lightning.data.splits import carve_server_splits
from fl_lightning.elastic.models import build_model
from fl_lightning.elastic.search import FEAST_DEEPFEDNAS, DeepFedNASArch, VariantCache, build_cache, cost_model
from fl_lightning.errors import ConfigError

DATA = Path(__file__).parent / "data"
CACHE = DATA / "feast_cifar100_deepfednas_cache.json"
CHOSEN_SEED = 4508837  # tools/population_seed_search.py --seeds 0 16000000; docs/feast.md


@pytest.fixture(scope="module")
def cache():
    return VariantCache.load(CACHE, FEAST_DEEPFEDNAS)


def test_shipped_analytic_cache_belongs_to_feasts_deepfednas_space(cache):
    assert len(cache) == 55
    assert cache.model_options["construction"] == "deepfednas"
    assert 24.5e6 < cache.macs[0] < 25e6 and cache.macs[-1] < 596e6
    assert cache.search["fitness"]["layers"] == "deepfednas"


def test_cache_check_refuses_another_space(cache):
    with pytest.raises(ConfigError, match="different model"):
        VariantCache.load(CACHE, DeepFedNASArch(max_extra_blocks=4))


def test_build_cache_on_the_analytic_space_round_trips(tmp_path):
    space = DeepFedNASArch(num_classes=10, max_extra_blocks=2)
    built = build_cache(space, segments=[(30e6, 90e6, 3, 0.5)], population=32, generations=16)
    built.save(tmp_path / "c.json")
    loaded = VariantCache.load(tmp_path / "c.json", space)
    assert loaded.macs == built.macs and all(m <= 90e6 for m in loaded.macs)


def test_afford_counts():
    macs = [25e6, 35e6, 45e6, 100e6]
    assert afford_counts([20e6, 25e6, 34.9e6, 35e6, 44e6, 45e6, 1e9], macs) == (2, 2, 2, 1)
    assert budget_statistics([20e6, 34e6, 36e6], macs)["below"] == 2


def test_shard_sizes_are_the_runs():
    """Sizes from class sizes alone equal those of the run's pipeline on a shuffled CIFAR-100
    label vector (stratified server split, then the partition of the pool)."""
    rng = np.random.default_rng(1)
    labels = torch.from_numpy(rng.permutation(np.repeat(np.arange(100), 500)))
    for seed in (0, 7):
        budgets = zipf_budgets(100, seed)
        pool, _, _ = carve_server_splits(labels, 4500, 500, seed)
        shards = make_partition("gamma_dirichlet", labels[pool], 100, seed, alpha=alpha_data_for(0.45, len(pool), 100, 100),
                                gamma=1.0, budgets=budgets, min_size=10)
        assert [len(s) for s in shards] == population_shard_sizes(seed, budgets, [450] * 100).tolist()


def test_chosen_seed_has_the_published_statistics(cache):
    target = PAPER_CIFAR100_POPULATION
    budgets = zipf_budgets(100, CHOSEN_SEED)
    stats = budget_statistics(budgets, cache.macs, target.below_macs)
    assert stats["afford"] == target.afford == (31, 6, 63)
    assert stats["below"] == target.below == 32 and stats["afford_none"] == 0
    sizes = population_shard_sizes(CHOSEN_SEED, budgets, [450] * 100)
    assert (sizes.min(), sizes.max()) == (36, 1905)  # paper: 36-1906
    assert sizes.sum() == 45000
    genes = cost_model(FEAST_DEEPFEDNAS).encode_many(cache.specs)
    assert acc.least_reachable_clients(cache, budgets.tolist(), genes, 4) == 12  # paper: 11


def test_seed_search_returns_matching_seeds_closest_first(cache):
    matches = search_population_seeds(cache.macs, range(7000, 9000))
    assert {m.seed for m in matches} >= {7050, 8854}
    target = PAPER_CIFAR100_POPULATION
    assert all(m.afford == target.afford and m.below == target.below for m in matches)
    distances = [m.distance(target) for m in matches]
    assert distances == sorted(distances)


def test_seed_search_breaks_shard_ties_by_least_reachable(cache):
    """Four seeds of 16M are 1 example off the published shard range; R_min picks one."""
    genes = cost_model(FEAST_DEEPFEDNAS).encode_many(cache.specs)
    reach = lambda budgets: acc.least_reachable_clients(cache, budgets, genes, 4)  # noqa: E731
    matches = search_population_seeds(cache.macs, [3225989, 3751041, 8318362, CHOSEN_SEED], least_reachable=reach)
    assert [m.seed for m in matches][0] == CHOSEN_SEED
    assert [(m.shard_min, m.least_reachable) for m in matches] == [(36, 12), (36, 8), (36, 8), (36, 7)]


@pytest.mark.parametrize("block", ["basic_pair", "bottleneck"])
def test_analytic_envelope_equals_the_routed_supernet(block):
    """The cost model's envelope parameters equal the reduced supernet that routing builds."""
    with torch.device("meta"):
        model = build_model("ofa_resnet", 10, (3, 32, 32), block=block, width_scale=0.125, max_extra_blocks=2,
                            divisor=2)
    g = torch.Generator().manual_seed(0)
    specs = [model.min_spec()] + [model.sample_spec(g) for _ in range(5)]
    small = VariantCache.from_specs(model, specs)
    analytic = acc.analytic_routed_counter(cost_model(model), small)
    direct = acc.model_routed_counter(model, small)
    for k in range(1, len(small) + 1):
        assert analytic(list(range(k))) == direct(list(range(k)))


def test_seed_accounting_and_least_reachable(cache):
    cost = cost_model(FEAST_DEEPFEDNAS)
    routed = acc.analytic_routed_counter(cost, cache)
    out = acc.seed_accounting(cache, routed, cost.full_params(), range(5))
    assert len(out["mean_routed_params"]) == 5
    assert out["traffic_reduction_stats"]["std"] >= 0
    budgets = zipf_budgets(100, 3).tolist()
    p = [routed(cache.affordable(b)) for b in budgets]
    assert out["mean_routed_params"][3] == pytest.approx(np.mean(p))
    # Everyone affording the whole cache routes every position; nobody: the least-reachable is 0.
    genes = cost.encode_many(cache.specs)
    assert acc.least_reachable_clients(cache, [600e6] * 7, genes, 4) == 7
    assert acc.least_reachable_clients(cache, [25e6] * 7, genes, 4) == 0
    full_envelope = routed(list(range(len(cache))))
    assert full_envelope == int(cost.params(cost.envelope(genes))[0]) <= cost.full_params()


def test_paper_comparison_lists_the_published_figures(cache):
    cost = cost_model(FEAST_DEEPFEDNAS)
    routed = acc.analytic_routed_counter(cost, cache)
    budgets = zipf_budgets(100, CHOSEN_SEED).tolist()
    comm = acc.communication(cost.full_params(), [routed(cache.affordable(b)) for b in budgets])
    text = acc.format_paper_comparison(comm, acc.analytic_footprints(cost, cache), afford=(31, 6, 63))
    for figure in ("8.17M", "6.8x", "0.33/0.50M", "11.78/35.60M", "31/6/63"):
        assert figure in text
