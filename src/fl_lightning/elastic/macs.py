"""MACs and parameter counts of models and of an elastic model's subnets.

MACs are counted by fvcore's ``FlopCountAnalysis``, which counts one fused multiply-add as one
"flop": a convolution counts ``out_elements * in_channels/groups * kh * kw``, a linear layer
``batch * in * out`` (biases are not counted). fvcore also adds 2 per element for an eval-mode
affine batch norm and 1 per input element for adaptive average pooling, and ignores ReLU,
max pooling and residual additions. Counts are for one input (batch size 1), in eval mode.

fvcore has no rule for fused recurrent layers or fused attention and would count them as 0;
:data:`EXTRA_HANDLES` adds the same convention for them (every weight matrix costs one MAC per
entry per time step; attention costs ``N*M*d`` for the scores plus ``N*M*d_v`` for the mix).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any, Hashable, Iterable, Sequence

import torch
from torch import nn

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)  # fvcore's import touches deprecated torch.jit APIs
    from fvcore.nn import FlopCountAnalysis
    from fvcore.nn.jit_handles import get_shape


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _recurrent_macs(inputs: list, outputs: list) -> int:
    """aten::lstm / aten::gru (input, hx, params, has_biases, layers, dropout, train, bidir, batch_first)."""
    x = get_shape(inputs[0])
    steps = _prod(x[:-1])  # batch * time, whichever order; later layers see the same count
    weights = [get_shape(v) for v in inputs[2].node().inputs()]
    return sum(steps * _prod(w) for w in weights if w is not None and len(w) == 2)


def _attention_macs(inputs: list, outputs: list) -> int:
    """aten::scaled_dot_product_attention: q @ k^T then weights @ v."""
    q, k, v = (get_shape(t) for t in inputs[:3])
    scores = _prod(q[:-1]) * k[-2]
    return scores * q[-1] + scores * v[-1]


# Operator -> fvcore handle, for operators fvcore leaves uncounted.
EXTRA_HANDLES = {
    "aten::lstm": _recurrent_macs,
    "aten::gru": _recurrent_macs,
    "aten::scaled_dot_product_attention": _attention_macs,
}


def count_params(module: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter values (buffers excluded)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


@torch.no_grad()
def count_macs(module: nn.Module, input_shape: Sequence[int], input_dtype: torch.dtype | None = None) -> int:
    """MACs of one forward pass of a single input of shape ``input_shape`` (no batch dim).

    The input is zeros of ``input_dtype``, else of ``module.input_dtype`` where a model declares
    one (token models: ``torch.long``), else of the parameters' dtype.
    """
    reference = next(iter(module.state_dict().values()), torch.zeros(()))
    float_dtype = reference.dtype if reference.is_floating_point() else torch.get_default_dtype()
    dtype = input_dtype or getattr(module, "input_dtype", None) or float_dtype
    x = torch.zeros(1, *input_shape, device=reference.device, dtype=dtype)
    training = module.training
    module.eval()  # tracing in train mode would move the running statistics
    try:
        analysis = FlopCountAnalysis(module, x).set_op_handle(**EXTRA_HANDLES)
        analysis.unsupported_ops_warnings(False)
        analysis.uncalled_modules_warnings(False)
        analysis.tracer_warnings("none")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.jit deprecation, from fvcore's tracer
            return int(analysis.total())
    finally:
        module.train(training)


class _LRU:
    """A small least-recently-used memo keyed on (architecture, spec, input shape)."""

    def __init__(self, maxsize: int = 4096):
        self.maxsize = maxsize
        self.data: "OrderedDict[Hashable, Any]" = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: Hashable, compute):
        if key in self.data:
            self.hits += 1
            self.data.move_to_end(key)
            return self.data[key]
        self.misses += 1
        value = self.data[key] = compute()
        if len(self.data) > self.maxsize:
            self.data.popitem(last=False)
        return value

    def clear(self) -> None:
        self.data.clear()
        self.hits = self.misses = 0


# Keys hold the architecture description, not the model, so memoizing keeps no model alive.
_SPEC_COST = _LRU()


def _spec_cost(model, spec: Any, input_shape: Sequence[int]) -> tuple[int, int]:
    key = (model.arch_key(), spec, tuple(input_shape))

    def compute():
        local = model.extract(spec).module
        return count_params(local), count_macs(local, input_shape, getattr(model, "input_dtype", None))

    return _SPEC_COST.get(key, compute)


def spec_macs(model, spec: Any, input_shape: Sequence[int]) -> int:
    """MACs of the subnet ``spec`` of an elastic model, counted once per (arch, spec, shape)."""
    return _spec_cost(model, spec, input_shape)[1]


def spec_params(model, spec: Any, input_shape: Sequence[int]) -> int:
    """Parameters of the subnet ``spec`` (memoized with :func:`spec_macs`)."""
    return _spec_cost(model, spec, input_shape)[0]


def model_table(model, specs: Iterable[Any], input_shape: Sequence[int]) -> list[dict]:
    """One row per spec: params, MACs and their shares of the full (max) subnet."""
    full_params, full_macs = _spec_cost(model, model.max_spec(), input_shape)
    rows = []
    for spec in specs:
        params, macs = _spec_cost(model, spec, input_shape)
        rows.append({"spec": spec, "params": params, "macs": macs,
                     "params_share": params / full_params, "macs_share": macs / full_macs})
    return rows


def format_model_table(rows: Sequence[dict]) -> str:
    """A fixed-width text table of :func:`model_table` rows."""
    header = ("spec", "params", "MACs", "params %", "MACs %")
    lines = [(str(r["spec"]), f"{r['params'] / 1e6:.3f}M", f"{r['macs'] / 1e6:.2f}M",
              f"{100 * r['params_share']:.2f}", f"{100 * r['macs_share']:.2f}") for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(header)]
    def fmt(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])
