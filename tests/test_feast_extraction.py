"""Post-hoc extraction's search (FEAST Supp. E.3) set up from the run's own cache: the ceiling of
the segment that built the variants around the budget, the cache's objective and seed, the
cached variants as the answer at their own budgets and as the search's starting points, and the
genes searched within the range the cache spans."""

from pathlib import Path

import numpy as np
import pytest

from fl_lightning.elastic.search.cache import VariantCache
from fl_lightning.elastic.search.cost import DeepFedNASArch, cost_model
from fl_lightning.algorithms.supernet.extraction_search import (cache_ceiling, cached_answer, extraction_architecture,
                                                    extraction_search, gene_distance, nearest_distance,
                                                    trained_bounds)
from fl_lightning.elastic.search.fitness import Fitness
from fl_lightning.elastic.search.genetic import Problem, evolve, sample_feasible
from fl_lightning.feast_protocol import EXTRACTION_POPULATION, SEARCH_GENERATIONS

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "caches" / "quickstart.json"
PAPER = ROOT / "configs" / "caches" / "feast_cifar100.json"


def load(path):
    cache = VariantCache.load(path)
    return cache, cost_model(DeepFedNASArch.from_dict(cache.model_options), cache.input_shape)


def test_the_ceiling_is_the_papers_rule_on_the_papers_cache():
    """Supp. E.3: "rho_0 = 0.40 below 50M MACs and rho_0 = 0.31 otherwise", read off the shipped
    paper-scale cache's own segments (25M-75M at 0.40, 50M-596M at 0.31, overlapping)."""
    cache, _ = load(PAPER)
    for budget, expected in ((10e6, 0.40), (25e6, 0.40), (35e6, 0.40), (49e6, 0.40), (50e6, 0.31),
                             (60e6, 0.31), (74e6, 0.31), (229e6, 0.31), (596e6, 0.31)):
        assert cache_ceiling(cache, budget) == expected, budget


def test_the_ceiling_at_each_cached_variant_is_the_one_it_was_built_under():
    """The quick start's cache: 0.40 for its 0.2M variant (the low-compute target), 0.25 for the
    four main-segment variants from 0.49M on. The paper's absolute rule (0.40 below 50M) gives
    0.40 to all five, and the search then spends a fraction of the budget (the review's d=1101)."""
    cache, _ = load(QUICKSTART)
    assert [cache_ceiling(cache, m) for m in cache.macs] == [0.40, 0.25, 0.25, 0.25, 0.25]
    assert [v.info["rho_limit"] for v in cache.variants] == [0.40, 0.25, 0.25, 0.25, 0.25]
    assert cache_ceiling(cache, 0.1e6) == 0.40  # below every segment: the cheapest one's
    assert cache_ceiling(cache, 0.45e6) == 0.40  # below the main segment's first variant (0.494M)


def test_settings_come_from_the_caches_search_and_can_be_overridden():
    cache, _ = load(QUICKSTART)
    provenance = dict(cache.search, seed=7, mutation=0.5,
                      fitness={**cache.search["fitness"], "effectiveness_weight": 10.0})
    other = VariantCache(cache.variants, cache.input_shape, cache.num_classes, cache.model_options, provenance)
    settings = extraction_search(other, 1e6)
    assert (settings.seed, settings.mutation, settings.fitness.effectiveness_weight) == (7, 0.5, 10.0)
    assert settings.rho_limit == 0.25 and settings.space == "trained"
    assert settings.start == tuple(cache.specs)
    forced = extraction_search(other, 1e6, rho=0.3, seed=2, space="full")
    assert (forced.rho_limit, forced.seed, forced.space) == (0.3, 2, "full")
    bare = VariantCache.from_specs(DeepFedNASArch.from_dict(cache.model_options), cache.specs)
    assert extraction_search(bare, 1e6).rho_limit == 0.40  # no provenance: the paper's rule (1M < 50M)
    assert extraction_search(bare, 1e6).seed == 0


