"""What a client fit hands back to the loop."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Generic, Optional, TypeVar

import torch

from fl_lightning.elastic.routing import Routed
from fl_lightning.runtime.channel import Channel

Payload = TypeVar("Payload")


@dataclass
class ClientResult(Generic[Payload]):
    """One client's round: its trained tensors, its figures and its traffic
    (``ClientResult[Prototypes]`` names the method's payload type).

    ``metrics`` and the ``channel``'s traffic figures become the client's row in
    ``clients.jsonl`` (and round totals in TensorBoard): every fit reports ``steps`` and
    ``seconds``; ``bytes_down`` (server to client) and ``bytes_up`` come from what crossed the
    channel.
    """

    client: int
    num_samples: int
    """Examples the client trained on; the default aggregation weight."""
    loss: float
    """Mean training loss over the client's steps."""
    update: Optional[Routed] = None
    """The trained local model and the map back to global positions (None: nothing to aggregate)."""
    module: Any = None
    """The module that trained (a LightningModule), for the algorithm's per-client bookkeeping."""
    metrics: Dict[str, float] = field(default_factory=dict)
    channel: Channel = field(default_factory=Channel)
    """Everything that crossed between the server and this client in the round."""
    payload: Optional[Payload] = None
    """What else the client hands the server, as the method's own typed record (FedGH's
    prototypes, FedSGA's next per-client state); ``commit`` reads it."""

    @property
    def steps(self) -> int:
        return int(self.metrics.get("steps", 0))

    def row(self) -> Dict[str, float]:
        """The client's log row."""
        return {"loss": self.loss, "samples": self.num_samples, **self.channel.metrics(), **self.metrics}

    def non_finite(self) -> Optional[str]:
        """Why this result must not be aggregated (a NaN or inf loss or update), else None."""
        if not math.isfinite(self.loss):
            return f"non-finite training loss ({self.loss})"
        if self.update is not None:
            tensors = [t.detach() for t in self.update.module.state_dict().values() if t.is_floating_point()]
            # NaN and inf survive plain sums (in the tensors' own precision: several times faster
            # than float64 or one concatenated copy); only when the total is not finite are the
            # tensors searched, as finite values can also overflow it.
            if tensors and not torch.isfinite(torch.stack([t.sum(dtype=torch.float32) for t in tensors]).sum()):
                bad = [k for k, t in self.update.module.state_dict().items()
                       if t.is_floating_point() and not torch.isfinite(t).all()]
                if bad:
                    return f"non-finite values in the update ({', '.join(bad[:3])})"
        return None
