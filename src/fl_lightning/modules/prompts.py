"""FedSGA's client-specific adaptation channel: m private prompt tokens per client (Sec. 3.2).

Two forms, chosen by what the client half accepts (docs/fedsga.md):

- token prompts (a front whose ``forward`` takes ``prompt_tokens``, timm's ViT): m vectors of
  the model's width inserted after the class token (VPT-shallow);
- an input-side padding prompt (any other front, e.g. ResNet): the image border,
  ``width`` pixels wide, split into m equal runs along the perimeter, each run one token,
  added to the pixels it covers (visual prompting, Bahng et al., 2022).

A prompt is one tensor (kept in the server's per-client store between rounds); the tokens
are views of it. Zero is the initial value: the first round sees the unprompted model.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, List, Sequence

import torch
from torch import nn


def takes_prompt_tokens(front: nn.Module) -> bool:
    return "prompt_tokens" in inspect.signature(front.forward).parameters


def border_order(height: int, width: int, band: int) -> torch.Tensor:
    """Flat pixel indices of the ``band``-wide image border, clockwise from the top-left corner."""
    if not 0 < band <= min(height, width) // 2:
        raise ValueError(f"a prompt band of {band} pixels does not fit a {height}x{width} image")
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    ring = (rows < band) | (rows >= height - band) | (cols < band) | (cols >= width - band)
    r, c = rows[ring].double(), cols[ring].double()
    # clockwise angle from the top-left corner as seen from the centre
    angle = torch.atan2(c - (width - 1) / 2, -(r - (height - 1) / 2))
    start = math.atan2(-(width - 1) / 2, (height - 1) / 2)
    angle = torch.remainder(angle - start, 2 * math.pi)
    flat = (rows * width + cols)[ring]
    return flat[torch.argsort(angle, stable=True)]


class PromptChannel:
    """Shape, application and per-token views of one backbone's prompts."""

    def __init__(self, front: nn.Module, input_shape: Sequence[int], num_tokens: int, band: int,
                 token_dim: int | None = None):
        self.num_tokens = num_tokens
        self.token_prompts = takes_prompt_tokens(front)
        if self.token_prompts:
            if token_dim is None:
                raise ValueError("token prompts need the model's token width")
            self.shape = (num_tokens, token_dim)
        else:
            channels, height, width = input_shape
            self.order = border_order(height, width, band)
            if len(self.order) < num_tokens:
                raise ValueError(f"{num_tokens} prompt tokens need at least that many border pixels")
            self.image_shape = (channels, height, width)
            self.shape = (channels, len(self.order))
            self.runs = [len(run) for run in torch.arange(len(self.order)).tensor_split(num_tokens)]

    def initial(self, device=None, dtype=None) -> torch.Tensor:
        return torch.zeros(self.shape, device=device, dtype=dtype)

    def tokens(self, prompt: torch.Tensor) -> List[torch.Tensor]:
        """The m tokens as views of ``prompt`` (or of its gradient)."""
        if self.token_prompts:
            return list(prompt.unbind(0))
        return list(prompt.split(self.runs, dim=1))

    def token_norms(self, prompt: torch.Tensor) -> torch.Tensor:
        return torch.stack([t.norm() for t in self.tokens(prompt)])

    def apply(self, front: nn.Module, prompt: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The prompted client half ``x -> front(x~)``."""
        if self.token_prompts:
            return lambda x: front(x, prompt_tokens=prompt.unsqueeze(0).to(x.dtype))

        order = self.order.to(prompt.device)
        channels, height, width = self.image_shape

        def forward(x: torch.Tensor) -> torch.Tensor:
            canvas = prompt.new_zeros(channels, height * width).index_copy(1, order, prompt)
            return front(x + canvas.view(channels, height, width).to(x.dtype))
        return forward
