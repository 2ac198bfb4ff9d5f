"""FIARSE: magnitude masks, the threshold-controlled gradient, sparse-delta aggregation,
logical and executed MACs, and a short run on digits."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.algorithms.supernet.fiarse import FIARSE, geometric_grid, masked_region_map, serve
from fl_lightning.data import Digits
from fl_lightning.elastic.magnitude_masks import MaskFamily, group_keys, layer_macs, maskable_keys
from fl_lightning.errors import ConfigError
from option_checks import refusal


def tiny_model():
    """conv (4 weights, no bias) -> flatten -> linear (4 weights + 1 bias): 9 maskable entries
    with distinct magnitudes 0.9 > 0.8 > 0.7 > 0.6 > 0.5 > 0.3 > 0.2 > 0.1 > 0.05."""
    model = nn.Sequential(nn.Conv2d(1, 1, 2, bias=False), nn.Flatten(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([0.9, -0.1, 0.5, -0.7]).view(1, 1, 2, 2))
        model[2].weight.copy_(torch.tensor([[0.2, -0.8, 0.05, 0.6]]))
        model[2].bias.copy_(torch.tensor([-0.3]))
    return model


def masks_at(model, fraction, grouping="global"):
    family = MaskFamily(model.state_dict(), group_keys(model, grouping))
    thresholds = family.thresholds(fraction)
    masks = family.masks(model.state_dict(), thresholds)
    return family, thresholds, {k: m.flatten().tolist() for k, m in masks.items()}


def test_threshold_keeps_exactly_the_requested_fraction_by_magnitude():
    model = tiny_model()
    assert maskable_keys(model) == ["0.weight", "2.weight", "2.bias"]
    # 1/3 of 9 entries: the three largest |w| (0.9, 0.8, 0.7); the threshold is the third.
    family, thresholds, masks = masks_at(model, 1 / 3)
    assert float(thresholds["0.weight"]) == pytest.approx(0.7)
    assert masks == {"0.weight": [True, False, False, True], "2.weight": [False, True, False, False],
                     "2.bias": [False]}
    assert family.kept_fraction(thresholds) == pytest.approx(3 / 9)
    assert family.presort().thresholds(1 / 3) == thresholds  # sorting and selection agree
    # 0.56 of 9 = 5.04 -> 5 entries (floor, as the original's int(numel * size)): down to 0.5.
    _, thresholds, masks = masks_at(model, 0.56)
    assert float(thresholds["2.bias"]) == pytest.approx(0.5)
    assert masks == {"0.weight": [True, False, True, True], "2.weight": [False, True, False, True],
                     "2.bias": [False]}
    # Per tensor at 1/2: conv keeps 2 of 4 (0.9, 0.7), linear 2 of its 5 entries (0.8, 0.6).
    _, _, masks = masks_at(model, 0.5, "tensor")
    assert masks == {"0.weight": [True, False, False, True], "2.weight": [False, True, False, True],
                     "2.bias": [False]}
    # Every fraction keeps at least one entry; fraction 1 keeps everything.
    assert sum(sum(m) for m in masks_at(model, 1e-6)[2].values()) == 1
    assert all(all(m) for m in masks_at(model, 1.0)[2].values())


def test_forward_uses_the_masked_weights():
    from fl_lightning.modules.masked_client import ThresholdMaskedClient

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    family = MaskFamily(model.state_dict(), group_keys(model, "global"))
    thresholds = family.thresholds(0.5)
    client = ThresholdMaskedClient(model, lr=0.1, momentum=0.0, weight_decay=0.0, thresholds=thresholds)
    x = torch.randn(4, 3)
    tau = float(thresholds["weight"])
    w, b = model.weight.detach(), model.bias.detach()
    expected = F.linear(x, w * (w.abs() >= tau), b * (b.abs() >= tau))
    assert torch.allclose(client(x), expected)
    assert not torch.allclose(client(x), model(x))
    assert int((w.abs() >= tau).sum() + (b.abs() >= tau).sum()) == 4  # floor(0.5 * 8)


@pytest.mark.parametrize("gradient, expected", [
    # g = dL/d(w m) = x = [1, 2, 3]; w = [0.5, -0.2, 1.5], tau = 0.4: the middle entry is masked.
    ("masked", [1.0, 0.0, 3.0]),
    # times 1 + 2 tau |w| / (|w| + tau)^2: 1 + 0.4 / 0.81 and 1 + 1.2 / 3.61 on the kept entries.
    ("surrogate", [1.0 + 0.4 / 0.81, 0.0, 3.0 * (1.0 + 1.2 / 3.61)]),
])
def test_gradient_reaching_the_dense_weights_follows_the_ste_rule(gradient, expected):
    from fl_lightning.modules.masked_client import ThresholdMaskedClient

    model = nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -0.2, 1.5]]))
    client = ThresholdMaskedClient(model, 0.1, 0.0, 0.0, {"weight": torch.tensor(0.4)}, gradient=gradient)
    out = client(torch.tensor([[1.0, 2.0, 3.0]]))
    assert float(out.detach()) == pytest.approx(0.5 * 1 + 1.5 * 3)  # the forward drops the masked -0.2
    out.sum().backward()
    assert model.weight.grad.flatten().tolist() == pytest.approx(expected, rel=1e-6)


def test_tcb_sgd_step_moves_only_kept_weights_and_the_mask_follows_the_weights():
    from fl_lightning.modules.masked_client import ThresholdMaskedClient

    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, 0.1]]))
    client = ThresholdMaskedClient(model, lr=1.0, momentum=0.0, weight_decay=0.0, thresholds={"weight": torch.tensor(0.3)})
    optimizer = client.configure_optimizers()
    client(torch.tensor([[0.3, 5.0]])).sum().backward()
    optimizer.step()
    assert model.weight.flatten().tolist() == pytest.approx([0.2, 0.1])  # 0.5 - 0.3; 0.1 untouched
    # The threshold stays, the mask is re-read from the weights: 0.2 < 0.3 now drops out.
    assert float(client(torch.tensor([[1.0, 1.0]])).detach()) == 0.0


def _digits_spec(spec_factory, algorithm, **overrides):
    from fl_lightning.config import BudgetConfig, DataConfig, FederationConfig, PartitionConfig

    sections = dict(data=DataConfig(dataset=Digits(), val_size=100, calib_size=60),
                    partition=PartitionConfig(method="dirichlet", num_clients=6, alpha=0.5,
                                              budgets=BudgetConfig(b_min=1e5, b_max=7e5)),
                    federation=FederationConfig(rounds=2, clients_per_round=3))
    sections.update(overrides)
    return spec_factory(name="fiarse", algorithm=algorithm, **sections)


def _context(spec_factory, algorithm):
    from lightning.fabric import Fabric

    from fl_lightning.federation.builder import build_context

    return build_context(_digits_spec(spec_factory, algorithm), Fabric(accelerator="cpu", devices=1), mode="fit")


@pytest.mark.parametrize("weighting, server_lr, support", [("samples", 1.0, "mask"), ("samples", 0.5, "mask"),
                                                           ("uniform", 1.0, "mask"), ("samples", 1.0, "changed")])
def test_aggregation_is_the_sample_weighted_mean_of_deltas_over_the_clients_that_kept_each_coordinate(
        spec_factory, weighting, server_lr, support):
    from fl_lightning.elastic.routing import Routed
    from fl_lightning.runtime.plan import ClientTask, RoundPlan
    from fl_lightning.runtime.link import Uplink

    alg = FIARSE(weighting=weighting, server_lr=server_lr, support=support)
    ctx = _context(spec_factory, alg)
    before = {k: v.clone() for k, v in alg.global_state.items()}
    key = "fc.weight"
    # fc.weight positions 0..3 (flattened): A keeps {0, 1}, B keeps {1, 2}, nobody keeps 3.
    keeps = {"A": [0, 1], "B": [1, 2]}
    deltas = {"A": 1.0, "B": -2.0}  # every entry moves, masked ones included (they must not count)
    samples = {"A": 10, "B": 30}
    if support == "changed":  # the authors' count: positions a client changed, whatever its mask
        keeps = {"A": list(range(alg.global_state[key].numel())), "B": list(range(alg.global_state[key].numel()))}
    plan = RoundPlan(0, 0.1, [ClientTask(0), ClientTask(1)])
    acc = alg.new_accumulator(plan)
    for client, name in enumerate(("A", "B")):
        module = ctx.make_model()
        module.load_state_dict(before)
        state = module.state_dict()
        masks = {k: torch.zeros_like(before[k], dtype=torch.bool) for k in alg.keys}
        masks[key].view(-1)[keeps[name]] = True
        with torch.no_grad():
            if support == "changed":  # A leaves position 1 unchanged, B leaves 0; nobody changes 3
                changed = {"A": [0, 1], "B": [1, 2]}[name]
                state[key].view(-1)[changed] += deltas[name]
            else:
                state[key].add_(deltas[name])
        regions = masked_region_map(alg.worker_regions, masks)
        result = Uplink(client, samples[name], 0.0, model=Routed(module, regions))
        alg.commit(acc, plan.tasks[client], result, plan)
    acc.reduce(ctx.fabric, plan.cohort, plan.cohort)
    alg.finish_round(acc, plan)

    w = {"samples": samples, "uniform": {"A": 1, "B": 1}}[weighting]
    mean_1 = (w["A"] * deltas["A"] + w["B"] * deltas["B"]) / (w["A"] + w["B"])
    expected = [deltas["A"], mean_1, deltas["B"], 0.0]
    got = (alg.global_state[key] - before[key]).view(-1)
    assert got[:4].tolist() == pytest.approx([server_lr * e for e in expected], rel=1e-5)
    assert torch.equal(got[4:], torch.zeros_like(got[4:]))  # masked out by every client: unchanged
    for k in alg.keys:
        if k != key:
            assert torch.equal(alg.global_state[k], before[k])


def conv_net():
    """conv 1->2 (3x3, pad 1) on 4x4 [16 positions], BN, conv 2->3 (3x3, stride 2) [2x2 = 4
    positions], flatten, linear 12->5 [1 position]."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.BatchNorm2d(2), nn.ReLU(),
                         nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.Flatten(), nn.Linear(12, 5))


