"""FEAST's fixed variant cache: analytic costs equal fvcore's, the constrained genetic search,
the cache file and the budget queries (Supp. B, Eqs. 10, 11, 17, 18)."""

import json

import numpy as np
import pytest
import torch

from fl_lightning.elastic.macs import spec_macs, spec_params
from fl_lightning.elastic.models import build_model
from fl_lightning.elastic.models.ofa_resnet import OFASpec
from fl_lightning.elastic.search import (Fitness, FitnessConfig, InfeasibleError, OFACostModel,
                                         VariantCache, build_cache, cost_model, search, segment_targets)
from fl_lightning.elastic.search.genetic import Problem, evolve, sample_feasible
from fl_lightning.errors import ConfigError
from fl_lightning.feast_protocol import CACHE_SEGMENTS
from fl_lightning.elastic.models import OFAResNet
from hand_counts import bottleneck_params, hooked_macs, make_divisible

NARROW = dict(width_scale=0.125, max_extra_blocks=2, divisor=2)
BOTTLENECK_NARROW = dict(NARROW, block="bottleneck")



@pytest.fixture(scope="module")
def full():
    """FEAST's 55.68M supernet at CIFAR size (the default construction, MACs in the paper's
    convention); on ``meta``, since search needs no weights."""
    with torch.device("meta"):
        return build_model(OFAResNet, 100, (3, 32, 32))


@pytest.fixture(scope="module")
def bottleneck():
    """The bottleneck construction at the same size, counted by :class:`OFACostModel` (fvcore)."""
    with torch.device("meta"):
        return build_model(OFAResNet, 100, (3, 32, 32), block="bottleneck")


def random_specs(model, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [model.min_spec(), model.max_spec()] + [model.sample_spec(g) for _ in range(n)]


# ------------------------------------------------------------------------------------------
# Analytic cost == fvcore (the bottleneck construction; basic_pair: test_deepfednas_golden.py)
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, classes, options", [
    ((3, 32, 32), 10, BOTTLENECK_NARROW),
    ((3, 64, 64), 200, BOTTLENECK_NARROW),  # stride-2 first stage, stem at full resolution
    ((3, 17, 23), 7, dict(block="bottleneck", width_scale=0.25, max_extra_blocks=(1, 2, 0, 1), divisor=4,
                          stem_stride=2)),
])
def test_analytic_cost_equals_fvcore_on_narrowed_models(shape, classes, options):
    model = build_model(OFAResNet, classes, shape, **options)
    cost = OFACostModel(model)
    for spec in random_specs(model, 6, seed=1):
        assert cost.spec_macs(spec) == spec_macs(model, spec, shape), spec
        assert cost.spec_params(spec) == spec_params(model, spec, shape), spec


def test_analytic_cost_at_another_input_size():
    """MACs at an input other than the model's own (strides kept): as fvcore counts them."""
    model = build_model(OFAResNet, 10, (3, 32, 32), **BOTTLENECK_NARROW)
    cost = OFACostModel(model, (3, 48, 40))
    for spec in random_specs(model, 2, seed=2):
        assert cost.spec_macs(spec) == spec_macs(model, spec, (3, 48, 40))


def test_analytic_cost_equals_fvcore_on_full_supernet(bottleneck):
    """A few specs of the full 55.68M supernet, each counted by fvcore on a routed supernet
    whose maxima are the spec (its MACs are the spec's, its tensors far fewer)."""
    full = bottleneck
    cost = cost_model(full)
    assert isinstance(cost, OFACostModel)
    g = torch.Generator().manual_seed(3)
    specs = [full.min_spec(), OFASpec((1, 2, 0, 3), (0.25, 0.1, 0.18, 0.14), (9, 4, 7, 2, 5)),
             OFASpec((4, 7, 7, 8), (0.1, 0.1, 0.1, 0.1), (4, 9, 9, 7, 8)),  # ~594M, a cache top end
             full.sample_spec(g)]
    for spec in specs:
        routed = full.reduced(spec)
        assert cost.spec_macs(spec) == spec_macs(routed, spec, (3, 32, 32)), spec
        assert cost.spec_params(spec) == spec_params(routed, spec, (3, 32, 32)), spec
    # The whole supernet: MACs by hooks on the plain module (meta device, fvcore's convention),
    # parameters from its layer shapes, and the paper's 55.68M.
    with torch.device("meta"):
        largest = full.build_local(full.max_spec(), elastic=False)
    assert cost.spec_macs(full.max_spec()) == hooked_macs(largest, (3, 32, 32))["fvcore"]
    by_hand = bottleneck_params(128, [(256, 64, 9), (512, 128, 9), (1024, 256, 9), (2048, 512, 9)], 100)
    assert cost.spec_params(full.max_spec()) == by_hand and round(by_hand / 1e6, 2) == 55.68


