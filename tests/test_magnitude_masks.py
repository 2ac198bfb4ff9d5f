"""The fast paths of FIARSE's masks against straightforward reference computations: binned
threshold selection, the hardshrink forward and backward, mask-region accumulation and the
regions a round shares between clients of one kept fraction."""

import math

import numpy as np
import pytest
import torch

from fl_lightning.data import Digits
from fl_lightning.elastic import magnitude_masks as mm
from fl_lightning.elastic.aggregation import SparseAccumulator
from fl_lightning.elastic.magnitude_masks import MaskFamily, kept_count, shrink_bound, threshold_mask
from fl_lightning.elastic.regions import Full, Mask


def magnitudes_with_ties(n: int, seed: int = 0) -> torch.Tensor:
    """Weights whose magnitudes repeat (ties), include zeros, and span many bins and octaves."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
    w[: n // 10] = torch.round(w[: n // 10] * 8) / 8  # many exact ties on a coarse grid
    w[n // 10: n // 10 + 50] = 0.0
    w[-7:] = torch.tensor([1e-40, -1e-40, 3.0, -3.0, 3.0, 1e30, -1e30])  # subnormal, ties, huge
    return w[torch.randperm(n, generator=g)]


def reference_tau(values: np.ndarray, k: int) -> float:
    return float(np.sort(np.abs(values))[::-1][k - 1])


@pytest.mark.parametrize("grouping", ["one", "two"])
def test_binned_selection_equals_the_kth_largest_magnitude(grouping):
    n = mm._BINNED_MIN + 12_345
    w = magnitudes_with_ties(n)
    if grouping == "one":
        state, groups = {"a.weight": w[: n - n % 5].view(-1, 5)}, {"g": ["a.weight"]}
    else:  # a group of two tensors: one threshold over both
        state = {"a.weight": w[:1000].view(10, 100), "b.weight": w[1000:]}
        groups = {"g": ["a.weight", "b.weight"]}
    values = torch.cat([v.flatten() for v in state.values()]).numpy()
    family = MaskFamily(state, groups)
    assert family._group_abs["g"].numel() >= mm._BINNED_MIN  # the binned path, not kthvalue
    for fraction in (1 / values.size, 1 / 64, 0.013, 1 / 16, 0.25, 0.3333, 0.5, 0.9, 0.999, 1.0):
        k = kept_count(values.size, fraction)
        tau = family.thresholds(fraction)["a.weight"]
        assert float(tau) == reference_tau(values, k), fraction
        direct = torch.kthvalue(family._group_abs["g"], values.size - k + 1).values
        assert torch.equal(tau, direct)  # the selection it replaces, bit for bit


def test_binned_selection_of_every_k_on_a_tie_heavy_group(monkeypatch):
    monkeypatch.setattr(mm, "_BINNED_MIN", 1)  # bin even a small group
    w = torch.tensor([0.5, -0.5, 0.5, 0.25, 0.0, -0.0, 2.0, 0.125, 0.5, 1e-42, 0.2500001])
    family = MaskFamily({"w": w}, {"g": ["w"]})
    for k in range(1, w.numel() + 1):
        assert float(family._tau("g", k)) == reference_tau(w.numpy(), k), k


def reference_mask(weight, tau, gradient, grad):
    """The boolean-mask computation: ``w * 1{|w| >= tau}`` and its gradient."""
    w = weight.detach().clone().requires_grad_(True)
    out = mm.ThresholdMask.apply(w, tau.to(w.dtype), gradient == "surrogate", None)
    out.backward(grad)
    return out.detach(), w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gradient", ["masked", "surrogate"])
def test_hardshrink_mask_equals_the_boolean_mask_forward_and_backward(dtype, gradient):
    torch.manual_seed(0)
    weight = torch.randn(4000, dtype=dtype)
    tau = weight.abs().kthvalue(3000).values
    weight[:5] = torch.stack([tau, -tau, torch.nextafter(tau, torch.zeros_like(tau)), -tau * 2, 0 * tau])
    grad = torch.randn_like(weight)
    for t in (tau, torch.zeros((), dtype=dtype), weight.abs().min(), weight.abs().max()):
        bound = shrink_bound(t, dtype)
        assert bound is not None
        w = weight.clone().requires_grad_(True)
        out = threshold_mask(w, t, gradient, bound)
        out.backward(grad)
        expected, expected_grad = reference_mask(weight, t, gradient, grad)
        assert torch.equal(out.detach(), expected)  # -0.0 == 0.0: equal values
        assert torch.equal(w.grad, expected_grad)
        # ties at tau are kept, the largest value below tau is not
        assert bool(out[0] == weight[0]) == bool(weight[0].abs() >= t)
        assert bool(out[2] != 0) == bool(weight[2].abs() >= t)


def test_shrink_bound_falls_back_where_no_exact_bound_exists():
    assert shrink_bound(torch.tensor(0.5), torch.bfloat16) is None
    assert shrink_bound(torch.tensor(1e-40), torch.float32) is None  # subnormal
    assert shrink_bound(torch.tensor(math.inf), torch.float32) is None
    assert shrink_bound(torch.tensor(0.0), torch.float32) < 0  # keeps everything, zeros included
    w = torch.tensor([1e-40, -2e-40, 0.5], requires_grad=True)
    out = threshold_mask(w, torch.tensor(1.5e-40), "masked")  # the boolean-mask path
    out.sum().backward()
    assert out.detach().tolist() == [0.0, pytest.approx(-2e-40), 0.5] and w.grad.tolist() == [0.0, 1.0, 1.0]


def test_mask_region_accumulation_equals_the_where_reference():
    torch.manual_seed(1)
    shape = (7, 5, 3)
    masks = [torch.rand(shape) < p for p in (0.2, 0.5, 0.9)]
    locals_ = [torch.randn(shape) for _ in masks]
    weights = [3.0, 17.0, 1.0]
    old = torch.randn(shape)
    acc = SparseAccumulator({"w": old, "b": torch.randn(5)}, dense=False)
    shared = Mask(masks[0])
    for i, (m, x, n) in enumerate(zip(masks, locals_, weights)):
        region = shared if i == 0 else Mask(m)
        acc.add({"w": x, "b": torch.ones(5)}, n, {"w": ("w", region), "b": ("b", Full((5,)))})
    acc.add({"w": locals_[0] * 2, "b": torch.ones(5)}, 5.0, {"w": ("w", shared), "b": ("b", Full((5,)))})
    # reference: where-selected float64 sums and counts, the old value where nobody covered
    value = torch.zeros(shape, dtype=torch.float64)
    count = torch.zeros(shape, dtype=torch.float64)
    for m, x, n in list(zip(masks, locals_, weights)) + [(masks[0], locals_[0] * 2, 5.0)]:
        value += n * torch.where(m, x.double(), torch.zeros((), dtype=torch.float64))
        count += n * m.double()
    expected = torch.where(count > 0, value / torch.where(count > 0, count, torch.ones_like(count)), old.double()).float()
    assert torch.equal(acc.result()["w"], expected)
    assert shared.numel() == int(masks[0].sum())


def test_a_round_shares_one_region_map_per_kept_fraction(spec_factory):
    from lightning.fabric import Fabric

    from fl_lightning.algorithms.supernet.fiarse import FIARSE
    from fl_lightning.config import DataConfig, FederationConfig, PartitionConfig
    from fl_lightning.federation.builder import build_context
    from fl_lightning.runtime.plan import ClientTask, RoundPlan

    alg = FIARSE(fractions=[0.25, 0.5, 0.25, 1.0], recalibrate_bn=False)
    spec = spec_factory(name="fiarse_share", algorithm=alg, data=DataConfig(dataset=Digits(), val_size=100),
                        partition=PartitionConfig(method="iid", num_clients=4),
                        federation=FederationConfig(rounds=1, clients_per_round=4))
    build_context(spec, Fabric(accelerator="cpu", devices=1), mode="fit")
    plan = RoundPlan(0, 0.1, [ClientTask(c) for c in range(4)])
    routed = [alg.route(task, plan) for task in plan.tasks]
    assert routed[0].regions is routed[2].regions and routed[0].regions is not routed[1].regions
    family = alg.family()
    for r, f in zip(routed, [0.25, 0.5, 0.25, 1.0]):  # the masks and counts of the straightforward route
        masks = family.masks(alg.global_state, family.thresholds(f))
        assert r.kept == {k: int(m.sum()) for k, m in masks.items()}
        assert all(torch.equal(r.regions[k][1].mask, m) for k, m in masks.items())