def test_logical_macs_count_kept_weights_times_output_positions_and_executed_macs_stay_dense():
    model = conv_net()
    macs = layer_macs(model, (1, 4, 4))
    positions = {"0.weight": 16, "3.weight": 4, "5.weight": 1}
    dense = sum(model.state_dict()[k].numel() * p for k, p in positions.items())
    assert dense == 2 * 9 * 16 + 3 * 2 * 9 * 4 + 12 * 5  # 564
    bn = 2 * 2 * 16  # fvcore: 2 per batch-norm output element, untouched by masks
    assert macs.executed("paper") == dense and macs.executed("fvcore") == dense + bn
    family = MaskFamily(model.state_dict(), group_keys(model, "global"))
    values = np.concatenate([model.state_dict()[k].abs().flatten().numpy() for k in maskable_keys(model)])
    for fraction in (0.1, 0.37, 0.8, 1.0):
        k = math.floor(fraction * values.size)
        tau = np.sort(values)[::-1][k - 1]  # independent: numpy's sort and count
        expected = sum(int((model.state_dict()[key].abs().numpy() >= tau).sum()) * p for key, p in positions.items())
        kept = family.kept(family.thresholds(fraction))
        assert macs.logical(kept, "paper") == expected
        assert macs.logical(kept, "fvcore") == expected + bn
        assert expected <= dense
    # Matching a MAC budget: the largest fraction whose logical MACs fit.
    f = family.fraction_for_macs(macs, 300, low=1 / 64)
    assert macs.logical(family.kept(family.thresholds(f))) <= 300
    assert macs.logical(family.kept(family.thresholds(min(1.0, f + 2 / values.size)))) > 300


