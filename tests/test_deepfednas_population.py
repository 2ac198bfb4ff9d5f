"""FEAST's population in the paper's convention: the cache of the DeepFedNAS construction
(built analytically, tests/data/feast_cifar100_deepfednas_cache.json), the seed search for the
published population statistics, and the accounting computed without a module."""

from pathlib import Path

import numpy as np
import pytest
import torch

from fl_lightning.algorithms.supernet import feast_accounting as acc
from fl_lightning.analysis.population import (PAPER_CIFAR100_POPULATION, afford_counts, budget_statistics,
                                              population_shard_sizes, search_population_seeds)
from fl_lightning.data.budgets import zipf_budgets
from fl_lightning.data.partition import alpha_data_for, make_partition
from fl_lightning.data.splits import carve_server_splits
from fl_lightning.elastic.models import build_model
from fl_lightning.elastic.search import FEAST_DEEPFEDNAS, DeepFedNASArch, VariantCache, build_cache, cost_model
from fl_lightning.errors import ConfigError
from fl_lightning.feast_protocol import CACHE_SEGMENTS
from fl_lightning.elastic.models import OFAResNet
from hand_counts import basic_pair_params, hooked_macs, make_divisible

DATA = Path(__file__).parent / "data"
CACHE = DATA / "feast_cifar100_deepfednas_cache.json"
CHOSEN_SEED = 4508837  # tools/population_seed_search.py --seeds 0 16000000; docs/feast.md


@pytest.fixture(scope="module")
def cache():
    return VariantCache.load(CACHE, FEAST_DEEPFEDNAS)


def envelope_params(specs) -> int:
    """``P_i`` by hand: the envelope's depth and width (coordinate-wise maxima, Supp. Eq. 12)
    with the largest expansion, FEAST's channels (stem 64, stages [128, 256, 512, 1024],
    multipliers 0.1..1.0, middle md(out x 0.25)) and the layer shapes of DeepFedNAS's blocks."""
    d = [max(s.d[l] for s in specs) for l in range(4)]
    w = [max(s.w[j] for s in specs) for j in range(5)]
    width = lambda base, j: make_divisible(base * round(0.1 * (w[j] + 1), 1))  # noqa: E731
    stages = []
    for l, base in enumerate((128, 256, 512, 1024)):
        out = width(base, l + 1)
        stages.append((out, make_divisible(out * 0.25), 1 + d[l]))
    return basic_pair_params(width(64, 0), stages, 100)


def affordable(cache, budget):
    return [spec for spec, macs in zip(cache.specs, cache.macs) if macs <= budget]  # Eq. 11


def test_shipped_analytic_cache_belongs_to_feasts_deepfednas_space(cache):
    """Built by the paper's procedure (Supp. Table 1 targets and rho_0, Eq. 10 limits); its
    MACs and parameters recounted on the modules of the default supernet, which is this space."""
    assert cache.model_options["construction"] == "deepfednas"
    assert cache.search["fitness"]["layers"] == "deepfednas"
    assert [tuple(seg) for seg in cache.search["segments"]] == [tuple(seg) for seg in CACHE_SEGMENTS]
    assert cache.search["targets"] == 56 and len(cache) == 56 - cache.search["duplicates"]
    targets = {round(t): rho for lo, hi, n, rho in CACHE_SEGMENTS for t in np.linspace(lo, hi, n)}
    for v in cache.variants:
        assert v.info["target"] in targets and v.info["rho_limit"] == targets[v.info["target"]]
        assert v.macs <= v.info["target"] and v.info["rho"] <= v.info["rho_limit"]
    with torch.device("meta"):
        model = build_model(OFAResNet, 100, (3, 32, 32))
        for v in cache.variants[::9] + cache.variants[-1:]:  # loading checked every row against the cost model
            local = model.build_local(v.spec, elastic=False)
            assert (hooked_macs(local, (3, 32, 32))["paper"], sum(p.numel() for p in local.parameters())) \
                == (v.macs, v.params), v.spec


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
    """Counted here with plain comparisons and envelopes, against Supp. E.1, E.4 and F.5."""
    target = PAPER_CIFAR100_POPULATION
    budgets = zipf_budgets(100, CHOSEN_SEED).tolist()
    counts = [len(affordable(cache, b)) for b in budgets]
    afford = (counts.count(1), counts.count(2), sum(c >= 3 for c in counts))
    assert afford == (31, 6, 63) and min(counts) >= 1  # paper: 31 use one variant, six two, 63 three
    assert sum(b < 35e6 for b in budgets) == 32  # paper: 32 clients below ScaleFL's ~35M minimum
    stats = budget_statistics(budgets, cache.macs, target.below_macs)
    assert (stats["afford"], stats["below"], stats["afford_none"]) == (afford, 32, 0)
    sizes = population_shard_sizes(CHOSEN_SEED, budgets, [450] * 100)
    assert sizes.sum() == 45000  # CIFAR-100's 50,000 less 5,000 server-held (Supp. Table 3)
    assert sizes.min() == 36 and abs(sizes.max() - 1906) <= 1  # paper: 36 <= n_i <= 1906
    # R_min: the routed envelopes are nested in the budget (Prop. 1), so the least-reachable
    # position sits at some coordinate's cache-wide maximum; count the envelopes reaching it.
    top = [max(s.d[l] for s in cache.specs) for l in range(4)] + [max(s.w[j] for s in cache.specs) for j in range(5)]
    reach = [0] * 9
    for b in budgets:
        specs = affordable(cache, b)
        env = [max(s.d[l] for s in specs) for l in range(4)] + [max(s.w[j] for s in specs) for j in range(5)]
        reach = [r + (e == t) for r, e, t in zip(reach, env, top)]
    genes = cost_model(FEAST_DEEPFEDNAS).encode_many(cache.specs)
    assert acc.least_reachable_clients(cache, budgets, genes, 4) == min(reach)
    assert abs(min(reach) - 11) <= 1  # paper: 11, with its own cache's architectures