def test_extraction_at_each_cached_variants_budget_returns_that_variant():
    """With every default (the population and generations of `extract`), the budget of each
    cached variant's own MACs gives back that variant, so it scores exactly what FEAST serves."""
    cache, cost = load(QUICKSTART)
    for index, macs in enumerate(cache.macs):
        settings = extraction_search(cache, macs)
        found, answered = extraction_architecture(cost, cache, macs, settings, EXTRACTION_POPULATION,
                                                  SEARCH_GENERATIONS)
        assert found.spec == cache.specs[index] and found.macs == macs and answered == index


def test_the_cache_answers_only_where_its_own_search_did():
    """Between a variant's MACs and its target, under the ceiling it was searched with; not
    beyond the target, not under another ceiling, not for a cache without targets."""
    cache, cost = load(QUICKSTART)
    v = cache.variants[3]  # 3,162,400 MACs, target 3,166,667, ceiling 0.25
    assert cached_answer(cache, v.macs, 0.25) == 3
    assert cached_answer(cache, v.info["target"], 0.25) == 3
    assert cached_answer(cache, v.info["target"] + 1, 0.25) is None
    assert cached_answer(cache, v.macs, 0.3) is None
    assert cached_answer(cache, 0.1e6, 0.4) is None  # nothing affordable
    bare = VariantCache.from_specs(cost, cache.specs)
    assert cached_answer(bare, v.macs, 0.25) is None


@pytest.mark.parametrize("space", ["trained", "full"])
def test_the_search_is_never_less_fit_than_a_cached_variant_that_fits(space):
    """Just above each cached variant's target (where the search runs), a deliberately weak
    search (8 x 3) still returns at least the fitness of every cached variant within both limits;
    at 0.2M + 1 MAC the ceiling 0.40 leaves a region the random draws do not reach (the search
    without its start raised "no architecture ... was found")."""
    cache, cost = load(QUICKSTART)
    fitness = Fitness(cost)
    for v in cache.variants:
        budget = v.info["target"] + 1
        settings = extraction_search(cache, budget, space=space)
        found, answered = extraction_architecture(cost, cache, budget, settings, 8, 3)
        assert answered is None and found.macs <= budget
        assert fitness.spec_rho(found.spec) <= settings.rho_limit
        fits = [fitness.spec_fitness(u.spec) for u in cache.variants
                if u.macs <= budget and fitness.spec_rho(u.spec) <= settings.rho_limit]
        assert fits and found.fitness >= max(fits) - 1e-9
        assert found.fitness == pytest.approx(fitness.spec_fitness(found.spec), abs=1e-9)


def test_the_trained_space_keeps_every_gene_within_the_cached_range():
    """space=trained: every gene of the result between the smallest and largest value the cached
    variants hold at that position (by hand from the cache file: stems of width index 1-7)."""
    cache, cost = load(QUICKSTART)
    lower, upper = trained_bounds(cost, cache.specs)
    assert lower[8:].tolist() == [1, 0, 2, 2, 1] and upper[8:].tolist() == [7, 9, 9, 9, 9]  # widths
    assert lower[:4].tolist() == [0, 0, 0, 1] and upper[:4].tolist() == [1, 1, 1, 1]  # depths
    for budget in np.geomspace(0.25e6, 4.4e6, 6):
        settings = extraction_search(cache, budget)
        found, _ = extraction_architecture(cost, cache, budget, settings, 32, 20)
        genes = cost.encode(found.spec)
        assert np.all(genes >= lower) and np.all(genes <= upper), (budget, found.spec)