def test_grid_and_serving():
    grid = geometric_grid(1 / 64, 25)
    assert grid[0] == pytest.approx(1 / 64) and grid[-1] == 1.0
    assert [grid[i] for i in range(0, 25, 4)] == pytest.approx([2.0 ** -e for e in range(6, -1, -1)])
    logical = [10.0, 20.0, 40.0]
    assert [serve(logical, b) for b in (5, 10, 39, 40, 1e9)] == [0, 0, 1, 2, 2]


def test_options_are_checked_before_any_work(spec_factory):
    bad_options = [(dict(threshold="layer"), "threshold"), (dict(gradient="ste"), "gradient"),
                   (dict(min_fraction="0.0"), "min_fraction"), (dict(fractions="[0.5, 1.5]"), "fractions"),
                   (dict(eval_fractions="[]"), "eval_fractions"), (dict(server_lr="0.0"), "server_lr"),
                   (dict(weight_decay="-1.0"), "weight_decay"), (dict(mix_schedule="mixup", mixup_alpha="0.0"),
                                                                  "mixup_alpha")]
    for options, key in bad_options:
        error = refusal("--algorithm", "FIARSE", *[f"--algorithm.{k}={v}" for k, v in options.items()])
        assert error.key == f"algorithm.{key}" and "\n" not in str(error)
    from fl_lightning.config import DataConfig

    with pytest.raises(ConfigError, match="data.calib_size"):
        from lightning.fabric import Fabric

        from fl_lightning.federation.builder import build_context

        build_context(_digits_spec(spec_factory, FIARSE(), data=DataConfig(dataset=Digits(), val_size=100)),
                      Fabric(accelerator="cpu", devices=1))
    with pytest.raises(ConfigError, match="algorithm.fractions"):
        _context(spec_factory, FIARSE(fractions=[0.5, 1.0]))


