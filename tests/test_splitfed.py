"""SplitFed and FedSGA through the federation loop: equivalences with FedAvg, the bytes at the
cut, private prompts, calibration and the estimator, exact resume, bad options."""

import json
from pathlib import Path

import pytest
import torch

from fl_lightning.algorithms import FedAvg, FedSGA, SplitFed
from fl_lightning.config import BudgetConfig, FederationConfig, LocalTrainConfig, PartitionConfig
from fl_lightning.elastic.models import build_model
from fl_lightning.errors import ConfigError
from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.federation.loop import run_fit
from fl_lightning.elastic.models import ResNet18
from option_checks import option_refusal

RESNET = {"class_path": "fl_lightning.elastic.models.ResNet18", "init_args": {"width": 0.125}}
VIT = {"class_path": "fl_lightning.elastic.models.ViT", "init_args": {"patch_size": 2, "embed_dim": 16, "depth": 4, "num_heads": 2}}
TRAIN = LocalTrainConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9)
# one local step a client: for tests of what a client keeps or where it is cut, not of training
ONE_STEP = LocalTrainConfig(steps=1, batch_size=16, lr=0.05, momentum=0.9)


STATISTICS = ("running_mean", "running_var", "num_batches_tracked")

def rows(spec, name):
    return [json.loads(line) for line in (Path(spec.out_dir) / spec.name / name).read_text().splitlines()]


def saved(spec):
    return load_checkpoint(Path(spec.out_dir) / spec.name / "checkpoints" / "last.ckpt")


def assert_same_model(a, b):
    """Two float32 code paths of the same arithmetic: a few ulp per operation over a few hundred
    steps stay well inside 1e-4 relative, 1e-5 absolute (parameters are O(0.1-1))."""
    for key, value in a.items():
        if value.is_floating_point():
            assert torch.allclose(value.double(), b[key].double(), rtol=1e-4, atol=1e-5), key
        else:
            assert torch.equal(value, b[key]), key



@pytest.mark.parametrize("model", [RESNET, VIT], ids=["resnet", "vit"])
def test_splitfed_v1_is_fedavg_with_a_cut(spec_factory, model):
    """Both halves step SGD on the gradients of the unsplit model, so a V1 round is a FedAvg
    round (an independent code path): only the traffic differs (running statistics tracked and
    averaged on both sides, so they are compared too)."""
    fed = FederationConfig(rounds=2, clients_per_round=3)
    cut = "layer2.1" if model is RESNET else "block1"
    split = spec_factory(name="split", algorithm=SplitFed(cut=cut, bn="aggregated"), model=model, train=TRAIN,
                         federation=fed)
    plain = spec_factory(name="plain", algorithm=FedAvg(), model=model, train=TRAIN, federation=fed)
    run_fit(split)
    run_fit(plain)
    assert_same_model(saved(split)["model"], saved(plain)["model"])


def test_splitfed_v2_steps_one_server_half_client_by_client(spec_factory):
    """Round 0 of V2 recomputed by hand: the server half takes each client's step in the plan's
    (shuffled) order, each client's front sees the server half as the previous client left
    it, and only the fronts are averaged."""
    import copy

    import torch.nn.functional as F
    from lightning.fabric import Fabric

    from fl_lightning.federation.loop import Federation
    from fl_lightning.federation.run_dir import RunDir
    from fl_lightning.runtime.seeding import client_generator

    cut, lr = "layer2.0", 0.1
    spec = spec_factory(name="v2", algorithm=SplitFed(cut=cut, version="v2", bn="aggregated"), model=RESNET,
                        train=LocalTrainConfig(steps=1, batch_size=8, lr=lr),
                        federation=FederationConfig(rounds=1, clients_per_round=4))
    fed = Federation(Fabric(accelerator="cpu", devices=1), spec, RunDir(spec.out_dir, spec.name))
    fed._open_outputs()
    ctx = fed.ctx
    plan = fed.algorithm.plan(0)
    assert plan.cohort != sorted(plan.cohort)  # this seed's order is shuffled
    # the reference in float64, so only the run's own float32 rounding separates the two
    server = copy.deepcopy(ctx.model).double()
    fronts, sizes = [], []
    for client in plan.cohort:
        local = copy.deepcopy(ctx.model).double()
        front, _ = local.split(cut)
        _, back = server.split(cut)
        x, y = next(ctx.shards[client].steps(1, client_generator(ctx.seed, 0, client)))
        F.cross_entropy(back(front(x.double())), y).backward()
        with torch.no_grad():
            for p in list(front.parameters()) + list(back.parameters()):
                p -= lr * p.grad
                p.grad = None
        fronts.append(local.state_dict())
        sizes.append(len(ctx.shards[client]))
    fed.run_round(0)
    from fl_lightning.elastic.split import split_keys
    front_keys, back_keys = split_keys(ctx.model, cut)
    total = sum(sizes)
    for key in front_keys:
        if fed.algorithm.global_state[key].is_floating_point():
            expected = sum(n * f[key].double() for n, f in zip(sizes, fronts)) / total
            assert torch.allclose(fed.algorithm.global_state[key].double(), expected, rtol=1e-4, atol=1e-5), key
    for key in back_keys:
        if fed.algorithm.global_state[key].is_floating_point():
            assert torch.allclose(fed.algorithm.global_state[key].double(), server.state_dict()[key],
                                  rtol=1e-4, atol=1e-5), key


