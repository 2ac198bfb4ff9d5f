"""SuperFedNAS and DeepFedNAS on FEAST's supernet (FEAST Table 3): MaxNet's schedule and
aggregation by hand, the samplers, and short runs evaluated as FEAST."""

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_lightning.algorithms.supernet.fednas import (ARCH_STREAM, DeepFedNAS, PathSearch, SuperFedNAS, sandwich_roles,
                                            uniform_architecture)
from fl_lightning.config import (BudgetConfig, DataConfig, EvalConfig, FederationConfig, LocalTrainConfig,
                                 PartitionConfig)
from fl_lightning.data import Synthetic
from fl_lightning.elastic.aggregation import SparseAccumulator
from fl_lightning.elastic.maxnet import maxnet_coefficient, maxnet_weights
from fl_lightning.elastic.regions import Full, LeadingSlice
from fl_lightning.elastic.search.cache import VariantCache
from fl_lightning.elastic.search.cost import cost_model
from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.federation.loop import run_fit
from fl_lightning.runtime.seeding import derive_seed, sample_clients
from option_checks import option_refusal

# the narrowed supernet and data of tests/test_feast.py
MODEL = {"class_path": "fl_lightning.elastic.models.OFAResNet", "init_args": {"width_scale": 0.0625, "max_extra_blocks": 1, "divisor": 2}}
DATA = DataConfig(dataset=Synthetic(num_classes=4, image_size=16, num_train=400, num_test=80),
                  val_size=40, calib_size=32)
BUDGETS = BudgetConfig(b_min=1e5, b_max=3e6, b_cap=2e6)
# unconstrained DeepFedNAS's path over the complete supernet, searched cheaply (the narrowed
# supernet's effectiveness is far above FEAST's ceilings, hence rho 1)
SMALL_PATH = PathSearch(targets=8, population=16, generations=10, rho=1.0)


def build_global_model_for_cache():
    from fl_lightning.elastic.models import build_model

    return build_model(MODEL, 4, (3, 16, 16))


def small_cache(tmp_path) -> str:
    """The global minimum and five random architectures (test_feast.py's cache)."""
    model = build_global_model_for_cache()
    g = torch.Generator().manual_seed(3)
    specs = {model.min_spec()} | {model.sample_spec(g) for _ in range(5)}
    cache = VariantCache.from_specs(model, sorted(specs, key=str))
    path = tmp_path / "cache.json"
    cache.save(path)
    return str(path)


def transfer_spec(spec_factory, tmp_path, name, cls, rounds=2, per_round=3, **kwargs):
    cache = kwargs.pop("cache", None) or small_cache(tmp_path)
    if cls is DeepFedNAS:
        kwargs.setdefault("path", SMALL_PATH)
    return spec_factory(
        name=name, algorithm=cls(cache=cache, mix_schedule="none", **kwargs), data=DATA, model=MODEL,
        partition=PartitionConfig(method="iid", num_clients=6, budgets=BUDGETS),
        train=LocalTrainConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-4, grad_clip=10.0),
        federation=FederationConfig(rounds=rounds, clients_per_round=per_round),
        eval=EvalConfig(every=rounds, test="final"))


def rows(spec, file):
    return [json.loads(l) for l in (Path(spec.out_dir) / spec.name / file).read_text().splitlines()]


# -- MaxNet schedule and arithmetic ---------------------------------------------------------------

def maxnet_average(global_state, client_states, regions, weights):
    """One round of MaxNet aggregation: the sparse accumulator with MaxNet's weights."""
    acc = SparseAccumulator(global_state, dense=False)
    for state, region_map, weight in zip(client_states, regions, weights):
        acc.add(state, float(weight), region_map)
    return acc.result()


def test_maxnet_coefficient_is_a_cosine_from_0p9_to_0p125():
    T = 8
    assert maxnet_coefficient(0, T) == pytest.approx(0.9)
    assert maxnet_coefficient(T, T) == pytest.approx(0.125)
    assert maxnet_coefficient(T + 5, T) == pytest.approx(0.125)  # held after the anneal (the originals' min(t, T))
    # by hand: c(t) = 0.125 + (0.9 - 0.125) * (1 + cos(pi t / T)) / 2
    assert maxnet_coefficient(4, T) == pytest.approx(0.125 + 0.775 * 0.5)  # cos(pi/2) = 0: 0.5125
    assert maxnet_coefficient(2, T) == pytest.approx(0.125 + 0.775 * (1 + math.sqrt(0.5)) / 2)  # 0.786504
    assert maxnet_coefficient(6, T) == pytest.approx(0.125 + 0.775 * (1 - math.sqrt(0.5)) / 2)  # 0.238496
    assert maxnet_coefficient(2, T) == pytest.approx(0.786504, abs=1e-6)
    values = [maxnet_coefficient(t, T) for t in range(T + 1)]
    assert all(a > b for a, b in zip(values, values[1:]))


