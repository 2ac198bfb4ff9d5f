"""ScaleFL: the exit substrate, its MACs, the client objective, level routing and assignment,
evaluation and the population report (docs/scalefl.md)."""

import json
from pathlib import Path

import pytest
import torch

from fl_lightning.algorithms.levels import assign_levels
from fl_lightning.algorithms.supernet.scalefl import LEVELS, ScaleFL
from fl_lightning.config import (BudgetConfig, DataConfig, EvalConfig, FederationConfig, LocalTrainConfig,
                                 PartitionConfig)
from fl_lightning.data import Digits
from fl_lightning.data.federated import build_federated_data
from fl_lightning.elastic.macs import count_params
from fl_lightning.elastic.models import build_model
from fl_lightning.elastic.models.scalefl_resnet import DepthWidthSpec, exit_costs
from fl_lightning.errors import ConfigError
from fl_lightning.federation.builder import build_global_model
from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.federation.loop import run_fit
from fl_lightning.modules.scalefl_client import scalefl_loss
from fl_lightning.elastic.models import ScaleFLResNet18
from option_checks import option_refusal

SPECS = [DepthWidthSpec(b, w) for b, w in LEVELS]
NARROW = {"class_path": "fl_lightning.elastic.models.ScaleFLResNet18", "init_args": {"width": 0.125}}
DATA = DataConfig(dataset=Digits(), val_size=100, calib_size=64)


def narrow_model(num_classes=10, shape=(1, 8, 8)):
    return build_model(ScaleFLResNet18, num_classes, shape, width=0.125)


# -- the substrate ------------------------------------------------------------------------------

def test_exits_sit_where_levels_end_and_a_level_model_returns_all_its_exits():
    torch.manual_seed(0)
    model = narrow_model().eval()
    assert sorted(model.exits.keys(), key=int) == ["3", "4", "5"] and model.has_final
    assert model.classifier_depths() == [3, 4, 5, 8]
    x = torch.randn(5, 1, 8, 8)
    for k, spec in enumerate(SPECS, start=1):
        local = model.extract(spec).module.eval()
        keys = set(local.state_dict())
        # only the level's blocks and the exits of levels 1..k
        assert set(local.exits.keys()) == {str(b) for b, _ in LEVELS[:k] if b < 8}
        assert ("fc.weight" in keys) == (spec.depth == 8)
        blocks = {".".join(key.split(".")[:2]) for key in keys if key.startswith("layer")}
        assert blocks == {f"layer{s + 1}.{i}" for s, i in model.block_positions[:spec.depth]}
        assert len(list(local.blocks())) == 1 + spec.depth  # stem + blocks
        outs = local.forward_exits(x)
        assert len(outs) == k and all(o.shape == (5, 10) for o in outs)
        torch.testing.assert_close(outs[-1], local(x))  # the served forward is the last exit
        model.set_active(spec)  # the elastic global model at the level computes the same
        torch.testing.assert_close(model(x), local(x))
        torch.testing.assert_close(model.forward_exits(x)[-1], outs[-1])
    with pytest.raises(ValueError, match="no classifier"):
        model.set_active(DepthWidthSpec(6, 1.0))


def test_exits_with_convs_route_and_aggregate_like_the_blocks():
    """ScaleFL's own ResNet exits (exit_convs=3): conv-BN-ReLU layers at the block's width,
    sliced with it."""
    torch.manual_seed(0)
    model = build_model(ScaleFLResNet18, 10, (1, 8, 8), width=0.125, exit_convs=3).eval()
    local = model.extract(SPECS[1]).module.eval()  # level 2: exits after blocks 3 and 4
    # stage 2 of the 0.125-wide substrate has 16 channels; level 2 (width 0.5) holds 8 of them
    assert local.exits["3"].convs[0].weight.shape == (8, 8, 3, 3) and len(local.exits["3"].convs) == 9
    x = torch.randn(3, 1, 8, 8)
    model.set_active(SPECS[1])
    torch.testing.assert_close(model.forward_exits(x), local.forward_exits(x))