def test_vectorized_cost_matches_single_specs(full):
    cost = cost_model(full)
    specs = random_specs(full, 20, seed=4)
    genes = cost.encode_many(specs)
    assert list(cost.macs(genes)) == [cost.spec_macs(s) for s in specs]
    assert list(cost.params(genes)) == [cost.spec_params(s) for s in specs]
    assert [cost.decode(row) for row in genes] == [full.check_spec(s) for s in specs]


def test_canonical_names_the_same_network(full):
    cost, fitness = cost_model(full), Fitness(cost_model(full))
    genes = cost.encode_many(random_specs(full, 50, seed=6) + [OFASpec((0,) * 4, (0.14, 0.1, 0.25, 0.1), (0,) * 5)])
    canon = cost.canonical(genes)
    assert (canon <= genes).all() and (canon != genes).any()
    assert (cost.macs(canon) == cost.macs(genes)).all() and (cost.params(canon) == cost.params(genes)).all()
    assert np.allclose(fitness.evaluate(canon)[0], fitness.evaluate(genes)[0])
    assert (cost.canonical(canon) == canon).all()


# ------------------------------------------------------------------------------------------
# Fitness and effectiveness
# ------------------------------------------------------------------------------------------

def blocks_of(stage):
    """A stage's conv list split into blocks: [conv1, conv2, conv3, projection], [conv1, conv2, conv3], ..."""
    return [stage[:4]] + [stage[i:i + 3] for i in range(4, len(stage), 3)]


@pytest.mark.parametrize("layers", ["deepfednas", "bottleneck"])
def test_rho_and_entropy_by_hand(bottleneck, layers):
    """rho and the entropy read off the bottleneck's layer list by hand equal the vectorized
    values (basic_pair: test_deepfednas_golden.py, against DeepFedNAS's published values)."""
    cost = cost_model(bottleneck)
    fitness = Fitness(cost, FitnessConfig(layers=layers))
    spec = OFASpec((1, 0, 2, 1), (0.1, 0.25, 0.14, 0.18), (3, 5, 2, 8, 6))
    stage_widths = []
    for stage in cost.stage_layers(spec):
        widths = []
        for block in blocks_of(stage):
            if layers == "bottleneck":
                widths += [conv.c_in * conv.kernel ** 2 for conv in block]
            else:  # DeepFedNAS: 3x3 from the block input, 3x3 from mid, 1x1 projection
                widths += [9 * block[0].c_in, 9 * block[1].c_in] + [conv.c_in for conv in block[3:]]
        stage_widths.append(widths)
    all_widths = [3 * 9] + [w for widths in stage_widths for w in widths]
    expected_rho = len(all_widths) / np.exp(np.mean(np.log(all_widths)))
    assert fitness.spec_rho(spec) == pytest.approx(expected_rho, rel=1e-12)
    volumes = [np.log(h * w * cost.out_channels[l][spec.w[l + 1]]) for l, (h, w) in enumerate(cost.stage_out_hw)]
    expected_entropy = sum(v * np.log(widths).sum() for v, widths in zip(volumes, stage_widths))
    assert fitness.entropy(cost.encode(spec))[0] == pytest.approx(expected_entropy, rel=1e-12)


def test_deeper_narrower_means_higher_rho(full):
    fitness = Fitness(cost_model(full))
    base = OFASpec((2, 2, 2, 2), (0.18,) * 4, (5,) * 5)
    deeper = OFASpec((4, 4, 4, 4), (0.18,) * 4, (5,) * 5)
    narrower = OFASpec((2, 2, 2, 2), (0.18,) * 4, (2,) * 5)
    assert fitness.spec_rho(deeper) > fitness.spec_rho(base) < fitness.spec_rho(narrower)


# ------------------------------------------------------------------------------------------
# Genetic search
# ------------------------------------------------------------------------------------------

def test_search_respects_limits_and_is_deterministic(full):
    kwargs = dict(population=32, generations=25, seed=7)
    fitness = Fitness(cost_model(full))
    # At 25M MACs the unconstrained optimum is deeper/narrower than rho <= 0.25 allows.
    free = search(full, 25e6, float("inf"), **kwargs)
    assert fitness.spec_rho(free.spec) > 0.25
    first = search(full, 25e6, 0.25, **kwargs)
    assert search(full, 25e6, 0.25, **kwargs) == first
    spec, macs, fit = first
    assert macs <= 25e6 and macs == cost_model(full).spec_macs(spec)
    assert fitness.spec_rho(spec) <= 0.25
    assert fit == pytest.approx(fitness.spec_fitness(spec))