def test_maxnet_weights_give_the_rest_of_the_mass_evenly():
    assert maxnet_weights(2, 0, 0.9) == pytest.approx([0.9, 0.1])
    assert maxnet_weights(3, 1, 0.5) == pytest.approx([0.25, 0.5, 0.25])
    assert maxnet_weights(1, 0, 0.3) == pytest.approx([0.3])
    assert sum(maxnet_weights(10, 7, 0.125)) == pytest.approx(1.0)


def test_maxnet_aggregation_by_hand_on_two_clients():
    """Client A (max role, weight 0.9) holds the leading 3 of 4 entries of ``w`` and all of
    ``b``; client B (weight 0.1) the leading 2 of ``w`` and none of ``b``:
    w[0:2] = 0.9 a + 0.1 b (both cover it, weights sum to 1), w[2] = a (A alone: its value,
    whatever its weight), w[3] = old (nobody), b = A's."""
    old = {"w": torch.tensor([10.0, 20.0, 30.0, 40.0]), "b": torch.tensor([5.0, 5.0]),
           "steps": torch.tensor(7)}
    a = {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([-1.0, 1.0])}
    b = {"w": torch.tensor([11.0, 12.0])}
    regions_a = {"w": ("w", LeadingSlice((4,), (3,))), "b": ("b", Full((2,)))}
    regions_b = {"w": ("w", LeadingSlice((4,), (2,)))}
    new = maxnet_average(old, [a, b], [regions_a, regions_b], maxnet_weights(2, 0, 0.9))
    torch.testing.assert_close(new["w"], torch.tensor([0.9 * 1 + 0.1 * 11, 0.9 * 2 + 0.1 * 12, 3.0, 40.0]))
    torch.testing.assert_close(new["w"], torch.tensor([2.0, 3.0, 3.0, 40.0]))
    torch.testing.assert_close(new["b"], torch.tensor([-1.0, 1.0]))
    assert "steps" not in new  # integer buffers are not averaged (the server keeps its own)


def test_maxnet_normalises_by_the_weights_that_overlap():
    """Three clients, c = 0.5: weights 0.5 (max, A), 0.25 (B), 0.25 (C). Where A and B
    overlap: (0.5 * 1 + 0.25 * 4) / 0.75 = 2; where all three do: 0.5 * 1 + 0.25 * 4 + 0.25 * 8 = 3.5."""
    old = {"w": torch.zeros(3)}
    a = {"w": torch.tensor([1.0, 1.0, 1.0])}
    b = {"w": torch.tensor([4.0, 4.0])}
    c = {"w": torch.tensor([8.0])}
    regions = [{"w": ("w", LeadingSlice((3,), (n,)))} for n in (3, 2, 1)]
    new = maxnet_average(old, [a, b, c], regions, maxnet_weights(3, 0, 0.5))
    torch.testing.assert_close(new["w"], torch.tensor([3.5, 2.0, 1.0]))


# -- samplers -------------------------------------------------------------------------------------

def test_sandwich_roles_go_to_the_least_tracked_clients():
    largest, smallest = [3, 1, 1, 0, 2], [0, 0, 5, 2, 1]
    assert sandwich_roles([0, 1, 2, 4], largest, smallest) == (1, 0)  # tie 1/2 on largest: earlier wins
    assert sandwich_roles([1, 2, 3], largest, smallest) == (3, 1)
    assert sandwich_roles([2], largest, smallest) == (2, None)