def test_level_macs_and_exit_macs_on_the_cifar100_substrate():
    """Measured: 35.69M / 72.70M / 127.75M / 556.71M MACs served (fvcore counts BN and
    pooling too), 11.27M parameters with the three pool + linear exits."""
    model = build_model(ScaleFLResNet18, 100, (3, 32, 32))
    costs = [exit_costs(model, spec, (3, 32, 32)) for spec in SPECS]
    served = [c["served_macs"] for c in costs]
    assert 34e6 <= served[0] <= 37e6  # "approximately 35M" (FEAST Supp. E.1)
    assert 550e6 <= served[3] <= 560e6  # "approximately 550M-555M" full width
    assert served == sorted(served)
    assert count_params(model) == 11_271_632  # 11.27M (FEAST Supp. E.5)
    # An exit is pool + linear: at C channels on an HxW map, C*H*W (pool) + C*100 (linear) MACs.
    exit_macs = {3: 128 * 16 * 16 + 128 * 100, 4: 128 * 16 * 16 + 128 * 100, 5: 256 * 8 * 8 + 256 * 100}
    assert costs[3]["train_macs"] - costs[3]["served_macs"] == sum(exit_macs.values())
    assert costs[0]["train_macs"] == costs[0]["served_macs"]  # level 1 has a single exit


# -- the client objective -----------------------------------------------------------------------

def _hand_kl(student, teacher, t, reduction):
    p = torch.exp(teacher / t) / torch.exp(teacher / t).sum(1, keepdim=True)
    log_q = student / t - torch.log(torch.exp(student / t).sum(1, keepdim=True))
    pointwise = p * (torch.log(p) - log_q)
    return pointwise.sum() / (pointwise.numel() if reduction == "elementwise" else student.shape[0])


def _hand_ce(z, y):
    return (torch.log(torch.exp(z).sum(1)) - z[torch.arange(len(y)), y]).mean()


@pytest.mark.parametrize("reduction", ["elementwise", "batchmean"])
@pytest.mark.parametrize("weights", ["depth", "sum"])
def test_distillation_loss_equals_a_hand_computation(reduction, weights):
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(4, 7, generator=g, dtype=torch.float64) * 2 for _ in range(3)]
    y = torch.tensor([0, 3, 6, 2])
    gamma, t = 0.3, 3.0
    w = [1 / 6, 2 / 6, 3 / 6] if weights == "depth" else [1.0, 1.0, 1.0]
    hand = sum(w[j] * (_hand_ce(z, y) + gamma * t * t * _hand_kl(z, logits[-1], t, reduction))
               for j, z in enumerate(logits[:-1])) + w[2] * _hand_ce(logits[2], y)
    got = scalefl_loss([z.float() for z in logits], y, gamma, t, True, weights, reduction)
    torch.testing.assert_close(got.double(), hand, rtol=1e-5, atol=1e-6)
    off = scalefl_loss([z.float() for z in logits], y, gamma, t, False, weights, reduction)  # before kd_start
    torch.testing.assert_close(off.double(), sum(wj * _hand_ce(z, y) for wj, z in zip(w, logits)), rtol=1e-5, atol=1e-6)


def test_the_teacher_exit_receives_the_distillation_gradient_unless_detached():
    y = torch.tensor([1, 2])

    def teacher_grad(detach, gamma):
        logits = [torch.randn(2, 5, generator=torch.Generator().manual_seed(s), requires_grad=True) for s in (2, 3)]
        scalefl_loss(logits, y, gamma, 3.0, detach_teacher=detach).backward()
        return logits[-1].grad

    ce_only = teacher_grad(False, 0.0)
    assert torch.allclose(teacher_grad(True, 0.5), ce_only)
    assert not torch.allclose(teacher_grad(False, 0.5), ce_only)  # as ScaleFL's code: not detached


