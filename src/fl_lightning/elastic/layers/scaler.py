"""HeteroFL's Scaler: a width-``rate`` model divides its conv outputs by ``rate`` in training.

HeteroFL (Diao et al., 2021, Sec. 3) scales each layer's output of a rate-``r`` sub-model by
``1/r`` during local training so that its activations keep the magnitude of the full model's,
and leaves it out at inference. In the authors' code the Scaler sits right before every
normalization layer (``norm(scaler(conv(x)))`` in their CNN, ``n(scaler(x))`` in their
pre-activation ResNet); in this project's post-activation models every conv feeds its batch
norm directly, so the Scaler is attached to the output of every convolution.

It is attached to a client's local model only (:func:`attach_scaler`), as hooks: the model
classes stay as they are, so models without it pay nothing.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


class Scaler(nn.Module):
    """``x / rate`` in training mode, ``x`` in eval mode (no parameters, no buffers)."""

    def __init__(self, rate: float):
        super().__init__()
        if not 0 < rate <= 1:
            raise ValueError(f"a Scaler's rate must lie in (0, 1], got {rate}")
        self.rate = float(rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.rate if self.training else x

    def extra_repr(self) -> str:
        return f"rate={self.rate:g}"


def _scale_output(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    return module.scaler(output)


def attach_scaler(model: nn.Module, rate: float) -> List[RemovableHandle]:
    """Give every ``nn.Conv2d`` of ``model`` a :class:`Scaler` child applied to its output.

    The Scaler is registered as the conv's child ``scaler``, so ``model.train()`` and
    ``model.eval()`` switch it with the rest; it holds no state, so the state dict (what a
    client returns) is unchanged. Returns the hook handles (``handle.remove()`` detaches one;
    the ``scaler`` child stays and is then unused).
    """
    handles = []
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            module.scaler = Scaler(rate).train(module.training)
            handles.append(module.register_forward_hook(_scale_output))
    return handles