@pytest.mark.parametrize("block, convention", [("basic_pair", "paper"), ("bottleneck", "fvcore")])
def test_search_limits_hold_on_the_module_of_a_narrowed_model(block, convention):
    """The found subnet, counted by hooks on its extracted module in its construction's
    convention, costs what the search says and fits the limit."""
    model = build_model(OFAResNet, 10, (3, 32, 32), **dict(NARROW, block=block))
    fitness = Fitness(cost_model(model))
    limit, rho = 5e6, 1.5
    spec, macs, _ = search(model, limit, rho, population=24, generations=15, seed=0)
    assert hooked_macs(model.extract(spec).module, (3, 32, 32))[convention] == macs <= limit
    assert fitness.spec_rho(spec) <= rho


def test_every_individual_stays_feasible(full):
    cost = cost_model(full)
    problem = Problem(cost, Fitness(cost), 40e6, 0.40)
    pop = sample_feasible(problem, 200, np.random.default_rng(0))
    assert len(pop) == 200
    ok, _, macs = problem.evaluate(pop)
    assert ok.all() and (macs <= 40e6).all()
    assert len({tuple(row) for row in pop}) > 100  # varied, not one repaired point


def test_ga_beats_random_feasible_sampling(full):
    """Same number of fitness evaluations: evolution finds fitter architectures."""
    cost = cost_model(full)
    problem = Problem(cost, Fitness(cost), 150e6, 0.31)
    population, generations = 32, 30
    _, ga_best, _ = evolve(problem, population, generations, seed=0)
    randoms = sample_feasible(problem, population * (generations + 1), np.random.default_rng(0))
    random_best = problem.evaluate(randoms)[1].max()
    assert ga_best > random_best


def test_impossible_limit_raises(full):
    with torch.device("meta"):
        smallest = hooked_macs(full.build_local(full.min_spec(), elastic=False), (3, 32, 32))["paper"]
    with pytest.raises(InfeasibleError):
        search(full, smallest - 1, 0.40, population=8, generations=2)  # below the smallest subnet
    assert search(full, smallest, 0.40, population=8, generations=2).macs == smallest


# ------------------------------------------------------------------------------------------
# Cache
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_cache(full):
    specs = random_specs(full, 12, seed=5)
    return VariantCache.from_specs(full, specs)


def test_cache_is_mac_sorted(small_cache):
    assert small_cache.macs == sorted(small_cache.macs)
    assert small_cache.global_min() == 0


def test_affordable_sets_are_nested(small_cache):
    budgets = sorted([0.0, 5e6, 1e8, 3e8, 8e8, 1.5e9, 3e9] + small_cache.macs)
    sets = [set(small_cache.affordable(b)) for b in budgets]
    for b, a in zip(budgets, sets):
        assert a == {i for i, m in enumerate(small_cache.macs) if m <= b}  # Eq. 11, inclusive
    for smaller, larger in zip(sets, sets[1:]):
        assert smaller <= larger


def test_endpoints_and_intermediates(small_cache):
    macs = small_cache.macs
    for budget in macs + [m + 1 for m in macs]:
        top = small_cache.local_max(budget)
        assert top == small_cache.largest_affordable(budget) == max(small_cache.affordable(budget))
        inter = small_cache.intermediates(budget)
        assert all(macs[0] < macs[i] < macs[top] for i in inter)
        assert set(inter) == {i for i in small_cache.affordable(budget) if macs[0] < macs[i] < macs[top]}
    assert small_cache.intermediates(macs[0]) == []
    assert small_cache.largest_affordable(macs[0] - 1) is None
    with pytest.raises(ValueError, match="affords no cached variant"):
        small_cache.local_max(macs[0] - 1)


def test_save_load_roundtrip(tmp_path, full, small_cache):
    path = tmp_path / "cache.json"
    small_cache.save(path)
    data = json.loads(path.read_text())
    assert set(data) >= {"input_shape", "num_classes", "model", "variants"}
    assert set(data["variants"][0]) >= {"d", "e", "w", "macs", "params"}
    loaded = VariantCache.load(path, full)
    assert loaded.specs == small_cache.specs
    assert loaded.macs == small_cache.macs and loaded.params == small_cache.params
    assert list(tmp_path.iterdir()) == [path]  # no temporary left behind


