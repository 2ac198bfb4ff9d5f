"""LEAF's Shakespeare next-character LSTM, width-elastic in its hidden size (HAS-FL Sec. 4.1).

Character embedding (8 dims) -> two-layer LSTM (256 hidden units) -> linear projection of the
last step's output to the vocabulary. A sub-model keeps the leading ``h`` hidden units of every
gate block in both LSTM layers; the embedding and every row (output class) of the projection
are shared in full by all widths, and only the projection's input columns follow ``h``
(HAS-FL Sec. 4.6). The spec is a one-stage :class:`WidthSpec`: ``h = ceil(width * 256)``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import torch
from torch import nn

from fl_lightning.elastic.layers.linear import ElasticLinear
from fl_lightning.elastic.layers.sequence import ElasticEmbedding, ElasticLSTM
from fl_lightning.elastic.models.base import ElasticModel
from fl_lightning.elastic.regions import Full
from fl_lightning.elastic.routing import RegionMap
from fl_lightning.elastic.specs import WidthSpec, scale_channels
from fl_lightning.option_types import PositiveInt, UnitFraction


class CharLSTM(ElasticModel):
    """Next-character LSTM (LEAF Shakespeare); the hidden width is the elastic dimension.

    Args:
        num_classes: output classes, the character vocabulary (80 in LEAF).
        input_shape: ``(sequence_length,)`` of one input of character ids (80 in LEAF).
        embedding_dim: character embedding width, shared in full by every width.
        hidden_size: hidden units per LSTM layer of the full model.
        num_layers: stacked LSTM layers.
        vocab_size: input vocabulary; defaults to ``num_classes`` (input and output alphabets
            are the same in next-character prediction).
        min_width: smallest width ratio, returned by ``min_spec()``.
        elastic: elastic layers (the server model) or plain ones (an extracted sub-model).
        max_widths: ``(ratio,)``, the largest width this instance holds (default ``(1.0,)``, the
            full model); smaller values build a reduced copy (a client's local model) whose
            specs keep their meaning.
    """

    spec_type = WidthSpec

    def __init__(self, num_classes: int, input_shape: Sequence[int], embedding_dim: PositiveInt = 8,
                 hidden_size: PositiveInt = 256, num_layers: PositiveInt = 2,
                 vocab_size: Optional[PositiveInt] = None, min_width: UnitFraction = 0.0625,
                 elastic: bool = True, max_widths: Optional[Sequence[float]] = None):
        vocab_size = vocab_size or num_classes
        bounds = WidthSpec(tuple(max_widths) if max_widths is not None else (1.0,))
        super().__init__(num_classes=num_classes, input_shape=tuple(input_shape), embedding_dim=embedding_dim,
                         hidden_size=hidden_size, num_layers=num_layers, vocab_size=vocab_size,
                         min_width=min_width, elastic=elastic, max_widths=bounds.widths)
        self.num_classes = num_classes
        self.input_shape = tuple(input_shape)
        self.embedding_dim = embedding_dim
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.vocab_size = vocab_size
        self.min_width = min_width
        self.elastic = elastic
        self.bounds = bounds
        self.held_hidden = self.hidden_for(bounds)  # hidden units this instance holds
        if elastic:
            self.embedding = ElasticEmbedding(vocab_size, embedding_dim)
            self.lstm = ElasticLSTM(embedding_dim, self.held_hidden, num_layers, batch_first=True)
            self.head = ElasticLinear(self.held_hidden, num_classes)
        else:
            self.embedding = nn.Embedding(vocab_size, embedding_dim)
            self.lstm = nn.LSTM(embedding_dim, self.held_hidden, num_layers, batch_first=True)
            self.head = nn.Linear(self.held_hidden, num_classes)

    # -- specs ------------------------------------------------------------------------------
    def max_spec(self) -> WidthSpec:
        return self.bounds

    def min_spec(self) -> WidthSpec:
        return WidthSpec.uniform(min(self.min_width, self.bounds.widths[0]), 1)

    def hidden_for(self, spec: WidthSpec) -> int:
        """Active LSTM hidden units for ``spec`` (a ratio of the full ``hidden_size``)."""
        if not isinstance(spec, WidthSpec) or len(spec.widths) != 1:
            raise ValueError(f"CharLSTM needs a one-stage WidthSpec, got {spec!r}")
        return scale_channels(self.hidden_size, spec.widths[0])

    def _held_hidden_for(self, spec: WidthSpec) -> int:
        hidden = self.hidden_for(spec)
        if hidden > self.held_hidden:
            raise ValueError(f"{spec} exceeds this CharLSTM's largest spec {self.bounds}")
        return hidden

    def set_active(self, spec: WidthSpec) -> None:
        hidden = self._held_hidden_for(spec)
        if not self.elastic:
            if hidden != self.held_hidden:
                raise ValueError(f"a plain CharLSTM only runs at its own size {self.bounds}, got {spec}")
        else:
            self.lstm.active_hidden = hidden
        self.active_spec = spec

    # -- forward pieces ---------------------------------------------------------------------
    def _last_step(self, embedded: torch.Tensor) -> torch.Tensor:
        """The LSTM's output at the last step, what LEAF's model classifies."""
        return self.lstm(embedded)[0][:, -1]

    def blocks(self):
        # the head's input width follows the LSTM's active width, read from the features
        return OrderedDict(embed=self.embedding, lstm=self._last_step)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features)

    # -- routing ----------------------------------------------------------------------------
    def regions(self, spec: WidthSpec, kind: str = "leading", offset: int = 0) -> RegionMap:
        if kind != "leading":
            raise ValueError(f"CharLSTM slices leading hidden units of each gate only; got kind {kind!r}")
        if not self.elastic:
            raise ValueError("regions are defined on the elastic (server) model")
        hidden = self._held_hidden_for(spec)
        local = {"embedding.weight": Full(self.embedding.weight.shape)}
        local.update({f"lstm.{k}": r for k, r in self.lstm.regions(hidden).items()})
        local.update({f"head.{k}": r for k, r in self.head.regions(hidden, self.num_classes).items()})
        return {key: (key, region) for key, region in local.items()}

    def build_local(self, spec: WidthSpec, elastic: bool) -> "CharLSTM":
        return CharLSTM(self.num_classes, self.input_shape, embedding_dim=self.embedding_dim,
                        hidden_size=self.hidden_size, num_layers=self.num_layers, vocab_size=self.vocab_size,
                        min_width=self.min_width, elastic=elastic, max_widths=spec.widths)