def test_uniform_sampler_covers_the_space_and_respects_budgets():
    model = build_global_model_for_cache()
    cost = cost_model(model)
    g = torch.Generator().manual_seed(0)
    free = [uniform_architecture(cost, g) for _ in range(600)]
    # every choice of every gene shows up: the draws range over the whole space
    for l in range(model.num_stages):
        assert {s.d[l] for s in free} == set(range(model.max_extra_blocks[l] + 1))
        assert {s.e[l] for s in free} == set(model.expansions)
    for j in range(model.num_stages + 1):
        assert {s.w[j] for s in free} == set(range(model.max_width_index[j] + 1))
    macs = np.array([cost.spec_macs(s) for s in free])
    budget = float(np.quantile(macs, 0.1))
    assert macs.max() > 3 * budget  # the free draws reach far above it
    g = torch.Generator().manual_seed(1)
    capped = [uniform_architecture(cost, g, budget) for _ in range(300)]
    assert all(cost.spec_macs(s) <= budget for s in capped)
    assert len(set(capped)) > 100  # many different affordable architectures, not one
    # uniform over the affordable set: the share of d[0] = 1 matches the free draws' among affordable ones
    free_affordable = [s for s, m in zip(free, macs) if m <= budget]
    share = lambda specs: np.mean([s.d[0] for s in specs])  # noqa: E731
    assert abs(share(capped) - share(free_affordable)) < 0.25
    assert uniform_architecture(cost, g, budget=1.0, max_draws=2048) is None  # nothing costs 1 MAC


def test_superfednas_constrained_draws_are_affordable(spec_factory, tmp_path):
    spec = transfer_spec(spec_factory, tmp_path, "sfn_c", SuperFedNAS, rounds=1, constrained=True)
    run_fit(spec)
    algorithm = spec.algorithm
    cost = algorithm.cost
    seen = set()
    for round_idx in range(40):
        plan = algorithm.plan(round_idx)
        for task in plan.tasks:
            assert task.choice.macs == cost.spec_macs(task.spec) <= algorithm.budgets[task.client]
            assert not task.choice.fell_back
            if task.choice.role == "random":
                generator = torch.Generator().manual_seed(derive_seed(spec.seed, ARCH_STREAM, round_idx, task.client))
                assert task.spec == uniform_architecture(cost, generator, algorithm.budgets[task.client])
                seen.add(task.spec)
        algorithm.track(plan)
    assert len(seen) > 30


def test_superfednas_unconstrained_ignores_budgets(spec_factory, tmp_path):
    spec = transfer_spec(spec_factory, tmp_path, "sfn_u", SuperFedNAS, rounds=1)
    run_fit(spec)
    algorithm = spec.algorithm
    over, maxed = 0, 0
    for round_idx in range(30):
        plan = algorithm.plan(round_idx)
        for task in plan.tasks:
            over += task.choice.macs > algorithm.budgets[task.client]
            if task.choice.role == "max":
                assert task.spec == algorithm.ctx.model.max_spec()
                maxed += 1
            elif task.choice.role == "min":
                assert task.spec == algorithm.ctx.model.min_spec()
            else:
                generator = torch.Generator().manual_seed(derive_seed(spec.seed, ARCH_STREAM, round_idx, task.client))
                assert task.spec == uniform_architecture(algorithm.cost, generator)
        algorithm.track(plan)
    assert maxed == 30 and over > 0


@pytest.mark.parametrize("constrained", [False, True])
def test_deepfednas_walks_the_pareto_path(spec_factory, tmp_path, constrained):
    """Per round and client: the max role trains the last (most MACs) architecture of its pool,
    the min role the path's first, everyone else pool[randint(|pool|)] from the
    (seed, 51, round, client) generator; the path is the complete-supernet path (unconstrained)
    or the variant cache, the pool the whole path or the affordable prefix (constrained).
    Over the rounds every architecture of the path is visited and the max role rotates
    through the least-tracked clients."""
    spec = transfer_spec(spec_factory, tmp_path, f"dfn_{constrained}", DeepFedNAS, rounds=1, constrained=constrained)
    run_fit(spec)
    algorithm = spec.algorithm
    path = algorithm.cache if constrained else algorithm.path
    n = len(path.specs)
    visited = set()
    for round_idx in range(60):
        largest_before = algorithm.largest.clone()
        plan = algorithm.plan(round_idx)
        assert plan.cohort == sample_clients(spec.seed, round_idx, 6, 3)
        for task in plan.tasks:
            pool = algorithm.sets[task.client] if constrained else list(range(n))
            role = task.choice.role
            if role == "max":
                assert task.spec == path.specs[pool[-1]]
                assert largest_before[task.client] == min(largest_before[c] for c in plan.cohort)
            elif role == "min":
                assert task.spec == path.specs[0]
            else:
                generator = torch.Generator().manual_seed(derive_seed(spec.seed, ARCH_STREAM, round_idx, task.client))
                assert task.spec == path.specs[pool[int(torch.randint(len(pool), (1,), generator=generator))]]
            assert task.choice.macs == path.macs[path.specs.index(task.spec)]
            if constrained:
                assert task.choice.macs <= algorithm.budgets[task.client]
            visited.add(path.specs.index(task.spec))
        assert sorted(t.choice.role for t in plan.tasks) == ["max", "min", "random"]
        algorithm.track(plan)
    reachable = set().union(*map(set, algorithm.sets)) if constrained else set(range(n))
    assert visited == reachable