def test_mixed_soft_targets_give_the_lam_weighted_exit_losses():
    """With Mixup targets lam e_a + (1 - lam) e_b, every exit's CE is lam CE(y_a) + (1 - lam) CE(y_b)
    (FEAST Eq. 20); the distillation terms are untouched by the labels."""
    g = torch.Generator().manual_seed(1)
    logits = [torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in range(2)]
    y_a, y_b, lam = torch.tensor([0, 1, 2, 3]), torch.tensor([5, 4, 3, 2]), 0.7
    soft = lam * torch.eye(6)[y_a] + (1 - lam) * torch.eye(6)[y_b]
    gamma, t = 0.2, 3.0
    kl = gamma * t * t * _hand_kl(logits[0], logits[1], t, "elementwise")
    hand = sum(w * (lam * _hand_ce(z, y_a) + (1 - lam) * _hand_ce(z, y_b)) for w, z in zip([1 / 3, 2 / 3], logits))
    got = scalefl_loss([z.float() for z in logits], soft, gamma, t)
    torch.testing.assert_close(got.double(), hand + kl / 3, rtol=1e-5, atol=1e-6)


def test_the_client_trains_on_the_mixed_batch_its_mixer_returns():
    from fl_lightning.modules.mixing import client_mixer
    from fl_lightning.modules.scalefl_client import ScaleFLClient

    model = narrow_model()
    x = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 3, 4, 5])
    client = ScaleFLClient(model, 0.1, mixer=client_mixer(10, "alternate", 0.4, 1.0, seed=7))
    reference = client_mixer(10, "alternate", 0.4, 1.0, seed=7)  # the same draws, batch by batch
    model.eval()  # BN in eval mode: the forward pass is a pure function of the batch
    for batch_idx in (0, 1):  # Mixup, then CutMix
        mixed, targets = reference(x, y, batch_idx)
        assert targets.shape == (6, 10) and not torch.equal(mixed, x)
        expected = scalefl_loss(model.forward_exits(mixed), targets, 0.05, 3.0)
        torch.testing.assert_close(client.training_step((x, y), batch_idx), expected)
    plain = ScaleFLClient(model, 0.1)
    torch.testing.assert_close(plain.training_step((x, y), 0), scalefl_loss(model.forward_exits(x), y, 0.05, 3.0))


# -- assignment ---------------------------------------------------------------------------------

def test_largest_affordable_assignment_with_the_minimum_tier_fallback():
    macs = [35.7e6, 72.7e6, 127.7e6, 556.7e6]
    levels, fallback = assign_levels([25e6, 35.7e6, 72e6, 72.7e6, 500e6, 556.7e6, 1.5e9], macs)
    assert levels.tolist() == [0, 0, 0, 1, 2, 3, 3]
    assert fallback.tolist() == [True, False, False, False, False, False, False]


def test_bad_options_are_config_errors_naming_the_key():
    cases = [({"levels": [[3, 0.4], [2, 0.5]]}, "algorithm.levels"),
             ({"levels": [[3, 1.5]]}, "algorithm.levels"),
             ({"levels": [[2.5, 0.5]]}, "algorithm.levels"),
             ({"kd_gamma": -1}, "algorithm.kd_gamma"),
             ({"kd_temperature": 0}, "algorithm.kd_temperature"),
             ({"kd_start": 1.5}, "algorithm.kd_start"),
             ({"exit_weights": "linear"}, "algorithm.exit_weights"),
             ({"kl_reduction": "sum"}, "algorithm.kl_reduction"),
             ({"calib_batch_size": 0}, "algorithm.calib_batch_size"),
             ({"mix_schedule": "sometimes"}, "algorithm.mix_schedule"),
             ({"mix_schedule": "alternate", "cutmix_alpha": 0.0}, "algorithm.cutmix_alpha")]
    for options, key in cases:
        assert option_refusal("ScaleFL", **options).key == key, options
    ScaleFL().check(LocalTrainConfig())


# -- federation ---------------------------------------------------------------------------------

def scalefl_spec(spec_factory, name, budgets, num_clients, rounds, per_round, **options):
    return spec_factory(
        name=name, algorithm=ScaleFL(**options), data=DATA, model=NARROW,
        partition=PartitionConfig(method="iid", num_clients=num_clients, budgets=budgets),
        train=LocalTrainConfig(epochs=1, batch_size=32, lr=0.05, momentum=0.9, weight_decay=1e-4, grad_clip=10.0),
        federation=FederationConfig(rounds=rounds, clients_per_round=per_round), eval=EvalConfig(every=1, test="final"))


