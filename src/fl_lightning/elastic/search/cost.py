"""Analytic MACs and parameters of supernet subnets, in microseconds instead of a traced
forward pass. Two constructions, two conventions:

- :class:`OFACostModel`: this project's bottleneck :class:`~fl_lightning.elastic.models.ofa_resnet.OFAResNet`
  in fvcore's convention (equal to ``fl_lightning.elastic.macs.spec_macs`` and to
  ``count_params`` of the extracted subnet; below);
- :class:`DeepFedNASCostModel`: the DeepFedNAS construction (two-3x3-conv blocks) in
  DeepFedNAS's own convention, convolutions and the classifier only, which is the convention of
  FEAST's budgets, cache MACs and footprints (see the class and docs/variant_cache.md).

fvcore's convention (batch size 1, eval mode), applied layer by layer:

- convolution: ``out_h * out_w * c_in * c_out * k * k`` (no bias term);
- eval-mode affine batch norm: 2 per element;
- adaptive average pool: 1 per *input* element; ``AvgPool2d`` of the projection shortcut,
  ReLU and the residual addition: 0 (fvcore has no handle for them);
- linear: ``in * out`` (the bias is not counted).

Architectures are handled as integer genomes (see :class:`OFACostModel`), so a batch of specs is
one ``(n, genes)`` array and its cost is a handful of table look-ups: every stage contributes
``first_block[w_in, w_out, e] + d * other_block[w_out, e]``, where the tables are filled once,
with exact Python integers, from the model's own channel rules.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Iterable, Optional, Sequence, Union

import numpy as np

from fl_lightning.elastic.models.ofa_resnet import OFAResNet, OFASpec


def conv_out(size: int, stride: int, kernel: int = 3) -> int:
    """Output length of a convolution with padding ``kernel // 2`` (the model's convs)."""
    pad = kernel // 2
    return (size + 2 * pad - kernel) // stride + 1


