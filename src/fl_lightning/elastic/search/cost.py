"""Analytic MACs and parameters of :class:`~fl_lightning.elastic.models.ofa_resnet.OFAResNet`
subnets, equal to fvcore's count (``fl_lightning.elastic.macs.spec_macs``) and to
``count_params`` of the extracted subnet, in microseconds instead of a traced forward pass.

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

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

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

    def __init__(self, model: OFAResNet, input_shape: Optional[Sequence[int]] = None):
        arch = model.arch
        self.arch = dict(arch)
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


def cost_model(model: OFAResNet, input_shape: Optional[Sequence[int]] = None) -> OFACostModel:
    """An :class:`OFACostModel`, shared per (architecture, input shape): building the tables
    takes milliseconds, looking them up microseconds."""
    key = (model.arch_key(), tuple(input_shape) if input_shape is not None else None)
    found = _COST_MODELS.get(key)
    if found is None:
        found = _COST_MODELS[key] = OFACostModel(model, input_shape)
    return found


_COST_MODELS: dict = {}


def analytic_macs(model: OFAResNet, spec: OFASpec, input_shape: Optional[Sequence[int]] = None) -> int:
    """fvcore MACs of ``spec`` without tracing (same value as ``macs.spec_macs``)."""
    return cost_model(model, input_shape).spec_macs(spec)


def analytic_params(model: OFAResNet, spec: OFASpec, input_shape: Optional[Sequence[int]] = None) -> int:
    """Parameters of the extracted subnet of ``spec`` (same value as ``macs.spec_params``)."""
    return cost_model(model, input_shape).spec_params(spec)
