"""FEAST's OFA-style supernet: size, MAC span, extraction, envelope routing, nestedness."""

import pytest
import torch

from fl_lightning.elastic.envelope import (communication, envelope, full_param_count, route_envelope,
                                           routed_param_count)
from fl_lightning.elastic.macs import spec_macs
from fl_lightning.elastic.models import build_model
from fl_lightning.elastic.models.ofa_resnet import OFAResNet, OFASpec
from fl_lightning.elastic.models.ofa_resnet import make_divisible as model_make_divisible
from fl_lightning.elastic.regions import LeadingSlice
from fl_lightning.elastic.routing import write_back
from fl_lightning.elastic.search import cost_model
from fl_lightning.elastic.specs import spec_le
from fl_lightning.errors import ConfigError
from hand_counts import basic_pair_paper_macs, basic_pair_params, bottleneck_params, hooked_macs, make_divisible

SHAPE = (3, 16, 16)



@pytest.fixture(scope="module", params=["bottleneck", "basic_pair"])
def small(request):
    """A narrowed supernet of each construction (same search space, 1/8 width, up to 2 extra
    blocks) with non-trivial BN statistics, so eval-mode outputs depend on every sliced tensor."""
    torch.manual_seed(0)
    model = build_model(OFAResNet, 10, SHAPE, block=request.param, width_scale=0.125, max_extra_blocks=2,
                        divisor=2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.0)
                m.bias.uniform_(-0.1, 0.1)
    return model.eval()


@pytest.fixture
def x():
    return torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(1))