def pool_out(size: int, stride: int) -> int:
    """Output length of ``AvgPool2d(stride, stride, ceil_mode=True)``; equals the strided 3x3
    conv's, so the shortcut and the main path always agree."""
    return -(-size // stride)


@dataclass(frozen=True)
class Layer:
    """One convolution of a subnet: input and output channels, kernel size."""

    c_in: int
    c_out: int
    kernel: int


class OFACostModel:
    """Exact fvcore MACs and parameter counts for the specs of one OFAResNet construction.

    Genome layout (one row per architecture, ``S`` stages):
    ``[d_0..d_{S-1}, e_0..e_{S-1}, w_0..w_S]`` where ``e_l`` is an *index* into the model's
    (sorted) expansion choices and ``w_j`` the width-multiplier index of the stem (``j = 0``)
    and of stage ``j - 1``. :attr:`upper` holds each gene's largest value.

    Args:
        model: the supernet whose construction options (channels, divisor, strides, classes,
            maxima) define the space; only its channel arithmetic is used, so a model built on
            the ``meta`` device works.
        input_shape: (channels, height, width) to count for; defaults to the model's own. The
            strides stay the model's (they were fixed when it was built).
    """

    expansion_per = "stage"
    """Expansion genes: one per stage (FEAST's space)."""
    layer_accountings = ("deepfednas", "bottleneck")
    """Fitness layer accountings that apply to this construction (see :mod:`.fitness`)."""
    convention = "fvcore"

    def __init__(self, model: OFAResNet, input_shape: Optional[Sequence[int]] = None):
        arch = model.arch
        if arch["block"] != "bottleneck":  # its tables are the bottleneck block's layers
            raise ValueError(f"OFACostModel counts the bottleneck construction, not block={arch['block']!r}; "
                             f"use cost_model(model)")
        self.arch = dict(arch)
        self.model_options = dict(arch)
        self.input_shape = tuple(int(v) for v in (input_shape or arch["input_shape"]))
        self.num_stages = S = model.num_stages
        self.num_classes = model.num_classes
        self.expansions = tuple(model.expansions)
        self.max_extra_blocks = tuple(model.max_extra_blocks)
        self.max_width_index = tuple(model.max_width_index)
        self.upper = np.array(list(self.max_extra_blocks) + [len(self.expansions) - 1] * S
                              + list(self.max_width_index), dtype=np.int64)
        self.num_genes = len(self.upper)
        n_w, n_e = len(model.width_multipliers), len(self.expansions)

        # Channel tables, from the model's own rounding rules.
        self.stem_channels = np.array([model.stem_width(i) for i in range(n_w)], dtype=np.int64)
        self.out_channels = np.array([[model.stage_width(l, i) for i in range(n_w)] for l in range(S)],
                                     dtype=np.int64)
        self.mid_channels = np.array([[[model.mid_width(int(self.out_channels[l, i]), e) for e in self.expansions]
                                       for i in range(n_w)] for l in range(S)], dtype=np.int64)

        # Spatial sizes: stem output, then each stage's output (its first block carries the stride).
        c_img, h, w = self.input_shape
        self.in_channels = c_img
        h, w = conv_out(h, arch["stem_stride"]), conv_out(w, arch["stem_stride"])
        self.stem_hw = (h, w)
        self.stage_in_hw, self.stage_out_hw = [], []
        for stride in arch["stage_strides"]:
            self.stage_in_hw.append((h, w))
            h, w = conv_out(h, stride), conv_out(w, stride)
            assert (h, w) == (pool_out(self.stage_in_hw[-1][0], stride), pool_out(self.stage_in_hw[-1][1], stride))
            self.stage_out_hw.append((h, w))

        # At small widths several expansions round to the same middle width; the smallest
        # such expansion names the network canonically.
        self._canonical_e = [np.array([[int(np.argmax(self.mid_channels[l, w] == self.mid_channels[l, w, e]))
                                        for e in range(n_e)] for w in range(n_w)], dtype=np.int64)
                             for l in range(S)]
        self._fill_tables(n_w, n_e)

    # -- tables -----------------------------------------------------------------------------
    def _fill_tables(self, n_w: int, n_e: int) -> None:
        S, k2 = self.num_stages, 9
        sh, sw = self.stem_hw
        stem = self.stem_channels
        self._stem_macs = sh * sw * (self.in_channels * stem * k2 + 2 * stem)
        self._stem_params = self.in_channels * stem * k2 + 2 * stem
        self._first_macs, self._first_params, self._other_macs, self._other_params = [], [], [], []
        for l in range(S):
            prev = stem if l == 0 else self.out_channels[l - 1]
            (hi, wi), (ho, wo) = self.stage_in_hw[l], self.stage_out_hw[l]
            fm = np.zeros((n_w, n_w, n_e), dtype=np.int64)
            fp = np.zeros_like(fm)
            om = np.zeros((n_w, n_e), dtype=np.int64)
            op = np.zeros_like(om)
            for wo_i in range(n_w):
                out = int(self.out_channels[l, wo_i])
                for e_i in range(n_e):
                    mid = int(self.mid_channels[l, wo_i, e_i])
                    # conv2 (3x3) + bn2, conv3 (1x1) + bn3: at the stage's output resolution.
                    tail_m = ho * wo * (mid * mid * k2 + 2 * mid + mid * out + 2 * out)
                    tail_p = mid * mid * k2 + 2 * mid + mid * out + 2 * out
                    om[wo_i, e_i] = ho * wo * (out * mid + 2 * mid) + tail_m
                    op[wo_i, e_i] = out * mid + 2 * mid + tail_p
                    for wi_i in range(n_w):
                        c_in = int(prev[wi_i])
                        # conv1 + bn1 run before the stride; the projection (pool, 1x1, bn) after it.
                        fm[wi_i, wo_i, e_i] = (hi * wi * (c_in * mid + 2 * mid) + tail_m
                                               + ho * wo * (c_in * out + 2 * out))
                        fp[wi_i, wo_i, e_i] = c_in * mid + 2 * mid + tail_p + c_in * out + 2 * out
            self._first_macs.append(fm)
            self._first_params.append(fp)
            self._other_macs.append(om)
            self._other_params.append(op)
        last = self.out_channels[S - 1]
        fh, fw = self.stage_out_hw[-1]
        self._head_macs = fh * fw * last + last * self.num_classes  # adaptive pool + linear
        self._head_params = last * self.num_classes + self.num_classes

    # -- genomes ----------------------------------------------------------------------------
    def encode(self, spec: OFASpec) -> np.ndarray:
        """The genome of ``spec`` (ValueError if it is not an architecture of this space)."""
        S = self.num_stages
        if not isinstance(spec, OFASpec) or len(spec.d) != S:
            raise ValueError(f"expected an OFASpec with {S} stages, got {spec!r}")
        e_idx = []
        for l, e in enumerate(spec.e):
            match = [i for i, c in enumerate(self.expansions) if abs(c - e) <= 1e-9]
            if not match:
                raise ValueError(f"e[{l}]={e} is not one of {self.expansions}")
            e_idx.append(match[0])
        genes = np.array(list(spec.d) + e_idx + list(spec.w), dtype=np.int64)
        if np.any(genes < 0) or np.any(genes > self.upper):
            raise ValueError(f"{spec} is outside this space (d <= {self.max_extra_blocks}, "
                             f"w <= {self.max_width_index})")
        return genes

    def encode_many(self, specs: Iterable[OFASpec]) -> np.ndarray:
        rows = [self.encode(s) for s in specs]
        return np.stack(rows) if rows else np.zeros((0, self.num_genes), dtype=np.int64)

    def decode(self, genes: Sequence[int]) -> OFASpec:
        S = self.num_stages
        g = [int(v) for v in genes]
        return OFASpec(tuple(g[:S]), tuple(self.expansions[i] for i in g[S:2 * S]), tuple(g[2 * S:]))

    def canonical(self, genes: np.ndarray) -> np.ndarray:
        """``genes`` with each expansion replaced by the smallest one giving the same middle
        width: the same network (same MACs, parameters and fitness) under one name."""
        genes = np.array(np.atleast_2d(genes), dtype=np.int64)
        S = self.num_stages
        for l in range(S):
            genes[:, S + l] = self._canonical_e[l][genes[:, 2 * S + l + 1], genes[:, S + l]]
        return genes

    def split(self, genes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(d, e, w)`` column blocks of a genome batch ``(n, genes)``."""
        S = self.num_stages
        return genes[:, :S], genes[:, S:2 * S], genes[:, 2 * S:]

    def block_expansions(self, genes: np.ndarray) -> list[np.ndarray]:
        """Per stage, the expansion index of each of its ``1 + max_extra_blocks`` block slots
        ``(n, slots)``; here every block of a stage carries the stage's gene."""
        genes = np.atleast_2d(np.asarray(genes, dtype=np.int64))
        e = self.split(genes)[1]
        return [np.repeat(e[:, l:l + 1], 1 + m, axis=1) for l, m in enumerate(self.max_extra_blocks)]

    def envelope(self, genes: np.ndarray) -> np.ndarray:
        """The routed envelope of a set of genomes (FEAST Supp. Eq. 12, ``envelope.envelope``):
        coordinate-wise maximum depth and width, the largest expansion in every stage."""
        genes = np.atleast_2d(np.asarray(genes, dtype=np.int64))
        if len(genes) == 0:
            raise ValueError("envelope of an empty set")
        d, _, w = self.split(genes)
        e = np.full(self.num_stages, len(self.expansions) - 1, dtype=np.int64)
        return np.concatenate([d.max(axis=0), e, w.max(axis=0)])

    # -- costs ------------------------------------------------------------------------------
    def _total(self, genes: np.ndarray, stem, first, other, head) -> np.ndarray:
        genes = np.atleast_2d(np.asarray(genes, dtype=np.int64))
        d, e, w = self.split(genes)
        total = stem[w[:, 0]] + head[w[:, -1]]
        for l in range(self.num_stages):
            total = total + first[l][w[:, l], w[:, l + 1], e[:, l]] + d[:, l] * other[l][w[:, l + 1], e[:, l]]
        return total

    def macs(self, genes: np.ndarray) -> np.ndarray:
        """fvcore MACs of each genome row (int64 array)."""
        return self._total(genes, self._stem_macs, self._first_macs, self._other_macs, self._head_macs)

    def params(self, genes: np.ndarray) -> np.ndarray:
        """Parameters of each genome row's extracted subnet (int64 array)."""
        return self._total(genes, self._stem_params, self._first_params, self._other_params, self._head_params)

    def spec_macs(self, spec: OFASpec) -> int:
        return int(self.macs(self.encode(spec))[0])

    def spec_params(self, spec: OFASpec) -> int:
        return int(self.params(self.encode(spec))[0])

    # -- structure, for the fitness ---------------------------------------------------------
    def stage_layers(self, spec: OFASpec) -> list[list[Layer]]:
        """The convolutions of each stage of ``spec`` in forward order (stem excluded; the
        projection shortcut right after its block's main path), for reading the fitness off a
        spec by hand."""
        g = self.encode(spec)
        d, e, w = g[:self.num_stages], g[self.num_stages:2 * self.num_stages], g[2 * self.num_stages:]
        stages, c_in = [], int(self.stem_channels[w[0]])
        for l in range(self.num_stages):
            out = int(self.out_channels[l, w[l + 1]])
            mid = int(self.mid_channels[l, w[l + 1], e[l]])
            layers = []
            for b in range(1 + int(d[l])):
                layers += [Layer(c_in, mid, 1), Layer(mid, mid, 3), Layer(mid, out, 1)]
                if b == 0:
                    layers.append(Layer(c_in, out, 1))
                c_in = out
            stages.append(layers)
        return stages


# ------------------------------------------------------------------------------------------
# The DeepFedNAS construction, counted in DeepFedNAS's convention (FEAST's MACs)
# ------------------------------------------------------------------------------------------

DFN_EXPANSIONS = (0.10, 0.14, 0.18, 0.22, 0.25)
DFN_WIDTH_MULTIPLIERS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
EXPANSION_LAYOUTS = ("stage", "block")
MID_ROUNDINGS = ("counter", "module")


def counter_make_divisible(value: float, divisor: int = 8) -> int:
    """DeepFedNAS's channel rounding (Once-for-All's ``make_divisible``): the nearest multiple
    of ``divisor``, at least ``divisor``, one ``divisor`` more where rounding lost over 10%."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return int(rounded + divisor if rounded < 0.9 * value else rounded)


def _stage_strides_for(input_shape: Sequence[int], num_stages: int) -> tuple[int, ...]:
    """Stride of each stage's first block: stride 1 in the first stage below 64 px (CIFAR),
    stride 2 from 64 px (TinyImageNet), so every later stage sees CIFAR's resolution."""
    return (2 if min(input_shape[1:]) >= 64 else 1,) + (2,) * (num_stages - 1)


@dataclass(frozen=True)
class DeepFedNASArch:
    """The DeepFedNAS supernet construction: a ``3x3`` stem, then per stage ``1 + d_l`` blocks
    of two ``3x3`` convolutions (``c_in -> mid -> out``, batch norm after each, the first
    carrying the stage stride) with a projection shortcut (``1x1`` conv + batch norm, after an
    average pool) on the stage's first block, then global average pooling and a linear head.

    Widths: stem ``md(stem_channels * m[w_0])``, stage ``md(stage_channels[l] * m[w_{l+1}])``,
    middle ``md(out * e)`` with ``md`` = :func:`counter_make_divisible` (``mid_rounding``).

    The defaults are FEAST's supernet (Supp. B, Eq. 9): 64-channel stem, base channels
    [128, 256, 512, 1024], up to 8 extra blocks per stage, one expansion per stage; with 100
    classes DeepFedNAS's counter gives it 55,682,916 parameters (FEAST's 55.68M).
    :data:`DEEPFEDNAS_4_STAGE` is DeepFedNAS's own 4-stage supernet (per-block expansions).

    Args:
        expansion_per: ``"stage"`` (one expansion gene per stage, FEAST) or ``"block"`` (one
            per block slot, ``1 + max_extra_blocks[l]`` slots per stage, DeepFedNAS).
        mid_rounding: ``"counter"``: ``md(out * e)``, as DeepFedNAS's cost counter and fitness
            code compute it (and as the published numbers are); ``"module"``: ``md(round(out * e))``,
            as DeepFedNAS's ``nn.Module`` sizes its blocks. The two differ for 10 (stage, width,
            expansion) triples of FEAST's space (e.g. 80 channels at 0.22: 16 vs 24).
        stage_strides: default: :func:`_stage_strides_for` the input.
        max_width_index: largest ``w`` index of the stem and each stage (default: the last),
            for a reduced space.
    """

    num_classes: int = 100
    input_shape: tuple[int, ...] = (3, 32, 32)
    stem_channels: int = 64
    stage_channels: tuple[int, ...] = (128, 256, 512, 1024)
    max_extra_blocks: Union[int, tuple[int, ...]] = 8
    expansions: tuple[float, ...] = DFN_EXPANSIONS
    width_multipliers: tuple[float, ...] = DFN_WIDTH_MULTIPLIERS
    divisor: int = 8
    stage_strides: Optional[tuple[int, ...]] = None
    stem_stride: int = 1
    expansion_per: str = "stage"
    mid_rounding: str = "counter"
    max_width_index: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        S = len(self.stage_channels)
        set_("num_classes", int(self.num_classes))
        set_("input_shape", tuple(int(v) for v in self.input_shape))
        set_("stem_channels", int(self.stem_channels))
        set_("stage_channels", tuple(int(v) for v in self.stage_channels))
        blocks = self.max_extra_blocks
        set_("max_extra_blocks", (int(blocks),) * S if isinstance(blocks, (int, np.integer))
             else tuple(int(v) for v in blocks))
        set_("expansions", tuple(sorted(float(v) for v in self.expansions)))
        set_("width_multipliers", tuple(sorted(float(v) for v in self.width_multipliers)))
        strides = self.stage_strides if self.stage_strides is not None else _stage_strides_for(self.input_shape, S)
        set_("stage_strides", tuple(int(v) for v in strides))
        widths = self.max_width_index
        set_("max_width_index", (len(self.width_multipliers) - 1,) * (S + 1) if widths is None
             else tuple(int(v) for v in widths))
        if len(self.input_shape) != 3 or min(self.input_shape) < 1:
            raise ValueError(f"input_shape must be (channels, height, width), got {self.input_shape}")
        if len(self.max_extra_blocks) != S or min(self.max_extra_blocks) < 0:
            raise ValueError(f"max_extra_blocks needs {S} values >= 0, got {self.max_extra_blocks}")
        if len(self.stage_strides) != S or min(self.stage_strides) < 1:
            raise ValueError(f"stage_strides needs {S} values >= 1, got {self.stage_strides}")
        if len(self.max_width_index) != S + 1 or any(not 0 <= w < len(self.width_multipliers)
                                                     for w in self.max_width_index):
            raise ValueError(f"max_width_index needs {S + 1} indices into the width multipliers, "
                             f"got {self.max_width_index}")
        if self.expansion_per not in EXPANSION_LAYOUTS:
            raise ValueError(f"expansion_per must be one of {EXPANSION_LAYOUTS}, got {self.expansion_per!r}")
        if self.mid_rounding not in MID_ROUNDINGS:
            raise ValueError(f"mid_rounding must be one of {MID_ROUNDINGS}, got {self.mid_rounding!r}")
        if not self.expansions or not self.width_multipliers or self.divisor < 1 or self.stem_stride < 1:
            raise ValueError("need expansion and width choices, divisor >= 1 and stem_stride >= 1")

    @property
    def num_stages(self) -> int:
        return len(self.stage_channels)

    def to_dict(self) -> dict:
        """Plain JSON-ready options (the ``model`` entry of a cache file)."""
        return {"construction": "deepfednas", **{k: list(v) if isinstance(v, tuple) else v
                                                 for k, v in asdict(self).items()}}

    @classmethod
    def from_dict(cls, options: dict) -> "DeepFedNASArch":
        options = {k: v for k, v in options.items() if k != "construction"}
        return cls(**options)

    def at_input(self, input_shape: Sequence[int], num_classes: Optional[int] = None) -> "DeepFedNASArch":
        """The same supernet for another dataset: its input (strides re-derived) and classes."""
        return replace(self, input_shape=tuple(input_shape), stage_strides=None,
                       num_classes=self.num_classes if num_classes is None else num_classes)


FEAST_DEEPFEDNAS = DeepFedNASArch()
"""FEAST's CIFAR-100 supernet (Supp. B, Eq. 9) as DeepFedNAS builds and counts it."""

DEEPFEDNAS_4_STAGE = DeepFedNASArch(num_classes=10, stage_channels=(256, 512, 1024, 2048), max_extra_blocks=2,
                                    expansion_per="block")
"""DeepFedNAS's ``configs/supernets/4-stage-supernet-deepfednas.json`` (CIFAR-10), the space of
its published ``subnet_caches/4_stage_cache_60_subnets.csv``."""


class DeepFedNASCostModel:
    """MACs and parameters of the DeepFedNAS construction in DeepFedNAS's convention (the
    numbers of its ``utils/subnet_cost.py``, which FEAST's budgets and cache use):

    - MACs: every convolution ``H_out W_out c_in c_out k^2`` and the classifier ``C x classes``;
      nothing for batch norm, pooling, activations or additions. Resolutions are floor-divided
      by the strides (``32 -> 32, 16, 8, 4``); the stem is counted at its output resolution
      (DeepFedNAS's counter takes the input's, which differs only with a strided stem);
    - parameters: conv weights (no bias), 2 per batch-norm channel, classifier weights + bias:
      exactly the ``nn.Module`` parameter count of the construction;
    - a projection shortcut is counted on every stage's first block, even where the channels
      and resolution would allow an identity.

    Genome layout (rows of int64): ``[d_0..d_{S-1}, e..., w_0..w_S]`` with one expansion index
    per stage (``expansion_per="stage"``, FEAST; the layout of :class:`OFACostModel`, so the
    fitness and the genetic search take either) or one per block slot, stage by stage
    (``"block"``, DeepFedNAS). :meth:`fvcore_macs` adds what fvcore counts besides (batch norm,
    adaptive pooling), for checking a module against this model (:mod:`.convention`).
    """

    layer_accountings = ("deepfednas",)
    convention = "deepfednas"

    def __init__(self, arch: DeepFedNASArch = FEAST_DEEPFEDNAS, input_shape: Optional[Sequence[int]] = None):
        if input_shape is not None and tuple(input_shape) != arch.input_shape:
            arch = replace(arch, input_shape=tuple(int(v) for v in input_shape))  # strides kept
        self.spec_arch = arch
        self.arch = arch.to_dict()
        self.model_options = self.arch
        self.input_shape = arch.input_shape
        self.num_stages = S = arch.num_stages
        self.num_classes = arch.num_classes
        self.expansions = arch.expansions
        self.expansion_per = arch.expansion_per
        self.max_extra_blocks = arch.max_extra_blocks
        self.max_width_index = arch.max_width_index
        n_w, n_e = len(arch.width_multipliers), len(arch.expansions)
        slots = [1] * S if self.expansion_per == "stage" else [1 + m for m in self.max_extra_blocks]
        self._e_offsets = np.concatenate(([0], np.cumsum(slots))).astype(np.int64) + S
        self.num_expansion_genes = int(sum(slots))
        self.upper = np.array(list(self.max_extra_blocks) + [n_e - 1] * self.num_expansion_genes
                              + list(self.max_width_index), dtype=np.int64)
        self.num_genes = len(self.upper)

        md = lambda v: counter_make_divisible(v, arch.divisor)  # noqa: E731
        mults = arch.width_multipliers
        self.stem_channels = np.array([md(arch.stem_channels * m) for m in mults], dtype=np.int64)
        self.out_channels = np.array([[md(c * m) for m in mults] for c in arch.stage_channels], dtype=np.int64)
        mid = (lambda out, e: md(out * e)) if arch.mid_rounding == "counter" else (lambda out, e: md(round(out * e)))
        self.mid_channels = np.array([[[mid(int(out), e) for e in arch.expansions] for out in row]
                                      for row in self.out_channels], dtype=np.int64)

        c_img, h, w = self.input_shape
        self.in_channels = c_img
        h, w = h // arch.stem_stride, w // arch.stem_stride
        self.stem_hw = (h, w)
        self.stage_in_hw, self.stage_out_hw = [], []
        for stride in arch.stage_strides:
            self.stage_in_hw.append((h, w))
            h, w = h // stride, w // stride
            self.stage_out_hw.append((h, w))
        self._canonical_e = [np.array([[int(np.argmax(self.mid_channels[l, i] == self.mid_channels[l, i, e]))
                                        for e in range(n_e)] for i in range(n_w)], dtype=np.int64)
                             for l in range(S)]
        self._fill_tables(n_w, n_e)

    def _fill_tables(self, n_w: int, n_e: int) -> None:
        k2, S = 9, self.num_stages
        stem = self.stem_channels
        sh, sw = self.stem_hw
        stem_weights = self.in_channels * stem * k2
        self._stem = {"macs": sh * sw * stem_weights, "params": stem_weights + 2 * stem, "extra": sh * sw * 2 * stem}
        self._first = {k: [] for k in self._stem}
        self._other = {k: [] for k in self._stem}
        for l in range(S):
            prev = stem if l == 0 else self.out_channels[l - 1]
            ho, wo = self.stage_out_hw[l]
            hw = ho * wo
            out = self.out_channels[l][:, None]  # (w_out, 1)
            mid = self.mid_channels[l]  # (w_out, e)
            c_in = prev[:, None, None]  # (w_in, 1, 1)
            # Later blocks: conv1 out -> mid, conv2 mid -> out, each followed by batch norm.
            other_w = k2 * out * mid + k2 * mid * out
            self._other["macs"].append(hw * other_w)
            self._other["params"].append(other_w + 2 * mid + 2 * out)
            self._other["extra"].append(hw * (2 * mid + 2 * out))
            # First block: conv1 from the stage input (carrying the stride) and the projection.
            first_w = k2 * c_in * mid[None] + (k2 * mid * out)[None] + c_in * out[None]
            self._first["macs"].append(hw * first_w)
            self._first["params"].append(first_w + (2 * mid + 4 * out)[None])
            self._first["extra"].append(np.broadcast_to(hw * (2 * mid + 4 * out)[None], first_w.shape))
        last = self.out_channels[S - 1]
        fh, fw = self.stage_out_hw[-1]
        self._head = {"macs": last * self.num_classes, "params": last * self.num_classes + self.num_classes,
                      "extra": fh * fw * last}

    # -- genomes ----------------------------------------------------------------------------
    def encode_values(self, d: Sequence[int], e: Sequence[float], w: Sequence[int]) -> np.ndarray:
        """The genome of depths ``d``, expansion *values* ``e`` (one per stage, or, in the
        block layout, one per block slot; a per-stage ``e`` fills every slot of its stage) and
        width indices ``w``. ValueError if it is not an architecture of this space."""
        S = self.num_stages
        if len(d) != S or len(w) != S + 1 or len(e) not in (S, self.num_expansion_genes):
            raise ValueError(f"need {S} depths, {S + 1} widths and {S} or {self.num_expansion_genes} "
                             f"expansions, got d={list(d)}, e={list(e)}, w={list(w)}")
        idx = []
        for i, value in enumerate(e):
            match = [k for k, c in enumerate(self.expansions) if abs(c - float(value)) <= 1e-9]
            if not match:
                raise ValueError(f"e[{i}]={value} is not one of {self.expansions}")
            idx.append(match[0])
        if len(idx) != self.num_expansion_genes:  # per-stage values in the block layout
            idx = [idx[l] for l in range(S) for _ in range(self._e_offsets[l + 1] - self._e_offsets[l])]
        genes = np.array([int(v) for v in d] + idx + [int(v) for v in w], dtype=np.int64)
        if np.any(genes < 0) or np.any(genes > self.upper):
            raise ValueError(f"d={list(d)}, w={list(w)} is outside this space (d <= {self.max_extra_blocks}, "
                             f"w <= {self.max_width_index})")
        return genes

    def encode(self, spec: OFASpec) -> np.ndarray:
        if not isinstance(spec, OFASpec):
            raise ValueError(f"expected an OFASpec, got {spec!r}")
        return self.encode_values(spec.d, spec.e, spec.w)

    def encode_many(self, specs: Iterable[OFASpec]) -> np.ndarray:
        rows = [self.encode(s) for s in specs]
        return np.stack(rows) if rows else np.zeros((0, self.num_genes), dtype=np.int64)

    def decode(self, genes: Sequence[int]) -> OFASpec:
        """The :class:`OFASpec` of a stage-layout genome (a block-layout one: see :meth:`values`)."""
        if self.expansion_per != "stage":
            raise ValueError("a block-layout genome has no OFASpec (one expansion per stage); use values()")
        d, e, w = self.values(genes)
        return OFASpec(d, e, w)

    def values(self, genes: Sequence[int]) -> tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]]:
        """``(d, e, w)`` of one genome with expansion values (one per gene)."""
        g = [int(v) for v in genes]
        S, E = self.num_stages, self.num_expansion_genes
        return tuple(g[:S]), tuple(self.expansions[i] for i in g[S:S + E]), tuple(g[S + E:])

    def split(self, genes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(d, e, w)`` column blocks of a genome batch ``(n, genes)``."""
        S, E = self.num_stages, self.num_expansion_genes
        return genes[:, :S], genes[:, S:S + E], genes[:, S + E:]

    def block_expansions(self, genes: np.ndarray) -> list[np.ndarray]:
        """Per stage, the expansion index of each block slot, ``(n, 1 + max_extra_blocks[l])``."""
        genes = np.atleast_2d(np.asarray(genes, dtype=np.int64))
        out = []
        for l, m in enumerate(self.max_extra_blocks):
            lo, hi = self._e_offsets[l], self._e_offsets[l + 1]
            out.append(np.repeat(genes[:, lo:hi], 1 + m, axis=1) if hi - lo == 1 else genes[:, lo:hi])
        return out

    def canonical(self, genes: np.ndarray) -> np.ndarray:
        """Each expansion replaced by the smallest giving the same middle width, and (block
        layout) the slots of inactive blocks set to the first choice: one name per network."""
        genes = np.array(np.atleast_2d(genes), dtype=np.int64)
        S, E = self.num_stages, self.num_expansion_genes
        d, w = genes[:, :S], genes[:, S + E:]
        for l in range(S):
            lo, hi = self._e_offsets[l], self._e_offsets[l + 1]
            genes[:, lo:hi] = self._canonical_e[l][w[:, l + 1:l + 2], genes[:, lo:hi]]
            if hi - lo > 1:
                genes[:, lo:hi] *= np.arange(hi - lo)[None, :] <= d[:, l:l + 1]
        return genes

    def envelope(self, genes: np.ndarray) -> np.ndarray:
        """The routed envelope of a set of genomes (FEAST Supp. Eq. 12): coordinate-wise
        maximum depth and width, the largest expansion everywhere (Supp. C)."""
        genes = np.atleast_2d(np.asarray(genes, dtype=np.int64))
        if len(genes) == 0:
            raise ValueError("envelope of an empty set")
        d, _, w = self.split(genes)
        e = np.full(self.num_expansion_genes, len(self.expansions) - 1, dtype=np.int64)
        return np.concatenate([d.max(axis=0), e, w.max(axis=0)])

    # -- costs ------------------------------------------------------------------------------
    def _total(self, genes: np.ndarray, key: str) -> np.ndarray:
        genes = np.atleast_2d(np.asarray(genes, dtype=np.int64))
        d, _, w = self.split(genes)
        total = self._stem[key][w[:, 0]] + self._head[key][w[:, -1]]
        first, other = self._first[key], self._other[key]
        if self.expansion_per == "stage":
            e = genes[:, self._e_offsets[:-1]]
            for l in range(self.num_stages):
                total = total + first[l][w[:, l], w[:, l + 1], e[:, l]] + d[:, l] * other[l][w[:, l + 1], e[:, l]]
            return total
        for l, slots in enumerate(self.block_expansions(genes)):
            total = total + first[l][w[:, l], w[:, l + 1], slots[:, 0]]
            for b in range(1, slots.shape[1]):
                total = total + (d[:, l] >= b) * other[l][w[:, l + 1], slots[:, b]]
        return total

    def macs(self, genes: np.ndarray) -> np.ndarray:
        """MACs in DeepFedNAS's convention (convolutions + classifier) of each genome row."""
        return self._total(genes, "macs")

    def params(self, genes: np.ndarray) -> np.ndarray:
        """Parameters of each genome row's subnet (the construction's parameter count)."""
        return self._total(genes, "params")

    def fvcore_macs(self, genes: np.ndarray) -> np.ndarray:
        """What fvcore counts on the construction: :meth:`macs` plus 2 per batch-norm output
        element and 1 per input element of the global average pool."""
        return self._total(genes, "macs") + self._total(genes, "extra")

    def spec_macs(self, spec: OFASpec) -> int:
        return int(self.macs(self.encode(spec))[0])

    def spec_params(self, spec: OFASpec) -> int:
        return int(self.params(self.encode(spec))[0])

    def full_params(self) -> int:
        """Parameters of the whole supernet (its largest subnet): FEAST's ``P``."""
        return int(self.params(self.upper)[0])

    def arch_key(self) -> tuple:
        return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in self.arch.items()))

    # -- structure --------------------------------------------------------------------------
    def stage_layers(self, genes: Union[OFASpec, Sequence[int]]) -> list[list[Layer]]:
        """The convolutions of each stage in forward order (stem excluded; the projection right
        after its block's two convs)."""
        g = self.encode(genes) if isinstance(genes, OFASpec) else np.asarray(genes, dtype=np.int64)
        d, _, w = (x[0] for x in self.split(g[None]))
        slots = [s[0] for s in self.block_expansions(g[None])]
        stages, c_in = [], int(self.stem_channels[w[0]])
        for l in range(self.num_stages):
            out = int(self.out_channels[l, w[l + 1]])
            layers = []
            for b in range(1 + int(d[l])):
                mid = int(self.mid_channels[l, w[l + 1], slots[l][b]])
                layers += [Layer(c_in, mid, 3), Layer(mid, out, 3)]
                if b == 0:
                    layers.append(Layer(c_in, out, 1))
                c_in = out
            stages.append(layers)
        return stages