def test_chosen_seed_reproduces_the_training_computation_ratio(cache):
    """Eq. 26 over the population by plain arithmetic: the FEAST-to-single-variant ratio is the
    paper's 1.56x (Supp. E.4), client ratios from 1.00x to about 2.34x."""
    budgets = zipf_budgets(100, CHOSEN_SEED).tolist()
    sizes = population_shard_sizes(CHOSEN_SEED, budgets, [450] * 100).tolist()
    feast = single = 0.0
    ratios = []
    for b, n in zip(budgets, sizes):
        macs = [m for m in cache.macs if m <= b]
        low, high = macs[0], macs[-1]
        middle = [m for m in macs if low < m < high]
        per_example = low if high == low else low + high + (sum(middle) / len(middle) if middle else 0)
        feast, single = feast + n * per_example, single + n * high
        ratios.append(per_example / high)
    assert round(feast / single, 2) == 1.56
    assert min(ratios) == 1.0 and abs(max(ratios) - 2.34) < 0.01  # this cache's top: 2.332
    sets = acc.affordable_sets(cache, budgets)
    out = acc.training_computation(cache, sets, sizes, rounds=4000, clients_per_round=10)
    assert out["ratio"] == pytest.approx(feast / single, rel=1e-12)
    # kappa_fb = 3, one epoch, participation 4000 x 10 / 100 rounds per client
    assert out["feast_train_macs"] == pytest.approx(3 * 400 * feast, rel=1e-12)
    assert out["single_variant_train_macs"] == pytest.approx(3 * 400 * single, rel=1e-12)


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
        model = build_model(OFAResNet, 10, (3, 32, 32), block=block, width_scale=0.125, max_extra_blocks=2,
                            divisor=2)
    g = torch.Generator().manual_seed(0)
    specs = [model.min_spec()] + [model.sample_spec(g) for _ in range(5)]
    small = VariantCache.from_specs(model, specs)
    analytic = acc.analytic_routed_counter(cost_model(model), small)
    direct = acc.model_routed_counter(model, small)
    for k in range(1, len(small) + 1):
        assert analytic(list(range(k))) == direct(list(range(k)))