def specs(model, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [model.sample_spec(g) for _ in range(n)]


def raise_spec(model, spec, g):
    """A random spec coordinate-wise >= ``spec``."""
    def up(v, top):
        return int(torch.randint(v, top + 1, (1,), generator=g))
    exps = model.expansions
    return OFASpec(tuple(up(d, m) for d, m in zip(spec.d, model.max_extra_blocks)),
                   tuple(exps[up(exps.index(e), len(exps) - 1)] for e in spec.e),
                   tuple(up(w, m) for w, m in zip(spec.w, model.max_width_index)))


def coverage(model, regions_list):
    """Count accumulators of the global shape: how many region maps cover each position."""
    counts = {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}
    for regions in regions_list:
        for _, (key, region) in regions.items():
            region.fill_add(counts[key], 1.0)
    return counts


# -- the paper-scale supernet ----------------------------------------------------------------

def hand_param_count(model, spec):
    """Parameters of ``spec`` from the construction's options, OFA's rounding and the layer
    shapes, written out here (``hand_counts``), not read from the model's channel methods."""
    a = model.arch
    md = lambda v: make_divisible(v, a["divisor"])  # noqa: E731
    mult = a["width_multipliers"]
    stem = md(a["stem_channels"] * a["width_scale"] * mult[spec.w[0]])
    stages = []
    for l, (d, e) in enumerate(zip(spec.d, spec.e)):
        out = md(a["stage_channels"][l] * a["width_scale"] * mult[spec.w[l + 1]])
        stages.append((out, md(round(out * e) if a["round_middle"] else out * e), 1 + d))
    count = bottleneck_params if a["block"] == "bottleneck" else basic_pair_params
    return count(stem, stages, model.num_classes)


def test_feast_supernet_is_the_default_and_has_55_68m_parameters():
    """The default construction is FEAST's (DeepFedNAS's blocks): the paper's base channels
    [128, 256, 512, 1024] (Supp. B), DeepFedNAS's 64-channel stem, middle 0.25 x out at the
    largest expansion, nine blocks per stage; 55.68M parameters at 100 classes (paper)."""
    with torch.device("meta"):
        model = build_model(OFAResNet, 100, (3, 32, 32))
    assert model.arch["block"] == "basic_pair"
    by_hand = basic_pair_params(64, [(128, 32, 9), (256, 64, 9), (512, 128, 9), (1024, 256, 9)], 100)
    assert full_param_count(model) == by_hand
    assert round(by_hand / 1e6, 2) == 55.68
    assert [model.stem_width(i) for i in range(10)] == [8, 16, 24, 24, 32, 40, 48, 48, 56, 64]
    assert [model.stage_width(l, 9) for l in range(4)] == [128, 256, 512, 1024]
    assert [model.stage_width(0, i) for i in range(10)] == [16, 24, 40, 48, 64, 80, 88, 104, 112, 128]
    assert [len(stage) for stage in model.stages] == [9, 9, 9, 9]
    first, other = model.stages[3][0], model.stages[3][1]
    assert first.conv1.weight.shape == (256, 512, 3, 3)  # in -> middle = 0.25 x 1024, 3x3
    assert first.conv2.weight.shape == (1024, 256, 3, 3)  # middle -> out, 3x3
    assert first.shortcut.conv.weight.shape == (1024, 512, 1, 1)
    assert isinstance(other.shortcut, torch.nn.Identity)
    # projection on stage 1's first block too (64 -> 128), no stride there at 32 px
    assert model.stages[0][0].shortcut.conv.weight.shape == (128, 64, 1, 1)
    assert model.arch["stage_strides"] == (1, 2, 2, 2) and model.arch["stem_stride"] == 1


def test_bottleneck_supernet_has_55_68m_parameters():
    with torch.device("meta"):
        model = build_model(OFAResNet, 100, (3, 32, 32), block="bottleneck")
    by_hand = bottleneck_params(128, [(256, 64, 9), (512, 128, 9), (1024, 256, 9), (2048, 512, 9)], 100)
    assert full_param_count(model) == by_hand
    assert round(by_hand / 1e6, 2) == 55.68
    assert model.stem_width(9) == 128
    assert [model.stage_width(l, 9) for l in range(4)] == [256, 512, 1024, 2048]
    assert [len(stage) for stage in model.stages] == [9, 9, 9, 9]
    assert model.stages[3][0].conv2.weight.shape[0] == 512  # middle = 0.25 x 2048


@pytest.mark.parametrize("block", ["basic_pair", "bottleneck"])
def test_subnets_match_the_parameter_count_by_hand(block):
    """basic_pair: DeepFedNAS's counting rule (utils/subnet_cost.py); bottleneck: its layers."""
    with torch.device("meta"):
        model = build_model(OFAResNet, 100, (3, 32, 32), block=block)
    g = torch.Generator().manual_seed(7)
    for spec in [model.min_spec(), model.max_spec()] + [model.sample_spec(g) for _ in range(6)]:
        with torch.device("meta"):
            local = model.build_local(spec, elastic=False)
        assert sum(p.numel() for p in local.parameters()) == hand_param_count(model, spec), spec


# Cached variants of FEAST's code release (bostankhan6/FEAST,
# subnet_caches/extended_range_25M_1500M.csv): macs, params, d, e, w. Its counter ran at
# 10 classes (the config's n_classes was not changed) and counts convolutions and the linear
# layer only.
FEAST_CACHE_ROWS = [
    (24_957_968, 327_522, (3, 7, 6, 7), (0.18, 0.18, 0.1, 0.1), (2, 0, 0, 0, 0)),
    (34_584_608, 803_754, (4, 7, 8, 7), (0.25, 0.25, 0.14, 0.1), (1, 0, 0, 0, 1)),
    (284_466_160, 3_879_610, (8, 8, 8, 8), (0.1, 0.1, 0.1, 0.1), (7, 6, 3, 3, 3)),
    (595_671_072, 11_782_122, (8, 8, 8, 8), (0.18, 0.1, 0.1, 0.1), (9, 4, 6, 7, 6)),
]


def test_basic_pair_reproduces_feast_cache_figures():
    """The paper's cached variants have exactly the published parameters and MACs here."""
    with torch.device("meta"):
        model = build_model(OFAResNet, 10, (3, 32, 32), block="basic_pair")
    for macs, params, d, e, w in FEAST_CACHE_ROWS:
        spec = OFASpec(d, e, w)
        local = model.reduced(spec).extract(spec).module
        assert sum(p.numel() for p in local.parameters()) == params, spec
        assert hooked_macs(local, (3, 32, 32))["paper"] == macs, spec
    # rounding out * e first (FEAST's network code) widens stage 2 of the 284M variant: 17.6 -> 24
    assert model.mid_width(176, 0.1) == 16
    rounded = build_model(OFAResNet, 10, (3, 32, 32), block="basic_pair", round_middle=True,
                          max_extra_blocks=0, max_width_index=(0,) * 5)
    assert rounded.mid_width(176, 0.1) == 24


def test_basic_pair_tinyimagenet_stem_strides_like_feast_code():
    model = OFAResNet(200, (3, 64, 64), block="basic_pair", max_extra_blocks=0, max_width_index=(0,) * 5)
    cifar = OFAResNet(200, (3, 32, 32), block="basic_pair", max_extra_blocks=0, max_width_index=(0,) * 5)
    assert model.arch["stem_stride"] == 2 and model.arch["stage_strides"] == (1, 2, 2, 2)
    spec = model.min_spec()
    # the stem brings 64 px to 32 px, so every layer costs what it costs on CIFAR
    assert spec_macs(model, spec, (3, 64, 64)) == spec_macs(cifar, spec, (3, 32, 32))
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 200)
    with pytest.raises(ConfigError, match="block"):
        build_model(OFAResNet, 10, SHAPE, block="inverted")