CostModel = Union[OFACostModel, DeepFedNASCostModel]


def cost_model(model: Union[OFAResNet, DeepFedNASArch, CostModel],
               input_shape: Optional[Sequence[int]] = None) -> CostModel:
    """The cost model of a supernet, shared per (architecture, input shape): building the
    tables takes milliseconds, looking them up microseconds.

    ``model`` is an :class:`OFAResNet` (fvcore's convention), a :class:`DeepFedNASArch`
    (DeepFedNAS's convention) or a cost model, returned as it is when ``input_shape`` is None
    or its own.
    """
    shape = tuple(int(v) for v in input_shape) if input_shape is not None else None
    if isinstance(model, (OFACostModel, DeepFedNASCostModel)):
        if shape is None or shape == model.input_shape:
            return model
        if isinstance(model, DeepFedNASCostModel):
            return cost_model(model.spec_arch, shape)
        raise ValueError("an OFACostModel counts at one input; build one from the model for another")
    if isinstance(model, OFAResNet) and model.arch["block"] == "basic_pair":
        model = deepfednas_arch_of(model)
    if isinstance(model, DeepFedNASArch):
        key = ("deepfednas", model, shape)
        make = lambda: DeepFedNASCostModel(model, shape)  # noqa: E731
    else:
        key = (model.arch_key(), shape)
        make = lambda: OFACostModel(model, shape)  # noqa: E731
    found = _COST_MODELS.get(key)
    if found is None:
        found = _COST_MODELS[key] = make()
    return found


