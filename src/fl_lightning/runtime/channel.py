"""The link between the server and one client in one round: traffic counted where it crosses.

What a client receives is a ``Downlink`` and what it returns an ``Uplink``
(``runtime/link.py``): the client's :class:`Channel` counts both as it hands them over
(:meth:`Channel.deliver`, :meth:`Channel.collect`), and whatever else crosses during the fit
(split learning's activations and gradients at the ``cut``, ``probe`` interfaces) goes through
the same channel (:meth:`Channel.up`, :meth:`Channel.down`). Bytes are counted in the precision
a tensor crosses in (element size times count), by direction and by what it carries: the
``model`` (routed slices, a half, a body), the link's other tensors by their name's first part
(``c`` for ``c/layer.weight``), activations, probes... No algorithm adds byte figures by hand.

A client's log row reports the totals ``bytes_down`` (server to client) and ``bytes_up``, and,
for a direction that carried more than one kind, ``<kind>_bytes_down`` / ``<kind>_bytes_up``
of each kind (SplitFed: ``cut_bytes_up`` and ``model_bytes_up``).
"""

from __future__ import annotations

from typing import Dict, Iterable, Mapping, Optional, Tuple

import torch

from fl_lightning.elastic.routing import Routed

DOWN, UP = "down", "up"


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def state_bytes(state: Mapping[str, torch.Tensor], keys: Optional[Iterable[str]] = None) -> int:
    """Bytes of ``state``'s tensors under ``keys`` (default: all)."""
    keys = state.keys() if keys is None else keys
    return sum(tensor_bytes(state[key]) for key in keys)


class Channel:
    """Bytes that crossed between the server and one client, by direction and kind."""

    def __init__(self):
        self.counts: Dict[Tuple[str, str], int] = {}

    # -- what crosses ---------------------------------------------------------------------------
    def down(self, kind: str, *tensors: torch.Tensor) -> None:
        """Tensors the server sends the client."""
        self.count(DOWN, kind, sum(tensor_bytes(t) for t in tensors))

    def up(self, kind: str, *tensors: torch.Tensor) -> None:
        """Tensors the client sends the server."""
        self.count(UP, kind, sum(tensor_bytes(t) for t in tensors))

    def send_state(self, direction: str, kind: str, state: Mapping[str, torch.Tensor],
                   keys: Optional[Iterable[str]] = None) -> None:
        """The tensors of ``state`` under ``keys`` (default: all) crossing in ``direction``."""
        self.count(direction, kind, state_bytes(state, keys))

    def send_routed(self, direction: str, routed: Routed, kind: str = "model") -> None:
        """A routed model: every routed position at its local element size."""
        self.count(direction, kind, routed.payload_bytes())

    def deliver(self, downlink):
        """Count what the server sends (the routed model but the keys the client holds, and
        every other tensor of the downlink; its held state does not cross) and hand it over:
        the client gets copies of the tensors and of its held state, as a client across a
        network would, so nothing the server changes later reaches it. (The routed model is
        already the client's own module.)"""
        if downlink.model is not None:
            self.send_routed(DOWN, _without(downlink.model, downlink.held_keys))
        self._tensors(DOWN, downlink.tensors)
        downlink.tensors = {k: v.detach().clone() for k, v in downlink.tensors.items()}
        downlink.held = {k: v.detach().clone() for k, v in downlink.held.items()}
        downlink.channel = self
        return downlink

    def collect(self, uplink):
        """Count what the client sends back (the regions of its model that go up and its other
        tensors; its held state does not cross) and take it in."""
        if uplink.model is not None:
            self.send_routed(UP, uplink.model)
        self._tensors(UP, uplink.tensors)
        if uplink.channel is not self:
            self.merge(uplink.channel)
            uplink.channel = self
        return uplink

    def _tensors(self, direction: str, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.count(direction, name.split("/")[0], tensor_bytes(tensor))

    def count(self, direction: str, kind: str, nbytes: int) -> None:
        if direction not in (DOWN, UP):
            raise ValueError(f"direction must be {DOWN!r} or {UP!r}, not {direction!r}")
        self.counts[direction, kind] = self.counts.get((direction, kind), 0) + int(nbytes)

    def merge(self, other: "Channel") -> None:
        """Add what crossed ``other`` (the same client's link, counted apart)."""
        for (direction, kind), nbytes in other.counts.items():
            self.count(direction, kind, nbytes)

    # -- what it reports ------------------------------------------------------------------------
    def total(self, direction: str, kind: Optional[str] = None) -> int:
        return sum(n for (d, k), n in self.counts.items() if d == direction and kind in (None, k))

    def metrics(self) -> Dict[str, int]:
        """The client's traffic figures: totals both ways, and per kind where a direction
        carried more than one."""
        out = {"bytes_down": self.total(DOWN), "bytes_up": self.total(UP)}
        for direction in (DOWN, UP):
            kinds = [k for (d, k) in self.counts if d == direction]
            if len(kinds) > 1:
                out.update({f"{kind}_bytes_{direction}": self.counts[direction, kind] for kind in kinds})
        return out


def _without(routed: Routed, keys) -> Routed:
    """``routed`` less the regions of ``keys`` (tensors the client already holds)."""
    keys = set(keys)
    return routed if not keys else Routed(routed.module, {k: v for k, v in routed.regions.items() if k not in keys})