def test_mac_span_brackets_the_papers_cache_at_32px():
    """The smallest and largest subnets, counted in the paper's convention three ways (hooks on
    the plain module, the closed form over hand-derived channels, the cost model), enclose the
    paper's cache, 24.96M-595.67M MACs (Supp. Table 1; the release's exact end rows)."""
    with torch.device("meta"):
        full = build_model(OFAResNet, 100, (3, 32, 32))
        smallest, largest = (full.build_local(s, elastic=False) for s in (full.min_spec(), full.max_spec()))
    # w = 0 (x0.1): stem md(6.4) = 8, stages md(12.8, 25.6, 51.2, 102.4) = 16, 24, 48, 104;
    # e = 0.1: middles md(1.6, 2.4, 4.8) = 8 and md(10.4) = 16 (8 would lose over 10%).
    low = basic_pair_paper_macs(8, [(16, 8, 1), (24, 8, 1), (48, 8, 1), (104, 16, 1)], (1, 2, 2, 2), 100)
    high = basic_pair_paper_macs(64, [(128, 32, 9), (256, 64, 9), (512, 128, 9), (1024, 256, 9)], (1, 2, 2, 2), 100)
    cost = cost_model(full)
    assert hooked_macs(smallest, (3, 32, 32))["paper"] == low == cost.spec_macs(full.min_spec())
    assert hooked_macs(largest, (3, 32, 32))["paper"] == high == cost.spec_macs(full.max_spec())
    assert low < FEAST_CACHE_ROWS[0][0] and FEAST_CACHE_ROWS[-1][0] < high


def test_tinyimagenet_stem_sees_full_resolution():
    """Bottleneck construction at 64 px: stride-2 first stage, the stem at full resolution."""
    cifar = OFAResNet(200, (3, 32, 32), block="bottleneck", max_extra_blocks=0, max_width_index=(0,) * 5)
    tiny = OFAResNet(200, (3, 64, 64), block="bottleneck", max_extra_blocks=0, max_width_index=(0,) * 5)
    assert tiny.arch["stage_strides"] == (2, 2, 2, 2) and cifar.arch["stage_strides"] == (1, 2, 2, 2)
    spec = cifar.min_spec()
    c, t = spec_macs(cifar, spec, (3, 32, 32)), spec_macs(tiny, spec, (3, 64, 64))
    # Same stage resolutions from the first stride on; only the stem (3x3, 3 -> 16, + BN) and
    # stage 1's first 1x1 conv (16 -> mid 8, + BN) run at 64x64 instead of 32x32 (fvcore).
    per_position = 3 * 16 * 9 + 2 * 16 + 16 * 8 + 2 * 8
    assert t - c == (64 * 64 - 32 * 32) * per_position
    assert tiny(torch.randn(1, 3, 64, 64)).shape == (1, 200)