def test_unconstrained_deepfednas_samples_the_complete_supernet(spec_factory, tmp_path):
    """FEAST Supp. E.2: "The unconstrained variants sample from the complete expanded
    supernet". Unconstrained DeepFedNAS's path runs from the supernet's smallest architecture to
    its largest (MAC-sorted, the interior one searched architecture per equidistant MAC
    target, each within its target), not only over the variant cache: the max role trains the
    whole supernet, and random-role clients draw architectures beyond the cache's largest. The
    path is saved with the run."""
    from fl_lightning.elastic.search.cache import segment_targets

    spec = transfer_spec(spec_factory, tmp_path, "dfn_complete", DeepFedNAS, rounds=1)
    run_fit(spec)
    algorithm = spec.algorithm
    model, cost, cache = algorithm.ctx.model, algorithm.cost, algorithm.cache
    top, bottom = cost.spec_macs(model.max_spec()), cost.spec_macs(model.min_spec())
    assert cache.macs[-1] < top  # the case is one where the cache does not reach the supernet's top

    plans = []
    for round_idx in range(40):
        plans.append(algorithm.plan(round_idx))
        algorithm.track(plans[-1])
    tasks = [t for plan in plans for t in plan.tasks]
    assert all(t.spec == model.max_spec() for t in tasks if t.choice.role == "max")
    assert all(t.spec == model.min_spec() for t in tasks if t.choice.role == "min")
    random_macs = [t.choice.macs for t in tasks if t.choice.role == "random"]
    assert max(random_macs) > cache.macs[-1]

    path = algorithm.path
    assert path.specs[0] == model.min_spec() and path.specs[-1] == model.max_spec()
    assert path.macs == sorted(path.macs) and len(set(path.specs)) == len(path.specs) > 2
    targets = segment_targets(bottom, top, SMALL_PATH.targets)
    for variant in path.variants[1:-1]:
        assert variant.info["target"] in [round(t) for t in targets[1:-1]]
        assert variant.macs <= variant.info["target"]
    saved = VariantCache.load(Path(spec.out_dir) / "dfn_complete" / "path.json", model)
    assert saved.specs == path.specs


# -- runs -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,constrained", [(SuperFedNAS, False), (SuperFedNAS, True),
                                             (DeepFedNAS, False), (DeepFedNAS, True)])
def test_two_round_run_is_evaluated_as_feast(spec_factory, tmp_path, capsys, cls, constrained):
    spec = transfer_spec(spec_factory, tmp_path, "run", cls, constrained=constrained)
    summary = run_fit(spec)
    algorithm = spec.algorithm
    n = len(algorithm.cache.specs)
    final = summary["final"]
    assert all(f"test_variant{j:02d}_acc" in final for j in range(n))
    population = sum(final[f"test_variant{s[-1]:02d}_acc"] for s in algorithm.sets) / len(algorithm.sets)
    assert final["test_acc"] == pytest.approx(population)  # largest-affordable serving, as FEAST
    out = capsys.readouterr().out
    assert f"{cls.__name__} test accuracy" in out and "largest-affordable serving" in out
    metrics = rows(spec, "metrics.jsonl")
    assert [r["maxnet_coefficient"] for r in metrics] == pytest.approx([0.9, 0.125])
    clients = rows(spec, "clients.jsonl")
    for r in range(2):
        cohort = [c for c in clients if c["round"] == r]
        assert sorted(c["role"] for c in cohort) == ["max", "min", "random"]
        weights = {c["role"]: c["maxnet_weight"] for c in cohort}
        c = [0.9, 0.125][r]
        assert weights == pytest.approx({"max": c, "min": (1 - c) / 2, "random": (1 - c) / 2})
        if constrained:
            assert all(c["arch_macs"] <= algorithm.budgets[c["client"]] for c in cohort)
    saved = load_checkpoint(Path(spec.out_dir) / "run" / "checkpoints" / "last.ckpt")["algorithm"]
    assert int(saved["tracking/largest"].sum()) >= 2 and int(saved["tracking/smallest"].sum()) >= 2
    # Eq. 26 with one architecture per client: kappa_fb = 3 x sum of samples x its MACs
    last = [c for c in clients if c["round"] == 1]
    assert metrics[-1]["sum/train_macs"] == pytest.approx(3 * sum(c["samples"] * c["arch_macs"] for c in last), rel=1e-12)


