"""HeteroFL as FEAST's supernet baseline: tiers by MAC budget with the fallback, the Scaler,
static BN and recalibration statistics, per-tier evaluation, and the unchanged default
(docs/heterofl_supernet.md)."""

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.algorithms import HeteroFL, SubmodelAlgorithm
from fl_lightning.algorithms.bn_protocol import estimate_statistics, without_statistics
from fl_lightning.algorithms.submodel.heterofl_tiers import HETEROFL_TIERS, TierAssignment
from fl_lightning.algorithms.submodel import TIER_PROBS, TIERS
from fl_lightning.config import (BudgetConfig, DataConfig, EvalConfig, FederationConfig, LocalTrainConfig,
                                 PartitionConfig)
from fl_lightning.data import Digits
from fl_lightning.elastic.bn import statistics_keys
from fl_lightning.elastic.layers.scaler import Scaler, attach_scaler
from fl_lightning.elastic.macs import count_macs
from fl_lightning.elastic.models import build_model
from fl_lightning.elastic.specs import WidthSpec
from fl_lightning.errors import ConfigError
from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.federation.loop import run_fit
from fl_lightning.elastic.models import ResNet18
from option_checks import option_refusal

NARROW = {"class_path": "fl_lightning.elastic.models.ResNet18", "init_args": {"width": 0.125}}
DATA = DataConfig(dataset=Digits(), val_size=100, calib_size=64)


def lines(run, name):
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def heterofl_spec(spec_factory, name, algorithm, budgets=BudgetConfig(b_min=2e3, b_max=2e5), model=NARROW,
                  rounds=1, per_round=4, num_clients=8):
    return spec_factory(name=name, algorithm=algorithm, data=DATA, model=model,
                        partition=PartitionConfig(method="iid", num_clients=num_clients, budgets=budgets),
                        train=LocalTrainConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9),
                        federation=FederationConfig(rounds=rounds, clients_per_round=per_round),
                        eval=EvalConfig(every=1, test="final"))


# -- assignment ---------------------------------------------------------------------------------

def test_budget_assignment_on_hand_made_budgets_and_macs():
    macs = [2_000_000, 9_000_000, 35_000_000, 140_000_000, 557_000_000]
    budgets = [1e6, 2e6, 8.9e6, 9e6, 100e6, 556e6, 557e6, 1.5e9]
    a = TierAssignment.from_costs(HETEROFL_TIERS, macs, [1, 2, 3, 4, 5], budgets)
    assert a.assigned.tolist() == [0, 0, 0, 1, 2, 3, 4, 4]
    assert a.fallback.tolist() == [True] + [False] * 7  # 1M affords not even 1/16 (2M)
    assert a.widths().tolist() == [0.0625, 0.0625, 0.0625, 0.125, 0.25, 0.5, 1.0, 1.0]
    assert a.counts() == [3, 1, 1, 1, 2]
    rows = a.population()
    assert [r["level"] for r in rows] == [1, 1, 1, 2, 3, 4, 5, 5]
    assert [r["macs"] for r in rows][:2] == [2_000_000, 2_000_000] and rows[0]["fallback"]
    with pytest.raises(ConfigError) as error:
        TierAssignment.from_costs([0.25, 0.5], [10, 10], [1, 2], budgets)
    assert error.value.key == "algorithm.tiers"