# -- specs ---------------------------------------------------------------------------------

def test_make_divisible_is_monotone_and_ofas_rule():
    for divisor in (1, 2, 8):
        values = [model_make_divisible(v / 10, divisor) for v in range(1, 3000)]
        assert values == sorted(values)
        assert values == [make_divisible(v / 10, divisor) for v in range(1, 3000)]


def test_bad_specs_are_refused(small):
    with pytest.raises(ValueError, match="d\\[0\\]"):
        small.set_active(OFASpec((3, 0, 0, 0), (0.1,) * 4, (0,) * 5))
    with pytest.raises(ValueError, match="e\\[1\\]"):
        small.set_active(OFASpec((0,) * 4, (0.1, 0.3, 0.1, 0.1), (0,) * 5))
    reduced = small.reduced(OFASpec((1,) * 4, (0.25,) * 4, (4,) * 5))
    with pytest.raises(ValueError, match="w\\[2\\]"):
        reduced.set_active(OFASpec((0,) * 4, (0.1,) * 4, (0, 0, 5, 0, 0)))
    with pytest.raises(ValueError, match="len"):
        OFASpec((0,) * 4, (0.1,) * 3, (0,) * 5)
    with pytest.raises(ConfigError, match="max_extra_blocks"):
        build_model(OFAResNet, 10, SHAPE, max_extra_blocks=(1, 2))


# -- extraction ------------------------------------------------------------------------------