def test_v2_round_zero_with_one_client_matches_fedavg(spec_factory):
    fed = FederationConfig(rounds=1, clients_per_round=1)
    v2 = spec_factory(name="v2", algorithm=SplitFed(cut="layer3.0", version="v2", bn="aggregated"), model=RESNET,
                      train=TRAIN, federation=fed)
    plain = spec_factory(name="plain", model=RESNET, train=TRAIN, federation=fed)
    run_fit(v2)
    run_fit(plain)
    assert_same_model(saved(v2)["model"], saved(plain)["model"])


def test_bytes_at_the_cut_are_the_tensor_sizes(spec_factory):
    spec = spec_factory(name="bytes", algorithm=SplitFed(cut="layer2.0"), model=RESNET,
                        train=LocalTrainConfig(epochs=2, batch_size=16, lr=0.05),
                        federation=FederationConfig(rounds=1, clients_per_round=3))
    run_fit(spec)
    model = build_model(ResNet18, 10, (1, 8, 8), width=0.125)
    activation = model.forward_until(torch.zeros(1, 1, 8, 8), "layer2.0")
    per_example = activation.numel() * 4
    # the front's tensors but its BN statistics (static BN, the default: tracked by nobody, never sent)
    front = [k for k, v in model.state_dict().items()
             if k.startswith(("stem.", "layer1.", "layer2.0.")) and not k.endswith(STATISTICS)]
    model_bytes = sum(model.state_dict()[k].numel() * model.state_dict()[k].element_size() for k in front)
    for row in rows(spec, "clients.jsonl"):
        examples = 2 * row["samples"]
        assert row["cut_bytes_down"] == examples * per_example
        assert row["cut_bytes_up"] == examples * (per_example + 8)  # int64 labels go up too
        assert row["model_bytes_up"] == row["model_bytes_down"] == model_bytes
        assert row["bytes_up"] == row["cut_bytes_up"] + model_bytes


def fedsga(**kw):
    options = dict(calibration_every=2, probe_size=8, prompt_width=1)
    options.update(kw)
    return FedSGA(**options)


def test_fedsga_calibrates_trains_the_estimator_and_adapts_cuts(shared_run):
    """On test_fedsga's FedSGA reference run (shared; calibration every 2 rounds, 4 rounds):
    calibrations in every odd round, the estimator deciding from the first one on."""
    from test_fedsga import reference

    spec = reference(shared_run, "fedsga")
    assert spec.algorithm.calibration_every == 2 and spec.federation.rounds >= 4
    calibration_rounds = set(range(1, spec.federation.rounds, 2))
    clients = rows(spec, "clients.jsonl")
    metrics = rows(spec, "metrics.jsonl")
    calibrated = [m for m in metrics if "calibration/frac_sufficient" in m]
    assert {m["round"] for m in calibrated} == calibration_rounds
    assert all("estimator/bce" in m and "calibration/probe_loss_p1" in m for m in calibrated)
    assert not any("sufficient" in r for r in clients)  # the server labels, from the probe interfaces
    # rounds 0-1 split at p_ref; afterwards the estimator decides and logs r
    assert all(r["cut"] == 1 for r in clients if r["round"] <= 1)
    assert all("r" in r for r in clients if r["round"] >= 2)
    for r in clients:
        assert 0.0 <= r["alignment"] <= 1.0 and -1.0 <= r["stability"] <= 1.0 and 0.0 <= r["prompt_variation"] <= 1.0


def test_prompts_stay_private(spec_factory):
    spec = spec_factory(name="sga", algorithm=fedsga(split_strategy="static"), model=RESNET, train=ONE_STEP,
                        federation=FederationConfig(rounds=2, clients_per_round=6))
    run_fit(spec)
    state = saved(spec)
    model = build_model(ResNet18, 10, (1, 8, 8), width=0.125)
    assert set(state["model"]) == set(model.state_dict())  # nothing of the prompts in the global model
    prompts = [v for k, v in state["algorithm"].items() if k.endswith("/prompt")]
    assert len(prompts) == 6 and all(p.abs().sum() > 0 for p in prompts)
    # each client kept its own: an aggregated prompt would be the same for all
    assert all(not torch.allclose(prompts[0], p) for p in prompts[1:])


@pytest.mark.parametrize("options, key", [
    (dict(candidates=["layer1.1"]), "algorithm.candidates"),
    (dict(candidates=["layer2.1", "layer1.1"]), "algorithm.candidates"),
    (dict(candidates=["layer1.1", "fc"]), "algorithm.candidates"),
    (dict(candidates=["layer1.1", "layer4.1"]), "algorithm.candidates"),
    (dict(static_cut="layer3.0"), "algorithm.static_cut"),
    (dict(respect_budgets=True), "algorithm.respect_budgets"),
])
def test_bad_fedsga_options_are_refused_before_training(spec_factory, options, key):
    # budgets of 0.1-0.15M MACs: below the 0.157M MACs of this model's shallowest front
    partition = PartitionConfig(method="dirichlet", num_clients=6, alpha=0.5,
                                budgets=BudgetConfig(b_min=1e5, b_max=1.5e5, b_cap=1.5e5))
    spec = spec_factory(name="bad", algorithm=FedSGA(**options), model=RESNET, train=TRAIN, partition=partition)
    with pytest.raises(ConfigError) as error:
        run_fit(spec)
    assert error.value.key == key
    assert not (Path(spec.out_dir) / spec.name / "checkpoints").exists()


