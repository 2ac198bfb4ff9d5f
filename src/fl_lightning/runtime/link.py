"""What crosses between the server and one client in a round: a :class:`Downlink` down, an
:class:`Uplink` back.

The method builds the downlink (the routed model and any other tensors the client receives:
control variates, a global header...), the client's :class:`~fl_lightning.runtime.channel.Channel`
counts it and hands it over, the client builds its objective from it alone and returns an
uplink (what it sends back, and its figures), which the channel counts before the method's
``commit`` reads it. Traffic is therefore counted from the tensors that cross, never declared
beside them.

A client's own state that persists across its rounds (SCAFFOLD's ``c_i``, a private prompt, a
personalized body) is ``held``: a deployed client keeps it, the simulation keeps it in the
server's per-client store and passes it through the link uncounted, so that the client still
reads nothing but what its link carries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Generic, Optional, Sequence, TypeVar

import torch

from fl_lightning.elastic.routing import Routed
from fl_lightning.runtime.channel import Channel

Payload = TypeVar("Payload")


@dataclass
class Downlink:
    """What the server sends one client for its round."""

    model: Optional[Routed] = None
    """The routed model: the physical module the client trains and the map of its tensors to
    global positions (every routed position crosses, but ``held_keys``)."""
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    """Other tensors the client receives (SCAFFOLD's control variate ``c``)."""
    held: Dict[str, torch.Tensor] = field(default_factory=dict)
    """The client's own state from its earlier rounds (never crosses)."""
    held_keys: Sequence[str] = ()
    """Keys of ``model`` that hold the client's own tensors (FedGH's body, FedAS's head): they
    are in the module the client trains but do not cross."""
    channel: Channel = field(default_factory=Channel)
    """The client's link for the round: what else crosses during the fit (split learning's
    activations and gradients, probe interfaces) is counted on it."""


@dataclass
class Uplink(Generic[Payload]):
    """What a client sends back after its round, and its figures (``Uplink[Prototypes]`` names
    the method's payload type).

    ``metrics`` and the ``channel``'s traffic figures become the client's row in
    ``clients.jsonl`` (and round totals): every fit reports ``steps`` and ``seconds``;
    ``bytes_down`` (server to client) and ``bytes_up`` come from what crossed the channel.
    """

    client: int
    num_samples: int
    """Examples the client trained on; the default aggregation weight."""
    loss: float
    """Mean training loss over the client's steps."""
    model: Optional[Routed] = None
    """What goes up of the trained model: the module and the regions that cross (None: no model
    goes up)."""
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    """Other tensors that go up (SCAFFOLD's ``delta c_i``)."""
    held: Dict[str, torch.Tensor] = field(default_factory=dict)
    """The client's new own state (kept, never crosses)."""
    server_side: Optional[Routed] = None
    """Split learning: what the server half trained for this client (SplitFed V1's server
    copy), aggregated beside the model; it never leaves the server."""
    metrics: Dict[str, float] = field(default_factory=dict)
    channel: Channel = field(default_factory=Channel)
    """Everything that crossed between the server and this client in the round."""
    payload: Optional[Payload] = None
    """The method's typed record of what else the client reports that is not a tensor to count
    (FEAST's trained variants), or, for a split method, of what its server half learned from the
    client in the round (FedSGA's prototype sums); ``commit`` reads it."""

    @property
    def steps(self) -> int:
        return int(self.metrics.get("steps", 0))

    def row(self) -> Dict[str, float]:
        """The client's log row."""
        return {"loss": self.loss, "samples": self.num_samples, **self.channel.metrics(), **self.metrics}

    def non_finite(self) -> Optional[str]:
        """Why this result must not be committed (a NaN or inf loss, model, tensor or held
        state), else None."""
        if not math.isfinite(self.loss):
            return f"non-finite training loss ({self.loss})"
        named = {}
        for routed in (self.model, self.server_side):
            if routed is not None:
                named.update(routed.module.state_dict())
        named.update(self.tensors)
        named.update({f"held/{k}": v for k, v in self.held.items()})
        tensors = [t.detach() for t in named.values() if t.is_floating_point()]
        # NaN and inf survive plain sums (in the tensors' own precision: several times faster
        # than float64 or one concatenated copy); only when the total is not finite are the
        # tensors searched, as finite values can also overflow it.
        if tensors and not torch.isfinite(torch.stack([t.sum(dtype=torch.float32) for t in tensors]).sum()):
            bad = [k for k, t in named.items() if t.is_floating_point() and not torch.isfinite(t).all()]
            if bad:
                return f"non-finite values in the update ({', '.join(bad[:3])})"
        return None


def held_state(module: torch.nn.Module, keys: Sequence[str]) -> Dict[str, torch.Tensor]:
    """Detached copies of ``module``'s tensors under ``keys``: a client's own state to keep."""
    state = module.state_dict()
    return {key: state[key].detach().clone() for key in keys}


__all__ = ["Downlink", "Uplink", "Payload", "held_state"]