def test_budget_tiers_in_a_federation_with_fallback_scaler_and_mixing(spec_factory, capsys):
    # Budgets 2K..200K MACs on the width-1/8 substrate (8x8 digits): one client below 1/16's cost.
    algorithm = HeteroFL(assign="budget", bn="sbn", scaler=True, mix_schedule="alternate")
    spec = heterofl_spec(spec_factory, "budget", algorithm, rounds=2)
    summary = run_fit(spec)
    out = capsys.readouterr().out
    a = algorithm.assignment
    model = algorithm.ctx.model
    macs = [count_macs(model.extract(WidthSpec.uniform(t, 4)).module, (1, 8, 8)) for t in HETEROFL_TIERS]
    assert a.macs == macs and a.tiers == list(HETEROFL_TIERS)
    budgets = algorithm.ctx.budgets.tolist()
    expected = [max([k for k, m in enumerate(macs) if m <= b], default=0) for b in budgets]
    assert a.assigned.tolist() == expected
    assert a.fallback.tolist() == [b < macs[0] for b in budgets] and int(a.fallback.sum()) == 1
    run = Path(spec.out_dir) / spec.name
    for c in lines(run, "clients.jsonl"):  # every client trains its assigned tier
        k = expected[c["client"]]
        assert c["p"] == HETEROFL_TIERS[k] and c["level"] == k + 1 and c["fallback"] == int(budgets[c["client"]] < macs[0])
    block = summary["best"]
    per_tier = [block[f"test_level{k}_acc"] for k in range(1, 6)]
    assert block["test_acc"] == pytest.approx(sum(per_tier[k] for k in expected) / len(expected))
    assert block["test_mean_level_acc"] == pytest.approx(sum(per_tier) / 5)
    assert block["test_fallback_clients"] == 1.0
    assert "1 served level 1 as the fallback" in out and "HeteroFL test accuracy" in out
    listing = out[out.index("clients by served level"):].splitlines()[1:6]
    ids = [i.strip().rstrip("*") for line in listing for i in line.split(":", 1)[1].split(",") if i.strip() != "-"]
    assert sorted(map(int, ids)) == list(range(8))
    saved = json.loads((run / "levels.json").read_text())
    assert [c["level"] for c in saved["clients"]] == [k + 1 for k in expected]
    assert [level["served_macs"] for level in saved["levels"]] == macs
    state = load_checkpoint(run / "checkpoints" / "last.ckpt")["algorithm"]
    assert state["tiers/assigned"].tolist() == expected


# -- the Scaler ---------------------------------------------------------------------------------

def test_scaler_is_one_over_rate_in_training_and_identity_at_evaluation():
    x = torch.randn(3, 4, 5, 5)
    assert torch.equal(Scaler(0.25).train()(x), x / 0.25)
    assert torch.equal(Scaler(0.25).eval()(x), x)

    torch.manual_seed(0)
    model = build_model(ResNet18, 10, (1, 8, 8), width=0.125).extract(WidthSpec.uniform(0.5, 4)).module
    images = torch.randn(4, 1, 8, 8)
    keys = set(model.state_dict())
    plain_eval = model.eval()(images)
    attach_scaler(model, 0.5)
    assert set(model.state_dict()) == keys  # nothing new to send or aggregate
    torch.testing.assert_close(model.eval()(images), plain_eval, rtol=0, atol=0)
    seen = []
    for conv in [m for m in model.modules() if isinstance(m, nn.Conv2d)]:
        conv.register_forward_hook(lambda m, i, o: seen.append((m, i[0].detach(), o.detach())))
    for mode, factor in (("train", 2.0), ("eval", 1.0)):
        seen.clear()
        model.train(mode == "train")
        model(images)
        assert len(seen) == 20  # stem, 16 block convs, 3 shortcuts
        for conv, inputs, output in seen:
            direct = F.conv2d(inputs, conv.weight, None, conv.stride, conv.padding)
            torch.testing.assert_close(output, direct * factor)


# -- batch-norm statistics ----------------------------------------------------------------------