def test_gene_bounds_hold_through_sampling_repair_and_mutation():
    """A problem with bounds: random draws, repairs, crossovers and mutations stay inside them."""
    _, cost = load(QUICKSTART)
    lower = np.array([0, 0, 1, 1, 0, 0, 0, 0, 2, 3, 3, 2, 1])
    upper = np.array([1, 1, 1, 1, 2, 2, 2, 2, 6, 8, 8, 7, 9])
    problem = Problem(cost, Fitness(cost), 3e6, 0.3, lower, upper)
    pop = sample_feasible(problem, 200, np.random.default_rng(0))
    assert len(pop) == 200 and np.all(pop >= lower) and np.all(pop <= upper)
    for seed in range(3):
        genes, _, _ = evolve(problem, 16, 10, mutation=1.0, seed=seed)
        assert np.all(genes >= lower) and np.all(genes <= upper)
    with pytest.raises(ValueError, match="gene bounds"):
        Problem(cost, Fitness(cost), 3e6, 0.3, upper, lower)


def test_a_start_outside_the_limits_is_not_used():
    """A start genome over the MAC limit never enters the population: the result fits."""
    _, cost = load(QUICKSTART)
    problem = Problem(cost, Fitness(cost), 1e6, 0.4)
    large = cost.upper[None, :]
    genes, _, macs = evolve(problem, 8, 2, seed=0, start=large)
    assert macs <= 1e6 and cost.macs(genes)[0] == macs


def test_gene_distance_counts_differing_positions():
    """By hand: d=0011 e=(.1,.1,.1,.1) w=10221 against d=0001 ... w=10221 (one depth) and against
    d=1111 ... w=16648 (two depths, four widths)."""
    found = {"d": [0, 0, 1, 1], "e": [0.1] * 4, "w": [1, 0, 2, 2, 1]}
    small = {"d": [0, 0, 0, 1], "e": [0.1] * 4, "w": [1, 0, 2, 2, 1]}
    large = {"d": [1, 1, 1, 1], "e": [0.1, 0.1, 0.1, 0.1], "w": [1, 6, 6, 4, 8]}
    assert gene_distance(found, small) == 1 and gene_distance(found, large) == 6
    assert gene_distance(found, {**large, "e": [0.14, 0.1, 0.1, 0.1]}) == 7
    assert nearest_distance(found, [large, small]) == 1


def test_the_distance_tool_on_the_quick_start_cache(capsys):
    """tools/extraction_distances.py at the cached variants' own MACs: every budget answered by
    its variant (0 genes); at 0.2M + 1 MAC, as published (no reuse), nothing is found."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    import extraction_distances as tool

    assert tool.main([str(QUICKSTART), "--budgets", "197272", "494028", "1751100", "3162400", "4456960"]) == 0
    out = capsys.readouterr().out
    assert out.count("(cached variant, no search)") == 5
    assert "5 of 5 budgets found: mean 0.00 genes from the nearest cached variant; 5 at 0 genes, 5 within 1 gene" in out
    assert tool.main([str(QUICKSTART), "--budgets", "197273", "--no-reuse-cache", "--space", "full",
                      "--population", "16", "--generations", "2"]) == 0
    assert "(no architecture found)" in capsys.readouterr().out


@pytest.mark.parametrize("make, expected", [
    (lambda tmp: tmp / "nowhere.json", "cache: "),
    (lambda tmp: _bottleneck_cache(tmp), "not a cache of the DeepFedNAS construction"),
])
def test_the_distance_tool_refuses_what_it_cannot_search(tmp_path, capsys, make, expected):
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    import extraction_distances as tool

    with pytest.raises(SystemExit) as refused:
        tool.main([str(make(tmp_path)), "--budgets", "1e6"])
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and out == "" and len(err.strip().splitlines()) == 1 and expected in err


def _bottleneck_cache(tmp_path):
    from fl_lightning.elastic.models import build_model

    model = build_model({"class_path": "fl_lightning.elastic.models.OFAResNet",
                         "init_args": {"block": "bottleneck", "width_scale": 0.0625, "max_extra_blocks": 1,
                                       "divisor": 2}}, 4, (3, 16, 16))
    path = tmp_path / "bottleneck.json"
    VariantCache.from_specs(model, [model.min_spec()]).save(path)
    return path