def test_extracted_forward_equals_elastic_forward(small, x):
    for spec in [small.min_spec(), small.max_spec(), *specs(small, 8, seed=2)]:
        small.set_active(spec)
        expected = small(x)
        routed = small.extract(spec)
        assert all(type(m) in (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.Linear)
                   for m in routed.module.modules() if next(m.parameters(recurse=False), None) is not None)
        torch.testing.assert_close(routed.module.eval()(x), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(routed.module.forward_head(routed.module.forward_features(x)), expected,
                                   atol=1e-5, rtol=0)
        for name in small.block_names:
            torch.testing.assert_close(small.forward_from(small.forward_until(x, name), name), expected)


def test_extract_then_write_back_is_identity(small):
    spec = specs(small, 1, seed=3)[0]
    routed = small.extract(spec)
    before = {k: v.clone() for k, v in small.state_dict().items()}
    after = {k: v.clone() for k, v in before.items()}
    write_back(after, routed.module.state_dict(), routed.regions)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    # Changed local values land exactly on the routed positions.
    local = {k: v + 1 if v.is_floating_point() else v for k, v in routed.module.state_dict().items()}
    write_back(after, local, routed.regions)
    covered = coverage(small, [routed.regions])
    for key in before:
        if before[key].is_floating_point():
            torch.testing.assert_close(after[key] - before[key], covered[key], atol=1e-6, rtol=0)


def test_nested_specs_have_nested_regions(small):
    g = torch.Generator().manual_seed(4)
    for a in specs(small, 10, seed=5):
        b = raise_spec(small, a, g)
        assert spec_le(a, b)
        ra, rb = small.regions(a), small.regions(b)
        assert set(ra) <= set(rb)
        for key, (global_key, region) in ra.items():
            outer = rb[key][1]
            assert rb[key][0] == global_key
            assert isinstance(region, LeadingSlice) and outer.contains(region), key


# -- envelope routing --------------------------------------------------------------------------

def test_envelope_is_coordinatewise_max_with_all_expansions():
    a = OFASpec((0, 3, 1, 0), (0.1, 0.1, 0.14, 0.1), (2, 5, 1, 0, 3))
    b = OFASpec((2, 1, 1, 0), (0.1, 0.18, 0.1, 0.1), (1, 6, 1, 2, 0))
    env = envelope([a, b])
    assert env == OFASpec((2, 3, 1, 0), (0.25,) * 4, (2, 6, 1, 2, 3))
    assert spec_le(a, env) and spec_le(b, env)


def test_routed_envelope_runs_every_spec_like_the_global_supernet(small, x):
    for seed in range(4):
        group = specs(small, 1 + seed, seed=10 + seed)
        routed = route_envelope(small, group)
        reduced = routed.module.eval()
        assert reduced.max_spec() == envelope(group)
        for l, stage in enumerate(reduced.stages):
            # Supp. C: middle channels sized for the largest expansion at the routed width.
            out = small.stage_width(l, reduced.max_width_index[l + 1])
            assert stage[0].conv1.weight.shape[0] == small.mid_width(out, 0.25)
        for spec in group:
            small.set_active(spec)
            reduced.set_active(spec)
            torch.testing.assert_close(reduced(x), small(x), atol=1e-5, rtol=0)


def test_routed_module_holds_exactly_the_routed_parameters(small):
    for seed in range(3):
        group = specs(small, 3, seed=20 + seed)
        routed = route_envelope(small, group)
        numel = sum(p.numel() for p in routed.module.parameters())
        assert numel == routed_param_count(small, group)
        state = routed.module.state_dict()  # parameters and BN buffers travel
        assert routed.payload_bytes() == sum(t.numel() * t.element_size() for t in state.values())
        assert numel < full_param_count(small)
        assert set(routed.regions) == set(routed.module.state_dict())
        # Copies, not views of the global tensors: local training must not touch the server.
        shared = {t.untyped_storage().data_ptr() for t in small.state_dict().values()}
        assert not shared & {t.untyped_storage().data_ptr() for t in routed.module.state_dict().values()}
    whole = route_envelope(small, [small.max_spec()])
    assert routed_param_count(small, [small.max_spec()]) == full_param_count(small)
    assert all(region.covers_all() for _, region in whole.regions.values())


def test_routed_positions_cover_exactly_the_union(small):
    groups = [specs(small, 3, seed=30 + i) for i in range(3)]
    routed = [route_envelope(small, group) for group in groups]
    counts = coverage(small, [r.regions for r in routed])
    # Each client covers its envelope's leading slices once; together, exactly their union.
    expected = coverage(small, [small.regions(envelope(group)) for group in groups])
    for key in counts:
        assert torch.equal(counts[key], expected[key]), key
    for group, r in zip(groups, routed):
        own = coverage(small, [r.regions])
        members = coverage(small, [small.regions(spec) for spec in group])
        for key in own:
            assert own[key].max() <= 1
            assert torch.all(own[key][members[key] > 0] == 1), key  # every member's positions


def test_budget_nested_sets_route_nested_supports(small):
    # Prop. 1: A_i within A_j implies U_i within U_j.
    pool = specs(small, 6, seed=40)
    smaller = coverage(small, [route_envelope(small, pool[:3]).regions])
    larger = coverage(small, [route_envelope(small, pool).regions])
    for key in smaller:
        assert torch.all(larger[key][smaller[key] > 0] > 0), key


def test_communication_accounting(small):
    """Eq. 16 recomputed with plain arithmetic: ``P`` and ``P_i`` from the layer shapes of the
    supernet and of each envelope (coordinate-wise maximum depth and width, the largest
    expansion; Supp. Eq. 12) and from the sizes of the tensors actually routed."""
    sets = [specs(small, 2, seed=50 + i) for i in range(4)]
    report = communication(small, sets)
    full = hand_param_count(small, small.max_spec())
    routed = []
    for group in sets:
        bounds = OFASpec([max(s.d[l] for s in group) for l in range(4)], (0.25,) * 4,
                         [max(s.w[j] for s in group) for j in range(5)])
        p_i = hand_param_count(small, bounds)
        assert p_i == sum(p.numel() for p in route_envelope(small, group).module.parameters())
        routed.append(p_i)
    assert report["full_payload"] == 2 * 4 * full
    assert report["routed_payload"] == 2 * sum(routed)
    assert report["reduction"] == pytest.approx(4 * full / sum(routed), rel=1e-12)
    assert report["client_reductions"] == pytest.approx([full / p for p in routed], rel=1e-12)