@pytest.mark.parametrize("options", [{}, dict(threshold="global", budget_match="macs", gradient="surrogate",
                                             mix_schedule="alternate", weighting="uniform", support="changed")])
def test_two_round_run_on_digits(spec_factory, options):
    from fl_lightning.federation.loop import run_fit

    spec = _digits_spec(spec_factory, FIARSE(eval_fractions=[0.25, 0.5, 1.0], **options))
    summary = run_fit(spec)
    final = summary["final"]
    logical = [final[f"test_point{j:02d}_logical_macs"] for j in range(3)]
    dense = final["test_executed_macs"]
    assert logical == sorted(logical) and logical[-1] == dense and logical[0] < dense
    assert [final[f"test_point{j:02d}_fraction"] for j in range(3)] == pytest.approx([0.25, 0.5, 1.0], abs=1e-4)
    assert sum(final[f"test_point{j:02d}_clients"] for j in range(3)) == 6
    assert 0.0 <= final["test_acc"] <= 1.0 and math.isfinite(final["test_acc"])
    run = spec.run_path
    rows = [json.loads(line) for line in (run / "clients.jsonl").read_text().splitlines()]
    setup = json.loads((run / "fiarse.json").read_text())
    assert len(rows) == 6
    for row in rows:
        if options.get("budget_match") == "macs":  # the largest mask within the budget (or the smallest)
            budget = setup["budgets"][row["client"]]
            assert row["logical_macs"] <= budget or row["fraction"] == pytest.approx(1 / 64)
        else:
            assert row["kept_fraction"] == pytest.approx(setup["fractions"][row["client"]], abs=1e-4)
        assert row["logical_macs"] <= row["executed_macs"] == dense
        assert row["bytes_kept"] <= row["bytes_down"] == row["bytes_up"]
    assert spec.algorithm.state_dict() == {}
