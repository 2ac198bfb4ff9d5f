"""fvcore next to the paper's convention on modules built as the DeepFedNAS construction.

The modules here are plain, test-local networks built from a cost model's channel tables (the
elastic construction itself belongs to ``elastic/models``); they check that the analytic
counts describe a real network: fvcore's conv + linear MACs equal the paper's MACs, fvcore's
total equals ``fvcore_macs``, parameters equal ``params``, and the ratio stays within the bound.
"""

import numpy as np
import pytest
import torch
from torch import nn

from fl_lightning.elastic.search import FEAST_DEEPFEDNAS, DeepFedNASArch, DeepFedNASCostModel
from fl_lightning.elastic.search.convention import FVCORE_EXCESS_BOUND, convention_check
from hand_counts import hooked_macs


class Block(nn.Module):
    def __init__(self, c_in, mid, out, stride, projection):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c_in, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
                                  nn.Conv2d(mid, out, 3, 1, 1, bias=False), nn.BatchNorm2d(out))
        self.shortcut = (nn.Sequential(nn.AvgPool2d(stride, stride, ceil_mode=True),
                                       nn.Conv2d(c_in, out, 1, bias=False), nn.BatchNorm2d(out))
                         if projection else nn.Identity())

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


def build(cost: DeepFedNASCostModel, genes) -> nn.Module:
    """A plain network of ``genes`` in the DeepFedNAS construction."""
    d, _, w = (x[0] for x in cost.split(np.atleast_2d(genes)))
    slots = [s[0] for s in cost.block_expansions(genes)]
    stem = int(cost.stem_channels[w[0]])
    layers = [nn.Conv2d(cost.in_channels, stem, 3, cost.spec_arch.stem_stride, 1, bias=False),
              nn.BatchNorm2d(stem), nn.ReLU()]
    c_in = stem
    for l, stride in enumerate(cost.spec_arch.stage_strides):
        out = int(cost.out_channels[l, w[l + 1]])
        for b in range(1 + int(d[l])):
            mid = int(cost.mid_channels[l, w[l + 1], slots[l][b]])
            layers.append(Block(c_in, mid, out, stride if b == 0 else 1, projection=b == 0))
            c_in = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, cost.num_classes)]
    return nn.Sequential(*layers)


SMALL = DeepFedNASArch(num_classes=10, max_extra_blocks=2)  # FEAST's widths, shallower, quick


def random_genomes(cost, n, seed):
    rng = np.random.default_rng(seed)
    rows = [np.zeros(cost.num_genes, dtype=np.int64), cost.upper.copy()]
    rows += [np.floor(rng.random(cost.num_genes) * (cost.upper + 1)).astype(np.int64) for _ in range(n)]
    return rows


@pytest.mark.parametrize("arch", [SMALL, SMALL.at_input((3, 64, 64)), DeepFedNASArch(
    num_classes=7, max_extra_blocks=(1, 0, 2, 1), expansion_per="block", input_shape=(3, 24, 24))])
def test_fvcore_agrees_with_the_paper_convention(arch):
    cost = DeepFedNASCostModel(arch)
    for genes in random_genomes(cost, 4, seed=3):
        check = convention_check(build(cost, genes), genes, cost)
        assert check.problems() == [], (genes, str(check))
        assert check.fvcore_by_operator.get("batch_norm", 0) > 0  # what the paper leaves out


def test_feast_subnets_counted_both_ways():
    """Two specs of FEAST's full space (the smallest, and a cached-size one near 600M)."""
    cost = DeepFedNASCostModel(FEAST_DEEPFEDNAS)
    smallest = np.zeros(13, dtype=np.int64)
    large = cost.encode_values((8, 8, 8, 8), (0.1,) * 4, (9, 6, 6, 7, 7))
    for genes in (smallest, large):
        check = convention_check(build(cost, genes), genes, cost)
        assert check.problems() == [], str(check)
    # fvcore's excess on the smallest, by hooks on the module: 2 per BN element, the pool's input
    counted = hooked_macs(build(cost, smallest), (3, 32, 32))
    ratio = convention_check(build(cost, smallest), smallest, cost).ratio
    assert ratio == pytest.approx(counted["fvcore"] / counted["paper"], rel=1e-12)


def test_a_module_of_another_construction_is_reported():
    cost = DeepFedNASCostModel(SMALL)
    genes = random_genomes(cost, 1, seed=5)[-1]
    module = build(cost, genes)
    module[0] = nn.Conv2d(3, module[0].out_channels, 3, 1, 1, bias=True)  # a bias the construction lacks
    problems = convention_check(module, genes, cost).problems()
    assert any("parameters" in p for p in problems)


def test_excess_bound_covers_the_space():
    cost = DeepFedNASCostModel(FEAST_DEEPFEDNAS)
    rng = np.random.default_rng(0)
    genes = np.floor(rng.random((20000, 13)) * (cost.upper + 1)).astype(np.int64)
    ratio = cost.fvcore_macs(genes) / cost.macs(genes)
    assert ratio.min() > 1.0 and ratio.max() <= 1 + FVCORE_EXCESS_BOUND