def test_seed_accounting_and_least_reachable(cache):
    """Supp. C, Eq. 16 recomputed by hand: each client's routed envelope counted from layer
    shapes, the mean and the ratio of sums with plain arithmetic."""
    cost = cost_model(FEAST_DEEPFEDNAS)
    routed = acc.analytic_routed_counter(cost, cache)
    out = acc.seed_accounting(cache, routed, cost.full_params(), range(3))
    full = basic_pair_params(64, [(128, 32, 9), (256, 64, 9), (512, 128, 9), (1024, 256, 9)], 100)
    assert cost.full_params() == full
    for k, seed in enumerate(range(3)):
        p = [envelope_params(affordable(cache, b)) for b in zipf_budgets(100, seed).tolist()]
        assert out["mean_routed_params"][k] == pytest.approx(sum(p) / 100, rel=1e-12)
        assert out["traffic_reduction"][k] == pytest.approx(100 * full / sum(p), rel=1e-12)
    t = out["traffic_reduction"]
    assert out["traffic_reduction_stats"]["std"] == pytest.approx(np.std(t), rel=1e-12) and np.std(t) > 0
    # The whole cache's envelope: the paper's 35.60M routed at the 596M anchor (Table 9).
    assert routed(list(range(len(cache)))) == envelope_params(cache.specs)
    assert round(envelope_params(cache.specs) / 1e6, 2) == 35.60
    # Everyone affording the whole cache routes every position; nobody: the least-reachable is 0.
    genes = cost.encode_many(cache.specs)
    assert acc.least_reachable_clients(cache, [600e6] * 7, genes, 4) == 7
    assert acc.least_reachable_clients(cache, [25e6] * 7, genes, 4) == 0


def comparison_rows(text):
    """{row name: (here, paper)} of :func:`format_paper_comparison`'s table (cells hold no spaces)."""
    out = {}
    for line in text.splitlines()[1:]:
        *name, here, paper = line.split()
        out[" ".join(name)] = (here, paper)
    return out


def test_paper_comparison_prints_the_computed_figures_beside_the_published_ones(cache):
    """Each 'here' cell equals the figure recomputed by hand for the chosen seed (envelopes
    counted from layer shapes, reductions by plain arithmetic); the 'paper' cells are the
    published figures."""
    cost = cost_model(FEAST_DEEPFEDNAS)
    routed = acc.analytic_routed_counter(cost, cache)
    budgets = zipf_budgets(100, CHOSEN_SEED).tolist()
    comm = acc.communication(cost.full_params(), [routed(cache.affordable(b)) for b in budgets])
    counts = [len(affordable(cache, b)) for b in budgets]
    afford = (counts.count(1), counts.count(2), sum(c >= 3 for c in counts))
    rows = comparison_rows(acc.format_paper_comparison(comm, acc.analytic_footprints(cost, cache), afford=afford,
                                                       least_reachable=9))
    full = basic_pair_params(64, [(128, 32, 9), (256, 64, 9), (512, 128, 9), (1024, 256, 9)], 100)
    p = [envelope_params(affordable(cache, b)) for b in budgets]
    ratios = sorted(full / x for x in p)
    expected = {
        "clients affording 1 / 2 / >=3": ("/".join(map(str, afford)), "31/6/63"),
        "least-reachable position: clients": ("9", "11"),
        "full supernet parameters": (f"{full / 1e6:.2f}M", "55.68M"),
        "mean routed parameters": (f"{sum(p) / 100 / 1e6:.2f}M", "8.17M"),
        "traffic reduction": (f"{100 * full / sum(p):.1f}x", "6.8x"),
        "client reduction mean": (f"{sum(ratios) / 100:.1f}x", "43.8x"),
        "client reduction median": (f"{(ratios[49] + ratios[50]) / 2:.1f}x", "22.9x"),
        "client reduction max": (f"{ratios[-1]:.1f}x", "111.0x"),
    }
    published = dict(zip(acc.PAPER_ANCHORS, ("0.33/0.50M", "0.72/2.41M", "4.02/10.02M", "7.99/20.61M", "11.78/35.60M")))
    for anchor, paper in published.items():
        specs = affordable(cache, anchor)
        largest = max(range(len(cache)), key=lambda j: (cache.macs[j] <= anchor, cache.macs[j]))
        assert cache.specs[largest] == specs[-1]
        here = f"{cache.params[largest] / 1e6:.2f}/{envelope_params(specs) / 1e6:.2f}M"
        expected[f"deployed/routed params at {anchor / 1e6:g}M MACs"] = (here, paper)
    assert rows == expected
    # the figures the replication matches to the printed digit (Supp. E.4; Table 9's full envelope)
    assert rows["clients affording 1 / 2 / >=3"][0] == "31/6/63"
    assert rows["full supernet parameters"][0] == "55.68M"
    assert rows[f"deployed/routed params at {acc.PAPER_ANCHORS[-1] / 1e6:g}M MACs"][0].endswith("/35.60M")
