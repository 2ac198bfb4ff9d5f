"""FEAST's budget-tailored routing: the depth-width envelope of a client's affordable variants.

For client ``i`` with affordable set ``A_i`` the server routes the reduced supernet bounded by
the coordinate-wise maxima (FEAST Eq. 4 / Supp. Eq. 12)

    d*_l = max_{a in A_i} d_l(a),     w*_j = max_{a in A_i} w_j(a).

No separate expansion bound is used (Supp. C): each retained bottleneck keeps the middle
channels of the *largest* globally allowed expansion at its routed width, so every expansion
choice stays available and a chosen ``e_l`` activates a leading slice at run time. The
envelope spec therefore carries the maximal expansion in every stage.

Routing is the model's elastic extraction of the envelope spec
(``model.extract(envelope, elastic=True)``): it builds that reduced supernet directly at its
size (never a copy of the global model), copies leading slices of the global tensors into it
and records the map back to global positions. Communication accounting (Supp. C, Eq. 16): a round costs ``2 * sum_i P_i``
parameters with routing against ``2 * m * P`` for sending the full supernet.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from fl_lightning.elastic.models.base import shapes_only
from fl_lightning.elastic.models.ofa_resnet import EXPANSION_CHOICES, OFAResNet, OFASpec
from fl_lightning.elastic.routing import Routed


def _num_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def envelope(specs: Iterable[OFASpec], max_expansion: Optional[float] = None) -> OFASpec:
    """The tightest routed architecture containing every spec (Eq. 4).

    ``max_expansion`` is the largest globally allowed expansion (default FEAST's 0.25); pass
    ``model.max_expansion`` for a supernet with other choices.
    """
    specs = list(specs)
    if not specs:
        raise ValueError("envelope of an empty affordable set")
    stages = len(specs[0].d)
    if any(len(s.d) != stages for s in specs):
        raise ValueError("specs of an envelope must have the same number of stages")
    if max_expansion is None:
        max_expansion = max(EXPANSION_CHOICES)
    d = tuple(max(s.d[l] for s in specs) for l in range(stages))
    w = tuple(max(s.w[j] for s in specs) for j in range(stages + 1))
    return OFASpec(d, (float(max_expansion),) * stages, w)


def _bounds(model: OFAResNet, specs: Sequence[OFASpec]) -> OFASpec:
    return envelope([model.check_spec(s) for s in specs], model.max_expansion)


def route_envelope(model: OFAResNet, specs: Iterable[OFASpec]) -> Routed:
    """A reduced elastic supernet that can activate every spec in ``specs``, holding copies of
    the global leading slices, with the map from its state keys to global positions: the
    elastic extraction of the envelope."""
    return model.extract(_bounds(model, list(specs)), elastic=True)


def routed_param_count(model: OFAResNet, specs: Iterable[OFASpec]) -> int:
    """``P_i``: parameters a client with affordable set ``specs`` receives (and returns)."""
    with shapes_only():
        return _num_params(model.build_local(_bounds(model, list(specs)), elastic=True))


def full_param_count(model: OFAResNet) -> int:
    """``P``: parameters of the whole supernet (what routing-free FEAST sends)."""
    return _num_params(model)


def communication(model: OFAResNet, affordable_sets: Sequence[Iterable[OFASpec]]) -> dict:
    """Round-trip parameter payloads of one round's cohort (FEAST Supp. C, Eq. 16).

    Returns the full-supernet payload ``2 m P``, the routed payload ``2 sum_i P_i``, their
    ratio (the aggregate reduction) and each client's reduction ``P / P_i``.
    """
    full = full_param_count(model)
    routed = [routed_param_count(model, specs) for specs in affordable_sets]
    return {
        "full_payload": 2 * len(routed) * full,
        "routed_payload": 2 * sum(routed),
        "reduction": len(routed) * full / sum(routed),
        "client_params": routed,
        "client_reductions": [full / p for p in routed],
    }
