"""Elastic conv/BN layers, width-elastic CNN and ResNet-18: routing, regions, MACs, BN."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from fl_lightning.elastic.bn import recalibrate_bn
from fl_lightning.elastic.layers.conv import ElasticConv2d
from fl_lightning.elastic.layers.norm import ElasticBatchNorm2d
from fl_lightning.elastic.macs import (count_macs, count_params, format_model_table, model_table,
                                       spec_macs, _SPEC_COST)
from fl_lightning.elastic.models import build_model
from fl_lightning.elastic.models.base import ElasticModel
from fl_lightning.elastic.regions import LeadingSlice, RollingSlice
from fl_lightning.elastic.routing import write_back
from fl_lightning.elastic.specs import WidthSpec, spec_from_dict, spec_le, spec_to_dict
from fl_lightning.errors import ConfigError
from fl_lightning.elastic.models import CNN, ResNet18

LEVELS = (0.0625, 0.125, 0.25, 0.5, 0.75, 1.0)


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BN parameters and statistics, so a wrong slice cannot go unnoticed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                for t in (m.weight, m.bias, m.running_mean):
                    t.copy_(torch.randn(t.shape, generator=g) * 0.5)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return model


def random_specs(n_stages: int, count: int, seed: int) -> list[WidthSpec]:
    rng = random.Random(seed)
    return [WidthSpec(tuple(rng.choice(LEVELS) for _ in range(n_stages))) for _ in range(count)]


@pytest.fixture(scope="module")
def cnn():
    torch.manual_seed(0)
    return randomize_bn(build_model(CNN, 10, (3, 12, 12), channels=(16, 24, 32)), 1).eval()


@pytest.fixture(scope="module")
def small_resnet():
    torch.manual_seed(0)
    return randomize_bn(build_model(ResNet18, 10, (3, 16, 16), width=0.25), 2).eval()


@pytest.fixture(scope="module")
def resnet100():
    torch.manual_seed(0)
    return build_model(ResNet18, 100, (3, 32, 32))


def both(request_names=("cnn", "small_resnet")):
    return pytest.mark.parametrize("name", request_names)


# -- layers ----------------------------------------------------------------------------------

def test_conv_extract_matches_slice_forward():
    conv = ElasticConv2d(8, 12, 3, stride=2, bias=True)
    conv.active_out = 5
    x = torch.randn(2, 6, 9, 9)
    plain = conv.extract(6, 5)
    assert type(plain) is nn.Conv2d and plain.weight.shape == (5, 6, 3, 3)
    torch.testing.assert_close(conv(x), plain(x))
    assert conv.regions(6, 5)["weight"].local_shape == (5, 6, 3, 3)
    depthwise = ElasticConv2d(8, 8, 3, groups=8)
    torch.testing.assert_close(depthwise(x), depthwise.extract(6, 6)(x))
    with pytest.raises(ValueError):
        ElasticConv2d(8, 8, 3, groups=2)


def test_bn_slice_updates_parent_statistics_in_place():
    bn = ElasticBatchNorm2d(8, momentum=None)
    x = torch.randn(4, 3, 5, 5) * 2 + 1
    bn.train()
    bn(x)
    bn(x)
    torch.testing.assert_close(bn.running_mean[:3], x.mean((0, 2, 3)))
    torch.testing.assert_close(bn.running_var[:3], x.var((0, 2, 3), unbiased=True))
    assert torch.all(bn.running_mean[3:] == 0) and torch.all(bn.running_var[3:] == 1)
    assert int(bn.num_batches_tracked) == 2
    bn.eval()
    torch.testing.assert_close(bn(x), bn.extract(3).eval()(x))


# -- extraction ------------------------------------------------------------------------------

@both()
@pytest.mark.parametrize("kind", ["leading", "rolling"])
def test_extract_then_write_back_is_identity(name, kind, request):
    model = request.getfixturevalue(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for i, spec in enumerate(random_specs(len(model.channels), 3, seed=hash((name, kind)) % 1000)):
        routed = model.extract(spec, kind=kind, offset=7 * i + 3)
        assert set(routed.regions) == set(routed.module.state_dict())  # params AND buffers
        state = {k: v.clone() for k, v in before.items()}
        write_back(state, routed.module.state_dict(), routed.regions)
        for key in before:
            assert torch.equal(state[key], before[key]), key


@both()
def test_physical_forward_equals_elastic_forward(name, request):
    model = request.getfixturevalue(name)
    x = torch.randn(3, *model.input_shape)
    specs = random_specs(len(model.channels), 4, seed=5) + [model.min_spec(), model.max_spec()]
    for spec in specs:
        model.set_active(spec)
        routed = model.extract(spec)
        plain = routed.module.eval()
        assert not any(isinstance(m, (ElasticConv2d, ElasticBatchNorm2d)) for m in plain.modules())
        assert count_params(plain) == sum(r.numel() for k, (_, r) in routed.regions.items()
                                          if k in dict(plain.named_parameters()))
        torch.testing.assert_close(model(x), plain(x), atol=1e-5, rtol=1e-5)
    model.set_active(model.max_spec())


def test_extraction_copies_and_does_not_alias(cnn):
    routed = cnn.extract(WidthSpec.uniform(0.5, 3))
    with torch.no_grad():
        for p in routed.module.parameters():
            p.add_(1.0)
    first = next(iter(routed.regions))
    assert not torch.equal(routed.module.state_dict()[first], cnn.state_dict()[first][:8])


def test_train_mode_bn_matches_and_writes_back(small_resnet):
    """In training mode both use batch statistics; the running statistics move the same way."""
    spec = WidthSpec((0.5, 0.25, 0.5, 0.75))
    model = build_model(ResNet18, 10, (3, 16, 16), width=0.25)
    model.load_state_dict(small_resnet.state_dict())
    routed = model.extract(spec)
    x = torch.randn(4, 3, 16, 16)
    model.train().set_active(spec)
    plain = routed.module.train()
    untouched = model.layer4[1].bn2.running_mean[96:].clone()
    torch.testing.assert_close(model(x), plain(x), atol=1e-5, rtol=1e-5)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    write_back(state, plain.state_dict(), routed.regions)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=1e-6, rtol=1e-6)
    assert torch.equal(model.layer4[1].bn2.running_mean[96:], untouched)


@both()
def test_block_boundaries_compose(name, request):
    model = request.getfixturevalue(name)
    model.set_active(model.max_spec())
    x = torch.randn(2, *model.input_shape)
    full = model(x)
    for block in model.block_names:
        torch.testing.assert_close(model.forward_from(model.forward_until(x, block), block), full)
    torch.testing.assert_close(model.forward_until(x, model.block_names[-1]), model.forward_features(x))
    with pytest.raises(KeyError):
        model.forward_until(x, "nope")


# -- regions ---------------------------------------------------------------------------------

@both()
def test_regions_are_nested(name, request):
    model = request.getfixturevalue(name)
    rng = random.Random(3)
    for b in random_specs(len(model.channels), 6, seed=11):
        a = WidthSpec(tuple(min(w, rng.choice(LEVELS)) for w in b.widths))
        assert spec_le(a, b)
        small, large = model.regions(a), model.regions(b)
        for key, (_, region) in small.items():
            assert isinstance(region, LeadingSlice)
            assert large[key][1].contains(region), key


def test_spec_order_and_round_trip():
    a, b = WidthSpec((0.25, 0.5)), WidthSpec((0.5, 0.5))
    assert spec_le(a, b) and not spec_le(b, a)
    assert not spec_le(WidthSpec((0.25, 1.0)), WidthSpec((0.5, 0.5)))  # incomparable
    assert spec_from_dict(WidthSpec, spec_to_dict(a)) == a
    with pytest.raises(ValueError):
        WidthSpec((0.0, 1.0))


def test_rolling_regions_wrap(cnn):
    spec = WidthSpec.uniform(0.5, 3)
    regions = cnn.regions(spec, kind="rolling", offset=13)
    weight = regions["features.block0.conv.weight"][1]  # 16 output channels, 8 active
    assert isinstance(weight, RollingSlice)
    assert weight.indices[0].tolist() == [13, 14, 15, 0, 1, 2, 3, 4]
    assert weight.indices[1].tolist() == [0, 1, 2]  # image channels stay whole
    nxt = regions["features.block1.conv.weight"][1]
    assert nxt.indices[1].tolist() == weight.indices[0].tolist()  # out window = next in window
    leading = cnn.regions(spec)
    for key, (_, region) in cnn.regions(spec, kind="rolling", offset=0).items():
        assert torch.equal(region.gather(cnn.state_dict()[key]), leading[key][1].gather(cnn.state_dict()[key]))


@both()
def test_rolling_full_width_is_a_consistent_permutation(name, request):
    """At full width a rolled extraction permutes hidden channels; the function is unchanged."""
    model = request.getfixturevalue(name)
    model.set_active(model.max_spec())
    x = torch.randn(2, *model.input_shape)
    rolled = model.extract(model.max_spec(), kind="rolling", offset=5).module.eval()
    assert not torch.equal(rolled.state_dict()["stem.conv.weight" if name == "small_resnet"
                                                 else "features.block0.conv.weight"],
                           model.state_dict()["stem.conv.weight" if name == "small_resnet"
                                              else "features.block0.conv.weight"])
    torch.testing.assert_close(rolled(x), model(x), atol=1e-5, rtol=1e-5)


def test_rolling_window_equals_leading_slice_of_rolled_model(cnn):
    offset, spec = 9, WidthSpec((0.5, 0.25, 0.75))
    rolled_full = cnn.extract(cnn.max_spec(), kind="rolling", offset=offset).module
    shifted = build_model(CNN, 10, (3, 12, 12), channels=(16, 24, 32))
    shifted.load_state_dict(rolled_full.state_dict())
    expected = shifted.extract(spec).module.state_dict()
    got = cnn.extract(spec, kind="rolling", offset=offset).module.state_dict()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


# -- MACs and sizes --------------------------------------------------------------------------

def test_memoized_macs_equal_fvcore_on_extracted_model(cnn):
    spec = WidthSpec((0.5, 0.25, 1.0))
    counted = count_macs(cnn.extract(spec).module, cnn.input_shape)
    assert spec_macs(cnn, spec, cnn.input_shape) == counted
    hits = _SPEC_COST.hits
    assert spec_macs(cnn, spec, cnn.input_shape) == counted
    assert _SPEC_COST.hits == hits + 1
    # One multiply-add is one MAC: a lone 3x3 conv 2->4 on 5x5 costs 4*5*5*2*9.
    assert count_macs(nn.Conv2d(2, 4, 3, padding=1, bias=False), (2, 5, 5)) == 4 * 25 * 2 * 9


def test_macs_of_ops_fvcore_leaves_uncounted():
    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.lstm = nn.Embedding(20, 8), nn.LSTM(8, 16, 2, batch_first=True)

        def forward(self, x):
            return self.lstm(self.embed(x))[0]

    class Attention(nn.Module):
        def forward(self, x):
            q = x.view(1, 2, 10, 8)
            return nn.functional.scaled_dot_product_attention(q, q, q)

    weights = 4 * 16 * 8 + 3 * 4 * 16 * 16  # w_ih and w_hh of two layers, one MAC per entry
    assert count_macs(Recurrent(), (12,), torch.long) == 12 * weights
    assert count_macs(Attention().eval(), (20, 8)) == 2 * (2 * 10 * 10 * 8)


def test_resnet18_size_and_quadratic_law(resnet100):
    shape = (3, 32, 32)
    rows = model_table(resnet100, [WidthSpec.uniform(r, 4) for r in (1.0, 0.5, 0.25)], shape)
    full = rows[0]
    assert abs(full["params"] - 11.22e6) <= 0.01e6
    assert count_params(resnet100) == full["params"]
    assert abs(full["macs"] - 556e6) <= 0.02 * 556e6
    half, quarter = rows[1], rows[2]
    for share in ("params_share", "macs_share"):
        assert 0.24 <= half[share] <= 0.265
        assert 0.06 <= quarter[share] <= 0.07
    text = format_model_table(rows)
    assert "width=0.25" in text and "11.220M" in text


# -- batch norm recalibration ----------------------------------------------------------------

def test_recalibration_is_deterministic_and_keeps_parameters(cnn):
    model = build_model(CNN, 10, (3, 12, 12), channels=(16, 24, 32))
    model.load_state_dict(cnn.state_dict())
    model.eval()
    model.set_active(WidthSpec.uniform(0.5, 3))
    params = {k: p.clone() for k, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(5, 3, 12, 12, generator=g) for _ in range(3)]

    assert recalibrate_bn(model, [(b, None) for b in batches]) == 3
    first = {k: v.clone() for k, v in model.state_dict().items()}
    recalibrate_bn(model, iter(batches))
    for key, value in model.state_dict().items():
        assert torch.equal(first[key], value), key
    for key, p in model.named_parameters():
        assert torch.equal(p, params[key]), key
    assert not model.training
    assert all(m.momentum == 0.1 for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    # The running mean is the average of the per-batch means; inactive channels are reset.
    bn = model.features.block0.bn
    means = [model.features.block0.conv(b).mean((0, 2, 3)) for b in batches]
    torch.testing.assert_close(bn.running_mean[:8], torch.stack(means).mean(0), atol=1e-5, rtol=1e-5)
    assert torch.all(bn.running_mean[8:] == 0)
    with pytest.raises(ValueError):
        recalibrate_bn(model, [])


# -- registry --------------------------------------------------------------------------------

def test_every_exported_model_is_elastic_and_unknown_ones_name_the_key():
    import fl_lightning.elastic.models as models

    exported = [getattr(models, name) for name in models.__all__ if name[0].isupper()]
    assert len(exported) == 6 and all(issubclass(cls, ElasticModel) for cls in exported)
    with pytest.raises(ConfigError) as err:
        build_model("fl_lightning.elastic.models.ResNet19", 10, (3, 32, 32))
    assert err.value.key == "model" and "fl_lightning.elastic.models.ResNet18" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build_model("fl_lightning.elastic.specs.WidthSpec", 10, (3, 32, 32))
    assert err.value.key == "model" and "not an ElasticModel" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build_model(CNN, 10, (1, 8, 8), depth=3)
    assert err.value.key == "model" and "depth" in str(err.value)


def test_cnn_handles_digit_and_emnist_shapes():
    for shape in [(1, 8, 8), (1, 28, 28), (3, 32, 32)]:
        model = build_model(CNN, 10, shape).eval()
        assert model(torch.randn(2, *shape)).shape == (2, 10)