def batch_moments(model, batches):
    """Per BN layer: the average over batches of the batch mean and unbiased variance of its
    input, computed from the inputs a train-mode forward feeds it (batch statistics)."""
    twin = copy.deepcopy(model).train()
    norms = {name: m for name, m in twin.named_modules() if isinstance(m, nn.BatchNorm2d)}
    for m in norms.values():
        m.track_running_stats = False  # normalize with the batch, keep nothing
    inputs = {name: [] for name in norms}
    for name, m in norms.items():
        m.register_forward_pre_hook(lambda mod, i, name=name: inputs[name].append(i[0].detach()))
    with torch.no_grad():
        for x in batches:
            twin(x)
    out = {}
    for name, seen in inputs.items():
        means = torch.stack([h.mean(dim=(0, 2, 3)) for h in seen]).mean(0)
        variances = torch.stack([h.transpose(0, 1).flatten(1).var(dim=1, unbiased=True) for h in seen]).mean(0)
        out[name] = (means, variances)
    return out


def test_estimated_statistics_equal_an_independent_mean_and_variance_over_the_pass():
    torch.manual_seed(1)
    net = build_model(ResNet18, 10, (1, 8, 8), width=0.125)
    small, large = (net.extract(WidthSpec.uniform(w, 4)).module for w in (0.25, 1.0))
    batches = [torch.randn(10, 1, 8, 8) * 3 + 1 for _ in range(3)]
    alone = copy.deepcopy(large)
    assert estimate_statistics([small, large], batches) == 3
    estimate_statistics([alone], batches)
    for model in (small, large):
        expected = batch_moments(model, batches)
        for name, m in model.named_modules():
            if isinstance(m, nn.BatchNorm2d):
                torch.testing.assert_close(m.running_mean, expected[name][0], rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(m.running_var, expected[name][1], rtol=1e-4, atol=1e-5)
    # The stem BN from the images alone: the stem conv's outputs over all three batches.
    stem = torch.cat([F.conv2d(x, small.stem.conv.weight, padding=1) for x in batches])
    torch.testing.assert_close(small.stem.bn.running_mean, stem.mean(dim=(0, 2, 3)), rtol=1e-4, atol=1e-5)
    # Estimated together or alone: the same statistics.
    for key, value in alone.state_dict().items():
        torch.testing.assert_close(large.state_dict()[key], value, rtol=0, atol=0)


@pytest.mark.parametrize("bn,data", [("sbn", "train"), ("sbn", "calib"), ("recalibrate", "calib")])
def test_served_statistics_come_from_the_chosen_data(spec_factory, bn, data):
    """One pass in one batch (eval transform): every served model's stem BN holds the mean and
    unbiased variance of its stem conv outputs over exactly the chosen examples."""
    algorithm = HeteroFL(caps=[1.0, 0.5, 0.25, 0.5, 1.0, 0.25], bn=bn, sbn_data=data,
                         calib_batch_size=100_000, calib_transform="eval")
    spec = heterofl_spec(spec_factory, f"{bn}_{data}", algorithm, budgets=BudgetConfig(), model={"class_path": "fl_lightning.elastic.models.CNN"},
                         num_clients=6, per_round=3)
    summary = run_fit(spec)
    assert "test_acc" in summary["final"]
    ctx = algorithm.ctx
    state = ctx.model.state_dict()
    if bn == "sbn":  # clients tracked nothing, and no statistics were aggregated
        for key in statistics_keys(ctx.model):
            init = {"running_mean": 0.0, "running_var": 1.0, "num_batches_tracked": 0}[key.rsplit(".", 1)[1]]
            assert (state[key] == init).all(), key
    fed = ctx.data
    indices = torch.cat(list(fed.clients)) if data == "train" else fed.calib
    images = fed.bundle.train_eval.data[indices]
    for width in (0.25, 1.0):
        served = algorithm.statistics.models([WidthSpec.uniform(width, 3)])[0]
        conv, norm = served.features["block0"].conv, served.features["block0"].bn
        out = F.conv2d(images, conv.weight, padding=1)
        torch.testing.assert_close(norm.running_mean, out.mean(dim=(0, 2, 3)), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(norm.running_var, out.transpose(0, 1).flatten(1).var(dim=1), rtol=1e-4, atol=1e-5)


def test_sbn_clients_neither_receive_nor_return_statistics():
    net = build_model(ResNet18, 10, (1, 8, 8), width=0.125)
    routed = net.extract(WidthSpec.uniform(0.5, 4))
    stats = statistics_keys(routed.module)
    stat_bytes = sum(routed.module.state_dict()[k].numel() * routed.module.state_dict()[k].element_size() for k in stats)
    bare = without_statistics(routed)
    assert not set(bare.regions) & stats and set(bare.regions) | stats == set(routed.regions)
    assert bare.payload_bytes() == routed.payload_bytes() - stat_bytes
    before = {k: v.clone() for k, v in bare.module.state_dict().items() if k in stats}
    bare.module.train()(torch.randn(4, 1, 8, 8))
    assert all(torch.equal(bare.module.state_dict()[k], v) for k, v in before.items())  # nothing tracked


# -- the default --------------------------------------------------------------------------------

CAPS = [1.0, 0.5, 0.25, 0.75, 1.0, 0.5]


class CapsEveryRound(SubmodelAlgorithm):
    """The sub-model study's HeteroFL rule written out: every client at its cap."""

    def widths_for(self, round_idx, cohort):
        return {c: float(self.caps[c]) for c in cohort}


@pytest.mark.parametrize("caps", [CAPS, None])
def test_default_heterofl_is_the_sub_model_study_rule_bit_for_bit(spec_factory, caps):
    default = HeteroFL(caps=caps)
    assert default.tiers == list(TIERS) and default.tier_probs == list(TIER_PROBS)
    runs = {}
    for name, algorithm in (("heterofl", default), ("reference", CapsEveryRound(caps=caps))):
        spec = spec_factory(name=name, algorithm=algorithm, federation=FederationConfig(rounds=2, clients_per_round=3))
        runs[name] = (run_fit(spec), Path(spec.out_dir) / name)
    (mine, here), (ref, there) = runs["heterofl"], runs["reference"]
    assert mine == ref
    a, b = load_checkpoint(here / "checkpoints" / "last.ckpt"), load_checkpoint(there / "checkpoints" / "last.ckpt")
    for part in ("model", "algorithm"):
        assert set(a[part]) == set(b[part])
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    strip = lambda rows: [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]  # noqa: E731
    assert strip(lines(here, "clients.jsonl")) == strip(lines(there, "clients.jsonl"))
    assert strip(lines(here, "metrics.jsonl")) == strip(lines(there, "metrics.jsonl"))
    assert not (here / "levels.json").exists()


# -- options ------------------------------------------------------------------------------------

def test_bad_options_are_config_errors_naming_the_key(spec_factory):
    cases = [({"assign": "random"}, "algorithm.assign"),
             ({"bn": "frozen"}, "algorithm.bn"),
             ({"bn": "sbn", "sbn_data": "test"}, "algorithm.sbn_data"),
             ({"scaler": True, "bn": "aggregated"}, "algorithm.scaler"),
             ({"scaler": True, "bn": "client"}, "algorithm.scaler"),
             ({"assign": "budget", "tier_probs": [0.2] * 5}, "algorithm.tier_probs"),
             ({"assign": "budget", "caps": [1.0] * 6}, "algorithm.caps"),
             ({"assign": "budget", "tiers": [0.5, 0.25]}, "algorithm.tiers"),
             ({"calib_batch_size": 0}, "algorithm.calib_batch_size"),
             ({"mix_schedule": "sometimes"}, "algorithm.mix_schedule"),
             ({"mix_schedule": "mixup", "mixup_alpha": 0.0}, "algorithm.mixup_alpha")]
    for options, key in cases:
        assert option_refusal("HeteroFL", **options).key == key, options
    HeteroFL(assign="budget", bn="sbn", scaler=True).check(LocalTrainConfig())
    spec = spec_factory(name="nocalib", algorithm=HeteroFL(bn="recalibrate"))  # calib_size 0
    with pytest.raises(ConfigError) as error:
        run_fit(spec)
    assert error.value.key == "data.calib_size"
