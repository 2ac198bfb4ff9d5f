"""fvcore's MACs next to the paper's (DeepFedNAS's) on one subnet: the independent check of
:class:`~fl_lightning.elastic.search.cost.DeepFedNASCostModel` against a real module.

FEAST's budgets, cache MACs and footprints follow DeepFedNAS's counter, which counts
convolutions and the classifier only. fvcore traces the module and counts, besides, 2 per
batch-norm output element and 1 per input element of the global average pool (and nothing for
the projection's average pool, ReLU or additions). On a module built as the DeepFedNAS
construction, therefore:

- fvcore's ``conv`` + ``linear`` operators == ``cost.macs`` exactly;
- fvcore's total == ``cost.fvcore_macs`` exactly;
- the ratio fvcore / paper lies in ``[1, 1 + FVCORE_EXCESS_BOUND]``: 1.001-1.027 over 200,000
  random specs of FEAST's CIFAR space, 1.039 for its smallest subnet (``d = 0000``, every
  choice at its minimum; 1.044 at 64x64 with a stride-2 first stage), 1.007-1.021 over the
  55-variant cache of docs/variant_cache.md.

The exact equalities are what a test should assert; the ratio bound is a sanity check on the
size of the difference (and the reason affordability must use one convention throughout: a
budget within 2-4% of a variant's MACs can flip between the two).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional, Sequence

import torch
from torch import nn

from fl_lightning.elastic.search.cost import DeepFedNASCostModel

FVCORE_EXCESS_BOUND = 0.05
"""fvcore's count exceeds the paper's by under 5% anywhere in FEAST's space, at 32x32 and at
64x64 (3.9% and 4.4% at most, see above)."""

PAPER_OPERATORS = ("conv", "linear", "addmm", "matmul")
"""fvcore operator names that DeepFedNAS's counter also counts (convolutions, the classifier)."""


class ConventionCheck(NamedTuple):
    """One subnet counted both ways (MACs for one input, parameters of the module)."""

    fvcore_macs: int
    """fvcore's total."""
    fvcore_paper_part: int
    """fvcore's count of the operators the paper counts (:data:`PAPER_OPERATORS`)."""
    fvcore_by_operator: dict
    paper_macs: int
    """The cost model's MACs (DeepFedNAS's convention)."""
    expected_fvcore_macs: int
    """The cost model's prediction of fvcore's total (:meth:`DeepFedNASCostModel.fvcore_macs`)."""
    module_params: int
    paper_params: int

    @property
    def ratio(self) -> float:
        """fvcore / paper."""
        return self.fvcore_macs / self.paper_macs

    def problems(self, excess_bound: float = FVCORE_EXCESS_BOUND) -> list[str]:
        """What disagrees (empty when the module is the construction the cost model counts)."""
        out = []
        if self.fvcore_paper_part != self.paper_macs:
            out.append(f"fvcore conv+linear {self.fvcore_paper_part} != paper MACs {self.paper_macs}")
        if self.fvcore_macs != self.expected_fvcore_macs:
            out.append(f"fvcore total {self.fvcore_macs} != predicted {self.expected_fvcore_macs}")
        if self.module_params != self.paper_params:
            out.append(f"module parameters {self.module_params} != counted {self.paper_params}")
        if not 1.0 <= self.ratio <= 1.0 + excess_bound:
            out.append(f"fvcore / paper = {self.ratio:.4f} outside [1, {1 + excess_bound:g}]")
        return out

    def __str__(self) -> str:
        return (f"fvcore {self.fvcore_macs / 1e6:.3f}M MACs, paper {self.paper_macs / 1e6:.3f}M "
                f"(x{self.ratio:.4f}); params {self.module_params} / {self.paper_params}")


@torch.no_grad()
def fvcore_operators(module: nn.Module, input_shape: Sequence[int]) -> dict:
    """fvcore's MACs of one input (batch 1, eval mode) per operator name."""
    from fvcore.nn import FlopCountAnalysis

    reference = next(iter(module.parameters()))
    x = torch.zeros(1, *input_shape, dtype=reference.dtype, device=reference.device)
    training = module.training
    module.eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            analysis = FlopCountAnalysis(module, x)
            analysis.unsupported_ops_warnings(False)
            analysis.uncalled_modules_warnings(False)
            analysis.tracer_warnings("none")
            return {k: int(v) for k, v in analysis.by_operator().items()}
    finally:
        module.train(training)


def convention_check(model: nn.Module, spec, cost: DeepFedNASCostModel,
                     input_shape: Optional[Sequence[int]] = None) -> ConventionCheck:
    """Count ``spec`` with fvcore on ``model`` and with ``cost`` (the paper's convention).

    ``model`` is an elastic supernet with ``extract(spec)`` (its subnet is counted) or the
    subnet itself; ``spec`` an ``OFASpec`` or a genome of ``cost``. ``input_shape`` defaults to
    the cost model's. See the module docstring for what should agree.
    """
    genes = cost.encode(spec) if not isinstance(spec, (list, tuple)) and hasattr(spec, "d") else spec
    shape = tuple(input_shape or cost.input_shape)
    if tuple(shape) != tuple(cost.input_shape):
        raise ValueError(f"the cost model counts at {cost.input_shape}, not {shape}")
    subnet = model.extract(spec).module if hasattr(model, "extract") else model
    by_op = fvcore_operators(subnet, shape)
    return ConventionCheck(
        fvcore_macs=sum(by_op.values()),
        fvcore_paper_part=sum(v for k, v in by_op.items() if k in PAPER_OPERATORS),
        fvcore_by_operator=by_op,
        paper_macs=int(cost.macs(genes)[0]),
        expected_fvcore_macs=int(cost.fvcore_macs(genes)[0]),
        module_params=sum(p.numel() for p in subnet.parameters()),
        paper_params=int(cost.params(genes)[0]),
    )
