"""Elastic extraction: a reduced local model that is itself elastic (FjORD's ordered dropout in
one local model, FEAST's reduced supernet), and the shared extraction mechanism."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fl_lightning.elastic.envelope import envelope, route_envelope
from fl_lightning.elastic.layers.conv import ElasticConv2d
from fl_lightning.elastic.layers.linear import ElasticLinear
from fl_lightning.elastic.layers.norm import ElasticBatchNorm2d
from fl_lightning.elastic.layers.sequence import ElasticLSTM
from fl_lightning.elastic.models import CNN, CharLSTM, OFAResNet, ResNet18, ViT, build_model
from fl_lightning.elastic.models.ofa_resnet import OFASpec
from fl_lightning.elastic.routing import Routed, write_back
from fl_lightning.elastic.specs import WidthSpec, spec_le

ATOL = 1e-5


def randomize_norms(model: nn.Module, seed: int) -> nn.Module:
    """Non-trivial BN parameters and statistics, so a wrong slice changes eval outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return model


# Each case: a global model, an input, the width p a client holds and smaller widths q <= p.
def cnn_case():
    model = randomize_norms(build_model(CNN, 10, (3, 12, 12), channels=(16, 24, 32)), 1)
    p = WidthSpec((0.5, 0.75, 0.5))
    qs = [WidthSpec((0.25, 0.5, 0.5)), WidthSpec.uniform(0.0625, 3), WidthSpec((0.5, 0.25, 0.125)), p]
    return model, torch.randn(3, 3, 12, 12), p, qs


def resnet_case():
    model = randomize_norms(build_model(ResNet18, 10, (3, 16, 16), width=0.25), 2)
    p = WidthSpec.uniform(0.5, 4)
    qs = [WidthSpec.uniform(0.25, 4), WidthSpec((0.125, 0.5, 0.25, 0.0625)), p]
    return model, torch.randn(2, 3, 16, 16), p, qs


def lstm_case():
    model = build_model(CharLSTM, 30, (12,), hidden_size=40)
    p = WidthSpec((0.6,))  # 24 of 40 hidden units
    qs = [WidthSpec((0.5,)), WidthSpec((0.3,)), WidthSpec((0.0625,)), p]
    return model, torch.randint(0, 30, (3, 12)), p, qs


def ofa_case(block="basic_pair"):
    model = randomize_norms(build_model(OFAResNet, 10, (3, 16, 16), block=block, width_scale=0.125,
                                        max_extra_blocks=2, divisor=2), 3)
    p = OFASpec((1, 2, 0, 1), (0.25,) * 4, (6, 9, 4, 7, 5))
    qs = [OFASpec((0, 2, 0, 1), (0.1, 0.18, 0.25, 0.14), (6, 3, 4, 7, 0)),
          OFASpec((1, 0, 0, 0), (0.14,) * 4, (0,) * 5), p]
    return model, torch.randn(2, 3, 16, 16), p, qs


CASES = {"cnn": cnn_case, "resnet18": resnet_case, "lstm": lstm_case, "ofa_resnet": ofa_case,
         "ofa_resnet_bottleneck": lambda: ofa_case("bottleneck")}


@pytest.fixture(params=sorted(CASES))
def case(request):
    torch.manual_seed(0)
    model, x, p, qs = CASES[request.param]()
    return model.eval(), x, p, qs