def test_a_level1_client_update_touches_only_level1_positions(spec_factory):
    # Every budget is below level 1 (54K MACs on this substrate): all clients fall back to level 1.
    spec = scalefl_spec(spec_factory, "level1", BudgetConfig(b_min=1e3, b_max=2e4), 4, 1, 2)
    run_fit(spec)
    algorithm = spec.algorithm
    assert algorithm.assignment.fallback.all() and (algorithm.assignment.assigned == 0).all()
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    global_model = build_global_model(spec, fed)
    before = global_model.state_dict()
    after = load_checkpoint(Path(spec.out_dir) / spec.name / "checkpoints" / "last.ckpt")["model"]
    regions = global_model.regions(SPECS[0])
    inside = {key: torch.zeros_like(v, dtype=torch.bool) for key, v in before.items()}
    for _, (key, region) in regions.items():
        region.fill_add(inside[key], True)
    changed_inside = 0
    for key, value in before.items():
        if not value.is_floating_point():
            continue
        moved = after[key] != value
        assert not moved[~inside[key]].any(), key  # nothing outside level 1 moved
        changed_inside += int(moved[inside[key]].sum())
    assert changed_inside > 0
    beyond = ("layer2.1.", "layer3.", "layer4.", "exits.4.", "exits.5.", "fc.")
    assert all(torch.equal(after[k], before[k]) for k in before if k.startswith(beyond))


def test_small_federation_reports_every_level_and_every_client_once(spec_factory, capsys):
    # Budgets 20K..929K MACs: one client below level 1 (54K), the others on levels 2-4.
    spec = scalefl_spec(spec_factory, "population", BudgetConfig(b_min=2e4, b_max=1e6), 8, 2, 3)
    summary = run_fit(spec)
    algorithm = spec.algorithm
    out = capsys.readouterr().out
    assert int(algorithm.assignment.fallback.sum()) == 1
    final = summary["best"] if "best" in summary else summary["final"]
    per_level = [final[f"test_level{k}_acc"] for k in range(1, 5)]
    expected = sum(per_level[int(k)] for k in algorithm.assignment.assigned) / len(algorithm.assignment.assigned)
    assert final["test_acc"] == pytest.approx(expected)
    assert final["test_fallback_clients"] == 1.0
    rows = algorithm.assignment.population()
    assert sorted(r["client"] for r in rows) == list(range(8))
    # The report lists every client exactly once, under the level it is served.
    listing = out[out.index("clients by served level"):].splitlines()[1:5]
    ids = [i.strip().rstrip("*") for line in listing for i in line.split(":", 1)[1].split(",") if i.strip() != "-"]
    assert sorted(map(int, ids)) == list(range(8))
    assert "1 served level 1 as the fallback" in out
    run = Path(spec.out_dir) / spec.name
    saved = json.loads((run / "levels.json").read_text())
    assert [c["level"] for c in saved["clients"]] == [int(k) + 1 for k in algorithm.assignment.assigned]
    state = load_checkpoint(run / "checkpoints" / "last.ckpt")["algorithm"]
    assert torch.equal(state["assigned"], algorithm.assignment.assigned)
    clients = [json.loads(line) for line in (run / "clients.jsonl").read_text().splitlines()]
    assert {c["level"] for c in clients} <= {1, 2, 3, 4}
    assert all(c["macs"] == algorithm.level_macs[c["level"] - 1] for c in clients)


def test_levels_must_end_at_an_exit(spec_factory):
    spec = scalefl_spec(spec_factory, "noexit", BudgetConfig(b_min=2e4, b_max=1e6), 4, 1, 2,
                        levels=[[3, 0.4], [6, 0.7], [8, 1.0]])
    with pytest.raises(ConfigError) as error:
        run_fit(spec)
    assert error.value.key == "algorithm.levels[1]"