def test_load_rejects_an_incompatible_model(tmp_path, full, small_cache):
    path = tmp_path / "cache.json"
    small_cache.save(path)
    with torch.device("meta"):
        narrow = build_model(OFAResNet, 100, (3, 32, 32), width_scale=0.5)
        tiny_imagenet = build_model(OFAResNet, 200, (3, 64, 64))
    with pytest.raises(ConfigError, match="stem_channels: cache 64, model 32"):  # 64 x width_scale 0.5
        VariantCache.load(path, narrow)
    with pytest.raises(ConfigError, match="stem_stride: cache 1, model 2"):  # 64 px: a stride-2 stem
        VariantCache.load(path, tiny_imagenet)
    # Retargeting recomputes the MACs for the other input and head (Supp. B.1), and then it
    # loads: the stride-2 stem gives every layer its 32 px cost, the head 100 more outputs of
    # the last stage's width md(1024 x m[w_4]).
    retargeted = small_cache.retarget(tiny_imagenet)
    assert retargeted.macs == sorted(retargeted.macs)
    before = dict(zip(small_cache.specs, small_cache.macs))
    for spec, macs in zip(retargeted.specs, retargeted.macs):
        assert macs - before[spec] == 100 * make_divisible(1024 * round(0.1 * (spec.w[4] + 1), 1)), spec
    retargeted.save(path)
    assert VariantCache.load(path, tiny_imagenet).specs == retargeted.specs


def test_load_rejects_stale_costs_and_bad_files(tmp_path, full, small_cache):
    path = tmp_path / "cache.json"
    data = small_cache.to_dict()
    data["variants"][3]["macs"] += 1
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="variant 3"):
        VariantCache.load(path, full)
    path.write_text('{"variants": []}')
    with pytest.raises(ConfigError, match="not a variant cache"):
        VariantCache.load(path)
    with pytest.raises(ConfigError, match="cannot read"):
        VariantCache.load(tmp_path / "missing.json")


def test_segment_targets():
    geometric = segment_targets(50e6, 596e6, 50, "geometric")
    assert len(geometric) == 50 and geometric[0] == pytest.approx(50e6) and geometric[-1] == pytest.approx(596e6)
    ratios = np.array(geometric[1:]) / np.array(geometric[:-1])
    assert np.allclose(ratios, ratios[0])
    assert np.allclose(np.diff(segment_targets(25e6, 75e6, 6)), 10e6)  # linear, the default
    # Supp. Table 1: 50M-596M x 50 at rho_0 0.31, the 25M-75M extension x 6 at 0.40; 56 in all
    assert [tuple(seg) for seg in CACHE_SEGMENTS] == [(50e6, 596e6, 50, 0.31), (25e6, 75e6, 6, 0.40)]
    assert sum(count for _, _, count, _ in CACHE_SEGMENTS) == 56


def test_build_cache_spans_the_requested_range(full):
    low, high = 30e6, 300e6
    cache = build_cache(full, segments=[(low, high, 6, 0.31), (20e6, 40e6, 2, 0.40)],
                        population=24, generations=20, seed=0)
    assert cache.macs == sorted(cache.macs)
    assert len(set(cache.specs)) == len(cache) == 8 - cache.search["duplicates"]
    assert cache.macs[0] <= 20e6 and cache.macs[-1] <= high
    assert cache.macs[-1] > 0.9 * high  # the top target is met closely
    fitness = Fitness(cost_model(full))
    for v in cache.variants:
        assert v.macs <= v.info["target"] + 1 and fitness.spec_rho(v.spec) <= v.info["rho_limit"]


def test_build_cache_tool(tmp_path, capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "tools" / "build_cache.py"
    spec = importlib.util.spec_from_file_location("build_cache_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "c.json"
    rc = tool.main(["--model-kwargs", json.dumps(NARROW), "--num-classes", "10", "--segments",
                    "[[1e6, 8e6, 3, 2.0]]", "--population", "16", "--generations", "5", "--output", str(out),
                    "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "MACs" in printed and "built in" in printed
    model = build_model(OFAResNet, 10, (3, 32, 32), **NARROW)
    assert len(VariantCache.load(out, model)) >= 1
    assert tool.main(["--segments", "[[1, 2]]", "--output", str(out)]) == 2


def test_shipped_quickstart_cache_equals_a_fresh_search():
    """The quick start loads its cache instead of searching at start-up: the file must be what
    the config's own search settings build for the config's supernet."""
    import pathlib

    import yaml

    from fl_lightning.algorithms.supernet.cached_variants import CacheSearch

    root = pathlib.Path(__file__).parents[1]
    config = yaml.safe_load((root / "configs" / "quickstart.yaml").read_text())
    args = config["algorithm"]["init_args"]
    data = config["data"]["dataset"]["init_args"]
    shape = (data["channels"], data["image_size"], data["image_size"])
    with torch.device("meta"):
        model = build_model(config["model"], data["num_classes"], shape)
    shipped = VariantCache.load(root / args["cache"], model)  # also checks model, MACs and parameters
    search = CacheSearch(**args["search"])
    fresh = build_cache(model, shape, [tuple(s) for s in search.segments], search.population, search.generations,
                        search.mutation, search.seed)
    assert shipped.specs == fresh.specs
    assert shipped.macs == fresh.macs and shipped.params == fresh.params
