"""Pieces the split-FL methods (SplitFed, FedSGA, MergeSFL, MU-SplitFed, MultiSFL) share: a
client's split round (:class:`SplitClient`), the regions of one half's keys, the per-client
figures of docs/fedsga.md ("The cut"), and the default cut candidates."""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.algorithms.client import Client
from fl_lightning.elastic.routing import RegionMap, full_region_map
from fl_lightning.modules.split import one_step


class SplitClient(Client):
    """One client's split round, made per task by the method (``SplitFed.new_client``): what
    its front computes, what it trains besides the front, how its backward runs, and the
    server's loss and step on its batches (the server half is in the loop). Everything the round
    learns about the client stays on this object, never on the method.

    This one is plain split learning: the front as it is, cross-entropy at the server, one
    server step per batch. FedSGA's client adds its prompt and the alignment term.

    Given: its round and the rank's split engine (``split/engine.py``), which builds its pair on
    the workers the method loaded for it, trains it and makes its uplink.
    """

    def __init__(self, round, engine):
        super().__init__(round)
        self.engine = engine

    def fit(self, downlink):
        """The split round on the engine: the pair built, trained over the client's shard, the uplink."""
        return self.engine.run(self, downlink)

    def forward(self, front: nn.Module):
        """The client half's forward on a batch."""
        return front

    def trainables(self) -> List[torch.Tensor]:
        """Client-side tensors trained besides the front."""
        return []

    def backward(self, fabric, z: torch.Tensor, grad: torch.Tensor) -> None:
        """The client's backward from the gradient at the cut."""
        fabric.backward(z, grad)

    def after_backward(self) -> None:
        """Called after the client's backward and clipping, before its step."""

    def server_loss(self, back: nn.Module, sent: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The server half's loss on one received batch."""
        return F.cross_entropy(back(sent), y)

    def server_rule(self, fabric, pair, sent, y, cfg, index, fit) -> tuple:
        """How the server half learns from one received batch (``modules/split.py``'s ServerRule)."""
        return one_step(fabric, pair, sent, y, cfg, index, fit)


def key_regions(state: Mapping[str, torch.Tensor], keys: Sequence[str], prefix: str = "") -> RegionMap:
    """Whole-tensor regions of ``keys`` of ``state``, local keys prefixed by ``prefix``."""
    return {prefix + k: v for k, v in full_region_map({k: state[k] for k in keys}).items()}


def split_metrics(halves, cut: str, *, steps: int, seconds: float, client_seconds: float,
                  server_seconds: float, examples: int) -> Dict[str, float]:
    """A client's row as SplitFed writes it (its traffic comes from the channel): activated
    client parameters and client MACs (fvcore's forward count times three)."""
    return {"steps": steps, "seconds": seconds, "client_seconds": client_seconds, "server_seconds": server_seconds,
            "client_params": halves.front_params[cut], "client_macs": 3 * halves.front_macs[cut] * examples}


def label_counts(targets: torch.Tensor, clients: List[torch.Tensor], num_classes: int) -> torch.Tensor:
    """``(num_clients, num_classes)`` float64 label histograms of the clients' shards."""
    targets = torch.as_tensor(targets, dtype=torch.long)
    return torch.stack([torch.bincount(targets[idx], minlength=num_classes)[:num_classes].to(torch.float64)
                        for idx in clients])


def default_candidates(names: List[str]) -> List[str]:
    """Ends of all but the last stage for ``stage.index`` block names, else the boundaries
    after a quarter, a half and three quarters of the blocks."""
    inner = names[:-1]
    stages: Dict[str, str] = {}
    for name in inner:
        if "." in name:
            stages[name.split(".")[0]] = name  # the last block seen of each stage
    last_stage = names[-1].split(".")[0] if "." in names[-1] else None
    ends = [end for stage, end in stages.items() if stage != last_stage]
    if len(ends) >= 2:
        return ends
    depth = len(names)
    counts = sorted({min(max(1, round(depth * q)), depth - 1) for q in (0.25, 0.5, 0.75)})
    return [names[k - 1] for k in counts]