def test_only_the_trained_subnets_positions_move(spec_factory, tmp_path):
    """A constrained DeepFedNAS round changes the positions of the cohort's subnets only."""
    from fl_lightning.data.federated import build_federated_data
    from fl_lightning.federation.builder import build_global_model

    spec = transfer_spec(spec_factory, tmp_path, "sparse", DeepFedNAS, rounds=1, constrained=True)
    run_fit(spec)
    algorithm = spec.algorithm
    before = build_global_model(spec, build_federated_data(spec.data, spec.partition, spec.seed)).state_dict()
    after = load_checkpoint(Path(spec.out_dir) / "sparse" / "checkpoints" / "last.ckpt")["model"]
    covered = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in before.items() if v.is_floating_point()}
    algorithm.largest.zero_()  # round 0's tracking counts, so plan(0) is round 0's plan again
    algorithm.smallest.zero_()
    for task in algorithm.plan(0).tasks:
        for _, (key, region) in algorithm.ctx.model.regions(task.spec).items():
            if key in covered:
                region.fill_add(covered[key], 1.0)
    assert any((c == 0).any() for c in covered.values())
    for key, mask in covered.items():
        assert torch.equal(after[key][mask == 0], before[key][mask == 0]), key


def test_resume_is_bit_exact(spec_factory, tmp_path):
    """The tracking counts are checkpointed: a run stopped after round 1 and resumed plans the
    same roles and ends with the same model as an uninterrupted one."""
    whole = transfer_spec(spec_factory, tmp_path, "whole", SuperFedNAS, rounds=3, constrained=True)
    run_fit(whole)
    part = transfer_spec(spec_factory, tmp_path, "part", SuperFedNAS, rounds=3, constrained=True,
                         cache=whole.algorithm.cache_path)
    part.stop_after = 1
    run_fit(part)
    resumed = copy.copy(part)
    resumed.stop_after = None
    resumed.algorithm = SuperFedNAS(cache=whole.algorithm.cache_path, mix_schedule="none", constrained=True)
    resumed.resume_from = str(Path(part.out_dir) / "part" / "checkpoints" / "last.ckpt")
    run_fit(resumed)
    a = load_checkpoint(Path(whole.out_dir) / "whole" / "checkpoints" / "last.ckpt")
    b = load_checkpoint(Path(part.out_dir) / "part" / "checkpoints" / "last.ckpt")
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for key, value in a["algorithm"].items():
        assert torch.equal(value, b["algorithm"][key]), key
    roles = lambda s: [(r["round"], r["client"], r["role"], r["arch"]) for r in rows(s, "clients.jsonl")]  # noqa: E731
    assert roles(whole) == roles(part)


@pytest.mark.parametrize("kwargs,key", [({"maxnet_init": 0.0}, "algorithm.maxnet_init"),
                                        ({"maxnet_final": 1.5}, "algorithm.maxnet_final"),
                                        ({"maxnet_steps": 0}, "algorithm.maxnet_steps"),
                                        ({"mixup_alpha": -1.0}, "algorithm.mixup_alpha"),
                                        ({"path.targets": 1}, "algorithm.path.targets"),
                                        ({"path.rho": 0.0}, "algorithm.path.rho")])
def test_bad_options_fail_with_the_key(kwargs, key):
    error = option_refusal("DeepFedNAS", **kwargs)
    assert error.key == key and "\n" not in str(error)
