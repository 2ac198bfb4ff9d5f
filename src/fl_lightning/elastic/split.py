"""Split learning halves of an elastic model, and which state-dict keys each half owns.

Split FL (SplitFed, FedSGA) cuts a model at a block boundary: the client trains the *front*
(the blocks up to and including the cut) and the server the *back* (the remaining blocks and
the head). The halves are views of one model: they hold the model's own parameters and buffers
(never copies), so training them trains the model, and routing, aggregation and checkpoints
keep working on the model's state dict. Which keys travel to the client and which stay on the
server is then read off the halves by tensor identity (:func:`split_keys`), so no model has to
spell out its key prefixes twice.

:class:`SplitFront` and :class:`SplitBack` are the default halves
(:meth:`fl_lightning.elastic.models.base.ElasticModel.split`); a model whose blocks are not
all modules (the ViT, whose first block also embeds the image) builds its own halves.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Callable, Iterable, Mapping, Tuple

import torch
from torch import nn

__all__ = ["SplitFront", "SplitBack", "split_keys"]


def _sequential(blocks: Iterable[Tuple[str, nn.Module]]) -> nn.Sequential:
    # Module names may not contain dots; "layer1.0" becomes "layer1_0".
    return nn.Sequential(OrderedDict((name.replace(".", "_"), block) for name, block in blocks))


class SplitFront(nn.Module):
    """The client half: the model's blocks up to and including the cut, run in order."""

    def __init__(self, blocks: Iterable[Tuple[str, nn.Module]]):
        super().__init__()
        self.blocks = _sequential(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class SplitBack(nn.Module):
    """The server half: the blocks after the cut, then the model's head.

    The head is the model class's own ``forward_head``, called with this module as ``self``:
    the head's modules are registered here under the attribute names ``forward_head`` reads
    (the model's ``head_modules()``), so the head runs on the shared modules without the back
    half holding the whole model, and ``parameters()`` are exactly those after the cut plus
    the head's.
    """

    def __init__(self, blocks: Iterable[Tuple[str, nn.Module]], head_modules: Mapping[str, nn.Module],
                 forward_head: Callable[[nn.Module, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.blocks = _sequential(blocks)
        for name, module in head_modules.items():
            if name in self._modules or hasattr(type(self), name):
                raise ValueError(f"head module name {name!r} clashes with an attribute of {type(self).__name__}")
            self.add_module(name, module)
        self._forward_head = forward_head  # a plain function (the unbound method), not a module

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self._forward_head(self, self.blocks(h))


def split_keys(model: nn.Module, cut) -> Tuple[list[str], list[str]]:
    """``(front_keys, back_keys)``: the keys of ``model.state_dict()`` (parameters and buffers)
    held by the front and by the back half of ``model.split(cut)``, in state-dict order.

    Found by tensor identity, so they follow whatever modules the halves hold. The halves must
    partition the state dict: a key in neither half (a tensor the split forgot, e.g. an
    inactive block of a supernet: split an extracted subnet instead) or in both (a tensor two
    halves would train apart) is a RuntimeError naming the key.
    """
    front, back = model.split(cut)
    owners: dict[int, set[str]] = {}
    for side, half in (("front", front), ("back", back)):
        for tensor in itertools.chain(half.parameters(), half.buffers()):
            owners.setdefault(id(tensor), set()).add(side)
    keys: dict[str, list[str]] = {"front": [], "back": []}
    for key, tensor in model.state_dict(keep_vars=True).items():
        sides = owners.get(id(tensor), set())
        if not sides:
            raise RuntimeError(f"{type(model).__name__} split at {cut!r}: {key} is in neither half")
        if len(sides) > 1:
            raise RuntimeError(f"{type(model).__name__} split at {cut!r}: {key} is in both halves")
        keys[sides.pop()].append(key)
    return keys["front"], keys["back"]