_COST_MODELS: dict = {}


def deepfednas_arch_of(model: OFAResNet) -> DeepFedNASArch:
    """The DeepFedNAS description of an ``OFAResNet(block="basic_pair")``: the same channel
    rules, strides and choices, so its cache, budgets and MACs are in the paper's convention."""
    arch = model.arch
    scale = arch["width_scale"]
    stem, stages = arch["stem_channels"] * scale, [c * scale for c in arch["stage_channels"]]
    if not all(float(c).is_integer() for c in [stem, *stages]):
        raise ValueError(f"width_scale {scale} gives fractional base channels; the DeepFedNAS counter needs integers")
    return DeepFedNASArch(num_classes=arch["num_classes"], input_shape=arch["input_shape"], stem_channels=int(stem),
                          stage_channels=tuple(int(c) for c in stages), max_extra_blocks=arch["max_extra_blocks"],
                          expansions=arch["expansions"], width_multipliers=arch["width_multipliers"],
                          divisor=arch["divisor"], stage_strides=arch["stage_strides"],
                          stem_stride=arch["stem_stride"],
                          mid_rounding="module" if arch["round_middle"] else "counter",
                          max_width_index=arch["max_width_index"])


def analytic_macs(model: OFAResNet, spec: OFASpec, input_shape: Optional[Sequence[int]] = None) -> int:
    """fvcore MACs of ``spec`` without tracing (same value as ``macs.spec_macs``)."""
    return cost_model(model, input_shape).spec_macs(spec)


def analytic_params(model: OFAResNet, spec: OFASpec, input_shape: Optional[Sequence[int]] = None) -> int:
    """Parameters of the extracted subnet of ``spec`` (same value as ``macs.spec_params``)."""
    return cost_model(model, input_shape).spec_params(spec)