def test_reduced_model_runs_every_smaller_spec_like_the_global_model(case):
    model, x, p, qs = case
    reduced = model.extract(p, elastic=True)
    local = reduced.module
    assert isinstance(local, type(model)) and local.max_spec() == model.routed_spec(p, True)
    assert sum(t.numel() for t in local.parameters()) < sum(t.numel() for t in model.parameters())
    assert not local.training
    for q in qs:
        assert spec_le(q, model.routed_spec(p, True))
        model.set_active(q)
        local.set_active(q)
        expected = model(x)
        torch.testing.assert_close(local(x), expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(model.extract(q).module.eval()(x), expected, atol=ATOL, rtol=0)
    model.set_active(model.max_spec())


def test_reduced_model_write_back_is_identity_and_covers_its_spec(case):
    model, _, p, _ = case
    reduced = model.extract(p, elastic=True)
    assert set(reduced.regions) == set(reduced.module.state_dict())
    assert {k: (g, r.local_shape) for k, (g, r) in reduced.regions.items()} == \
           {k: (g, r.local_shape) for k, (g, r) in model.regions(model.routed_spec(p, True)).items()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    after = {k: v.clone() for k, v in before.items()}
    write_back(after, reduced.module.state_dict(), reduced.regions)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    # copies, not views of the global tensors
    shared = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    assert not shared & {t.untyped_storage().data_ptr() for t in reduced.module.state_dict().values()}


def test_reduced_model_refuses_larger_specs(case):
    model, _, p, _ = case
    local = model.extract(p, elastic=True).module
    with pytest.raises(ValueError):
        local.set_active(model.max_spec())


def test_training_a_smaller_width_inside_the_reduced_model_writes_back_its_slice():
    """FjORD: a step at width q inside the local model at p changes only q's positions."""
    torch.manual_seed(0)
    model = build_model(CNN, 10, (3, 12, 12), channels=(16, 24, 32))
    p, q = WidthSpec.uniform(0.5, 3), WidthSpec.uniform(0.25, 3)
    routed = model.extract(p, elastic=True)
    local = routed.module.train()
    local.set_active(q)
    nn.functional.cross_entropy(local(torch.randn(4, 3, 12, 12)), torch.tensor([0, 1, 2, 3])).backward()
    with torch.no_grad():
        for t in local.parameters():
            t.sub_(t.grad)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    write_back(state, local.state_dict(), routed.regions)
    inside = model.regions(q)
    for key, value in model.state_dict().items():
        if not value.is_floating_point():
            continue
        changed = (state[key] != value).float()
        mask = torch.zeros_like(changed)
        inside[key][1].fill_add(mask, 1.0)
        assert torch.all(changed <= mask), key  # nothing outside q's slice moved


def test_envelope_route_is_the_elastic_extraction_of_the_envelope():
    model = build_model(OFAResNet, 10, (3, 16, 16), width_scale=0.125, max_extra_blocks=2, divisor=2)
    group = [OFASpec((0, 1, 2, 0), (0.1, 0.14, 0.1, 0.1), (2, 5, 1, 0, 3)),
             OFASpec((2, 1, 0, 0), (0.1, 0.18, 0.1, 0.1), (1, 6, 1, 2, 0))]
    routed = route_envelope(model, group)
    direct = model.extract(envelope(group), elastic=True)
    assert routed.module.max_spec() == direct.module.max_spec() == envelope(group)
    assert {k: r.local_shape for k, (_, r) in routed.regions.items()} == \
           {k: r.local_shape for k, (_, r) in direct.regions.items()}
    # an elastic extraction at any expansion keeps every expansion choice (Supp. C)
    narrow = model.extract(OFASpec((0, 1, 2, 0), (0.1,) * 4, (2, 5, 1, 0, 3)), elastic=True)
    assert narrow.module.expansions == model.expansions
    assert narrow.module.max_spec().e == (model.max_expansion,) * 4


def test_every_model_extracts_through_the_shared_mechanism():
    models = [build_model(CNN, 10, (1, 8, 8)), build_model(ResNet18, 10, (3, 8, 8), width=0.125),
              build_model(CharLSTM, 20, (6,), hidden_size=16), build_model(ViT, 10, (3, 8, 8), depth=1),
              build_model(OFAResNet, 10, (3, 8, 8), width_scale=0.0625, max_extra_blocks=1, divisor=2)]
    elastic_layers = (ElasticConv2d, ElasticBatchNorm2d, ElasticLinear, ElasticLSTM)
    for model in models:
        assert "extract" not in type(model).__dict__  # one mechanism, in ElasticModel
        for elastic in (False, True):
            routed = model.extract(model.min_spec(), elastic=elastic)
            assert isinstance(routed, Routed) and routed.module.training == model.training
            has_elastic = any(isinstance(m, elastic_layers) for m in routed.module.modules())
            if elastic:
                assert isinstance(routed.module, type(model))
                assert has_elastic or isinstance(model, ViT)  # the ViT has no elastic layers yet
            else:
                assert not has_elastic


def test_extraction_follows_the_global_dtype():
    model = build_model(CNN, 10, (1, 8, 8)).double()
    routed = model.extract(WidthSpec.uniform(0.5, 3), elastic=True)
    state = routed.module.state_dict()
    assert all(t.dtype == torch.float64 for k, t in state.items() if not k.endswith("num_batches_tracked"))
    assert routed.payload_bytes() == sum(t.numel() * t.element_size() for t in state.values())
    routed.module(torch.randn(2, 1, 8, 8, dtype=torch.float64))


def test_payload_bytes_counts_parameters_and_buffers_at_local_precision():
    model = build_model(CNN, 10, (1, 8, 8), channels=(8, 8, 8))
    routed = model.extract(WidthSpec.uniform(0.5, 3))
    state = routed.module.state_dict()
    params = sum(t.numel() for t in routed.module.parameters())
    buffers = sum(t.numel() * t.element_size() for _, t in routed.module.named_buffers())
    assert routed.payload_bytes() == 4 * params + buffers
    assert routed.payload_bytes() == sum(t.numel() * t.element_size() for t in state.values())
    half = Routed(routed.module.half(), routed.regions)
    assert half.payload_bytes() == sum(t.numel() * (2 if t.is_floating_point() else 8)
                                       for t in state.values())