def test_budgets_cap_the_cut(spec_factory):
    """Budgets between the first (0.157M MACs) and second (0.291M) fronts: whatever the
    strategy draws, every client stays at p1."""
    partition = PartitionConfig(method="dirichlet", num_clients=6, alpha=0.5,
                                budgets=BudgetConfig(b_min=2e5, b_max=2.5e5, b_cap=2.5e5))
    spec = spec_factory(name="poor", algorithm=fedsga(split_strategy="random", respect_budgets=True), model=RESNET,
                        train=ONE_STEP, partition=partition, federation=FederationConfig(rounds=2, clients_per_round=6))
    run_fit(spec)
    assert {r["cut"] for r in rows(spec, "clients.jsonl")} == {0}
    rich = spec_factory(name="rich", algorithm=fedsga(split_strategy="random", respect_budgets=False), model=RESNET,
                        train=ONE_STEP,
                        partition=partition, federation=FederationConfig(rounds=2, clients_per_round=6))
    run_fit(rich)
    assert len({r["cut"] for r in rows(rich, "clients.jsonl")}) > 1


@pytest.mark.parametrize("algorithm, options, key", [
    ("FedSGA", dict(rho=-1), "algorithm.rho"),
    ("FedSGA", dict(split_strategy="deepest"), "algorithm.split_strategy"),
    ("FedSGA", dict(num_prompts=0), "algorithm.num_prompts"),
    ("FedSGA", dict(probe_size=1), "algorithm.probe_size"),
    ("FedSGA", dict(readout="head"), "algorithm.readout"),
    ("SplitFed", dict(version="v3"), "algorithm.version"),
    ("SplitFed", dict(server_optimizer="fresh"), "algorithm.server_optimizer"),
])
def test_bad_option_values(algorithm, options, key):
    error = option_refusal(algorithm, **options)
    assert error.key == key


@pytest.mark.parametrize("fresh", [True, False])
def test_a_per_batch_server_optimizer_keeps_no_momentum(fresh):
    """Two server steps with gradients g1, g2 (lr 0.1, momentum 0.9, weight decay 0.01), by hand:
    made afresh per batch, each step is plain SGD, w2 = w1 - lr (g2 + wd w1); carried, the second
    step adds 0.9 (g1 + wd w0): w2 = [0.968051, -1.926102] against [0.922151, -1.834302]."""
    from lightning.fabric import Fabric
    from torch import nn

    from fl_lightning.modules.split import make_pair

    cfg = LocalTrainConfig(lr=0.1, momentum=0.9, weight_decay=0.01)
    w = nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    pair = make_pair(Fabric(accelerator="cpu", devices=1), cfg, client_forward=None, server_loss=None,
                     client_module=nn.Identity(), server_module=nn.Identity(),
                     client_params=[nn.Parameter(torch.zeros(1))], server_params=[w], lr=0.1, server_lr=0.1,
                     fresh_server_state=fresh)
    g1, g2 = torch.tensor([0.5, -1.0], dtype=torch.float64), torch.tensor([-0.2, 0.3], dtype=torch.float64)
    w0 = w.detach().clone()
    for g in (g1, g2):
        w.grad = g.clone()
        pair.server_optimizer.step()
    w1 = w0 - 0.1 * (g1 + 0.01 * w0)
    expected = w1 - 0.1 * (g2 + 0.01 * w1) if fresh else w1 - 0.1 * (0.9 * (g1 + 0.01 * w0) + g2 + 0.01 * w1)
    assert torch.allclose(w.detach(), expected, rtol=0, atol=1e-12)
    assert torch.allclose(expected, torch.tensor([0.968051, -1.926102] if fresh else [0.922151, -1.834302],
                                                 dtype=torch.float64), atol=1e-10)


def test_v2_with_a_per_batch_server_optimizer_carries_no_momentum(spec_factory):
    spec = spec_factory(name="v2fresh", algorithm=SplitFed(cut="layer2.0", version="v2", server_optimizer="per_batch"),
                        model=RESNET, train=TRAIN, federation=FederationConfig(rounds=1, clients_per_round=3))
    run_fit(spec)
    assert not any(k.startswith("server_momentum/") for k in saved(spec)["algorithm"])
    carried = spec_factory(name="v2carried", algorithm=SplitFed(cut="layer2.0", version="v2"), model=RESNET,
                           train=TRAIN, federation=FederationConfig(rounds=1, clients_per_round=3))
    run_fit(carried)
    assert any(k.startswith("server_momentum/") for k in saved(carried)["algorithm"])
