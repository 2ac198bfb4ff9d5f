"""Elastic layers for sequence models: embedding, LSTM, layer norm and transformer pieces.

Like :class:`~fl_lightning.elastic.layers.linear.ElasticLinear`, every layer here holds its
full parameters, forwards a slice of them, builds a plain module holding copies of a slice
(``extract``) and names the global positions of that slice (``regions``: local parameter name
-> :class:`~fl_lightning.elastic.regions.Region` of the same-named global parameter).

Two weights are not a plain leading slice: an LSTM stacks its four gates (i, f, g, o) along the
rows of ``weight_ih`` / ``weight_hh`` / biases, and a fused attention ``qkv`` projection stacks
q, k and v. Slicing the leading rows of such a matrix would mix gates (or turn part of the
queries into keys), so these weights are sliced per stacked block by :class:`GateBlockSlice`.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import _VF, nn
from timm.layers import Mlp
from timm.models.vision_transformer import Attention

from fl_lightning.elastic.layers.leading import leading
from fl_lightning.elastic.layers.linear import ElasticLinear
from fl_lightning.elastic.regions import LeadingSlice, Region

LSTM_GATES = 4  # PyTorch's row order: input, forget, cell (g), output
QKV_BLOCKS = 3  # timm's fused qkv rows: queries, keys, values


def _prefixed(prefix: str, regions: dict) -> dict:
    """Region dict of a child module, keyed by the parent's parameter names."""
    return {f"{prefix}.{name}": region for name, region in regions.items()}


class GateBlockSlice(Region):
    """Leading slice within each of ``num_blocks`` equal blocks stacked along dimension 0.

    The global tensor has ``num_blocks * B`` rows; the local one ``num_blocks * b`` rows, block
    ``g`` of the local tensor being rows ``[g*B, g*B + b)`` of the global one. Trailing
    dimensions are leading slices, as in :class:`LeadingSlice`. With ``num_blocks=4`` this is an
    LSTM weight keeping ``b`` hidden units of every gate; with ``num_blocks=3`` a fused
    ``qkv`` projection keeping the first ``b`` query, key and value rows.
    """

    def __init__(self, global_shape: Sequence[int], local_shape: Sequence[int], num_blocks: int = LSTM_GATES):
        self.global_shape = torch.Size(global_shape)
        local_shape = tuple(local_shape) + tuple(self.global_shape[len(local_shape):])
        if len(local_shape) != len(self.global_shape) or any(
            not 0 <= n <= g for n, g in zip(local_shape, self.global_shape)
        ):
            raise ValueError(f"local shape {local_shape} is not a slice of {tuple(self.global_shape)}")
        if self.global_shape[0] % num_blocks or local_shape[0] % num_blocks:
            raise ValueError(
                f"dimension 0 of {tuple(self.global_shape)} and {local_shape} must be divisible "
                f"by the {num_blocks} stacked blocks"
            )
        self.num_blocks = num_blocks
        self.local_shape = torch.Size(local_shape)
        self.block_size = self.global_shape[0] // num_blocks
        self.local_block_size = local_shape[0] // num_blocks
        # index into the (num_blocks, block, *rest) view of the global tensor
        self.index = (slice(None), slice(0, self.local_block_size)) + tuple(slice(0, n) for n in local_shape[1:])

    def _covered(self, full: torch.Tensor) -> torch.Tensor:
        """A view of ``full`` shaped ``(num_blocks, b, *rest)`` over the covered positions."""
        return full.unflatten(0, (self.num_blocks, self.block_size))[self.index]

    def _blocks(self, local: torch.Tensor) -> torch.Tensor:
        return local.unflatten(0, (self.num_blocks, self.local_block_size))

    def gather(self, full):
        out = full.new_empty(self.local_shape)
        self._blocks(out).copy_(self._covered(full))
        return out

    def scatter(self, full, local):
        self._covered(full).copy_(self._blocks(local))

    def scatter_add(self, full, local, alpha=1.0):
        self._covered(full).add_(self._blocks(local), alpha=alpha)

    def fill_add(self, full, value):
        self._covered(full).add_(value)

    def numel(self):
        return self.local_shape.numel()

    def contains(self, other: "GateBlockSlice") -> bool:
        """Whether every position of ``other`` is also covered here."""
        return (
            isinstance(other, GateBlockSlice)
            and other.num_blocks == self.num_blocks
            and other.global_shape == self.global_shape
            and all(a >= b for a, b in zip(self.local_shape, other.local_shape))
        )

    def __repr__(self):
        return (
            f"GateBlockSlice({tuple(self.local_shape)} of {tuple(self.global_shape)}, "
            f"{self.num_blocks} blocks)"
        )


def gate_block_slice(weight: torch.Tensor, num_blocks: int, rows_per_block: int, cols: Optional[int] = None) -> torch.Tensor:
    """The first ``rows_per_block`` rows of every stacked block (and first ``cols`` columns).

    Differentiable: gradients of the result flow into ``weight`` at the sliced positions.
    """
    per_block = weight.shape[0] // num_blocks
    if rows_per_block == per_block and (cols is None or cols == weight.shape[1]):
        return weight  # the whole tensor: no view, see layers/leading.py
    blocks = weight.unflatten(0, (num_blocks, per_block))[:, :rows_per_block]
    if cols is not None:
        blocks = blocks[..., :cols]
    return blocks.reshape(num_blocks * rows_per_block, *blocks.shape[2:])


class ElasticEmbedding(nn.Embedding):
    """``nn.Embedding`` forwarding the first ``active_dim`` embedding dimensions.

    Every token keeps its row; only the embedding width is elastic. (The Shakespeare LSTM
    shares its embedding in full, so there ``active_dim`` stays None.)
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None):
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx)
        self.active_dim: Optional[int] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = self.active_dim or self.embedding_dim
        return F.embedding(x, leading(self.weight, self.num_embeddings, dim), self.padding_idx, self.max_norm,
                           self.norm_type, self.scale_grad_by_freq, self.sparse)

    def extract(self, embedding_dim: int) -> nn.Embedding:
        """A plain ``nn.Embedding`` holding a copy of the first ``embedding_dim`` columns."""
        layer = nn.Embedding(self.num_embeddings, embedding_dim, padding_idx=self.padding_idx,
                             device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(self.weight[:, :embedding_dim])
        return layer

    def regions(self, embedding_dim: int) -> dict:
        return {"weight": LeadingSlice(self.weight.shape, (self.num_embeddings, embedding_dim))}


class ElasticLSTM(nn.LSTM):
    """Multi-layer ``nn.LSTM`` whose hidden width is elastic, gate by gate.

    Holds the full weights under ``nn.LSTM``'s parameter names. With ``active_hidden = h``
    every layer keeps hidden units ``[0, h)`` of each of the four gates: rows
    ``[g*H, g*H + h)`` of ``weight_ih_l{k}``, ``weight_hh_l{k}`` and both biases for
    ``g = 0..3``, and the first ``h`` columns of ``weight_hh_l{k}`` (and of ``weight_ih_l{k}``
    for ``k > 0``). Layer 0's input width is read from the input. The sliced network is an
    ordinary ``nn.LSTM`` of hidden size ``h`` (:meth:`extract`), so sub-models are nested and
    keep the recurrent structure.

    Unidirectional, without projections (``proj_size``) and without packed sequences.
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0):
        super().__init__(input_size, hidden_size, num_layers=num_layers, bias=bias,
                         batch_first=batch_first, dropout=dropout)
        self.active_hidden: Optional[int] = None

    def _sliced_weights(self, input_size: int, hidden: int) -> list:
        """``nn.LSTM``'s flat weight list, sliced to an LSTM of width ``hidden``."""
        weights = []
        for layer in range(self.num_layers):
            in_ = input_size if layer == 0 else hidden
            weights.append(gate_block_slice(getattr(self, f"weight_ih_l{layer}"), LSTM_GATES, hidden, in_))
            weights.append(gate_block_slice(getattr(self, f"weight_hh_l{layer}"), LSTM_GATES, hidden, hidden))
            if self.bias:
                weights.append(gate_block_slice(getattr(self, f"bias_ih_l{layer}"), LSTM_GATES, hidden))
                weights.append(gate_block_slice(getattr(self, f"bias_hh_l{layer}"), LSTM_GATES, hidden))
        return weights

    def forward(self, x: torch.Tensor, hx: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError("ElasticLSTM expects a batched 3-D tensor (no packed sequences)")
        hidden = self.active_hidden or self.hidden_size
        input_size = x.shape[-1]
        if hidden == self.hidden_size and input_size == self.input_size:
            # the full network: nn.LSTM's own path keeps cuDNN's flattened weights
            return super().forward(x, hx)
        if input_size > self.input_size or hidden > self.hidden_size:
            raise ValueError(f"width ({input_size}, {hidden}) exceeds ({self.input_size}, {self.hidden_size})")
        if hx is None:
            batch = x.shape[0] if self.batch_first else x.shape[1]
            zeros = x.new_zeros(self.num_layers, batch, hidden)
            hx = (zeros, zeros)
        output, h_n, c_n = _VF.lstm(x, hx, self._sliced_weights(input_size, hidden), self.bias,
                                     self.num_layers, float(self.dropout), self.training, False,
                                     self.batch_first)
        return output, (h_n, c_n)

    def extract(self, hidden_size: int, input_size: Optional[int] = None) -> nn.LSTM:
        """A plain ``nn.LSTM`` of width ``hidden_size`` holding copies of the gate slices."""
        input_size = input_size or self.input_size
        ref = self.weight_ih_l0
        lstm = nn.LSTM(input_size, hidden_size, num_layers=self.num_layers, bias=self.bias,
                       batch_first=self.batch_first, dropout=self.dropout,
                       device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            for local, value in zip(lstm._flat_weights, self._sliced_weights(input_size, hidden_size)):
                local.copy_(value)
        return lstm

    def regions(self, hidden_size: int, input_size: Optional[int] = None) -> dict:
        """``nn.LSTM`` parameter name -> :class:`GateBlockSlice` of the full parameter."""
        input_size = input_size or self.input_size
        out = {}
        for layer in range(self.num_layers):
            in_ = input_size if layer == 0 else hidden_size
            shapes = {f"weight_ih_l{layer}": (LSTM_GATES * hidden_size, in_),
                      f"weight_hh_l{layer}": (LSTM_GATES * hidden_size, hidden_size)}
            if self.bias:
                shapes[f"bias_ih_l{layer}"] = (LSTM_GATES * hidden_size,)
                shapes[f"bias_hh_l{layer}"] = (LSTM_GATES * hidden_size,)
            for name, local_shape in shapes.items():
                out[name] = GateBlockSlice(getattr(self, name).shape, local_shape, LSTM_GATES)
        return out


class ElasticLayerNorm(nn.LayerNorm):
    """LayerNorm over the last dimension whose width is read from the input.

    Statistics are taken over the active features only, so the sliced layer is exactly an
    ``nn.LayerNorm`` of that width (as in slimmable and AutoFormer-style transformers).
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-6, elementwise_affine: bool = True, bias: bool = True):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias)
        if len(self.normalized_shape) != 1:
            raise ValueError("ElasticLayerNorm normalizes the last dimension only")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = x.shape[-1]
        weight = leading(self.weight, dim) if self.weight is not None else None
        bias = leading(self.bias, dim) if self.bias is not None else None
        return F.layer_norm(x, (dim,), weight, bias, self.eps)

    def extract(self, dim: int) -> nn.LayerNorm:
        ref = self.weight
        layer = nn.LayerNorm(dim, eps=self.eps, elementwise_affine=self.elementwise_affine,
                             bias=self.bias is not None,
                             device=None if ref is None else ref.device,
                             dtype=None if ref is None else ref.dtype)
        with torch.no_grad():
            if self.weight is not None:
                layer.weight.copy_(self.weight[:dim])
            if self.bias is not None:
                layer.bias.copy_(self.bias[:dim])
        return layer

    def regions(self, dim: int) -> dict:
        out = {}
        if self.weight is not None:
            out["weight"] = LeadingSlice(self.weight.shape, (dim,))
        if self.bias is not None:
            out["bias"] = LeadingSlice(self.bias.shape, (dim,))
        return out


class ElasticAttention(nn.Module):
    """Multi-head self-attention whose number of heads and token width are elastic.

    Heads are the unit of width (DynaBERT, AutoFormer, slimmable transformers): ``h`` active
    heads keep heads ``[0, h)`` at their full ``head_dim``, so each kept head computes exactly
    what it computes in the full model and the softmax scale ``head_dim ** -0.5`` is unchanged.
    The fused ``qkv`` weight stacks q, k and v, so it is sliced per block
    (:class:`GateBlockSlice` with 3 blocks); ``proj`` keeps its first ``h * head_dim`` input
    columns. The token width is read from the input; the output width is the ``out_features``
    argument, else ``active_out``, else full. Parameter names follow timm's ``Attention``.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: Optional[int] = None,
                 qkv_bias: bool = True, proj_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = head_dim or dim // num_heads
        if head_dim is None and dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        attn_dim = num_heads * self.head_dim
        self.qkv = ElasticLinear(dim, 3 * attn_dim, bias=qkv_bias)
        self.proj = ElasticLinear(attn_dim, dim, bias=proj_bias)
        self.attn_drop = attn_drop
        self.proj_drop = nn.Dropout(proj_drop)
        self.active_heads: Optional[int] = None
        self.active_out: Optional[int] = None

    def forward(self, x: torch.Tensor, out_features: Optional[int] = None) -> torch.Tensor:
        batch, tokens, width = x.shape
        heads = self.active_heads or self.num_heads
        out = out_features or self.active_out or self.dim
        rows = heads * self.head_dim
        weight = gate_block_slice(self.qkv.weight, QKV_BLOCKS, rows, width)
        bias = gate_block_slice(self.qkv.bias, QKV_BLOCKS, rows) if self.qkv.bias is not None else None
        qkv = F.linear(x, weight, bias).reshape(batch, tokens, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        attn = attn.transpose(1, 2).reshape(batch, tokens, rows)
        proj_bias = leading(self.proj.bias, out) if self.proj.bias is not None else None
        return self.proj_drop(F.linear(attn, leading(self.proj.weight, out, rows), proj_bias))

    def extract(self, dim: int, num_heads: int, dim_out: Optional[int] = None) -> Attention:
        """timm's ``Attention`` with ``num_heads`` heads of the full ``head_dim``, holding copies."""
        dim_out = dim_out or dim
        ref = self.qkv.weight
        attn = Attention(dim, num_heads=num_heads, attn_head_dim=self.head_dim, dim_out=dim_out,
                         qkv_bias=self.qkv.bias is not None, proj_bias=self.proj.bias is not None,
                         attn_drop=self.attn_drop, proj_drop=self.proj_drop.p,
                         device=ref.device, dtype=ref.dtype)
        rows = num_heads * self.head_dim
        with torch.no_grad():
            attn.qkv.weight.copy_(gate_block_slice(self.qkv.weight, QKV_BLOCKS, rows, dim))
            if self.qkv.bias is not None:
                attn.qkv.bias.copy_(gate_block_slice(self.qkv.bias, QKV_BLOCKS, rows))
            attn.proj.load_state_dict(self.proj.extract(rows, dim_out).state_dict())
        return attn

    def regions(self, dim: int, num_heads: int, dim_out: Optional[int] = None) -> dict:
        dim_out = dim_out or dim
        rows = num_heads * self.head_dim
        out = {"qkv.weight": GateBlockSlice(self.qkv.weight.shape, (3 * rows, dim), QKV_BLOCKS)}
        if self.qkv.bias is not None:
            out["qkv.bias"] = GateBlockSlice(self.qkv.bias.shape, (3 * rows,), QKV_BLOCKS)
        out.update(_prefixed("proj", self.proj.regions(rows, dim_out)))
        return out


class ElasticMlp(nn.Module):
    """Transformer MLP ``fc2(act(fc1(x)))`` whose hidden width is elastic.

    The input width is read from the input; the hidden width is ``active_hidden`` (None = full)
    and the output width the ``out_features`` argument, else ``active_out``, else full.
    Parameter names follow timm's ``Mlp``.
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: Optional[int] = None,
                 act_layer: type = nn.GELU, bias: bool = True, drop: float = 0.0):
        super().__init__()
        self.in_features = in_features
        self.hidden_features = hidden_features
        self.out_features = out_features or in_features
        self.act_layer = act_layer
        self.fc1 = ElasticLinear(in_features, hidden_features, bias=bias)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = ElasticLinear(hidden_features, self.out_features, bias=bias)
        self.drop2 = nn.Dropout(drop)

    @property
    def active_hidden(self) -> Optional[int]:
        return self.fc1.active_out

    @active_hidden.setter
    def active_hidden(self, value: Optional[int]) -> None:
        self.fc1.active_out = value

    @property
    def active_out(self) -> Optional[int]:
        return self.fc2.active_out

    @active_out.setter
    def active_out(self, value: Optional[int]) -> None:
        self.fc2.active_out = value

    def forward(self, x: torch.Tensor, out_features: Optional[int] = None) -> torch.Tensor:
        hidden = self.drop1(self.act(self.fc1(x)))
        out = out_features or self.fc2.active_out or self.out_features
        bias = leading(self.fc2.bias, out) if self.fc2.bias is not None else None
        return self.drop2(F.linear(hidden, leading(self.fc2.weight, out, hidden.shape[-1]), bias))

    def extract(self, in_features: int, hidden_features: int, out_features: Optional[int] = None) -> Mlp:
        """timm's ``Mlp`` of the given widths holding copies of the slices."""
        out_features = out_features or in_features
        ref = self.fc1.weight
        mlp = Mlp(in_features, hidden_features, out_features, act_layer=self.act_layer,
                  bias=(self.fc1.bias is not None, self.fc2.bias is not None),
                  drop=(self.drop1.p, self.drop2.p), device=ref.device, dtype=ref.dtype)
        mlp.fc1.load_state_dict(self.fc1.extract(in_features, hidden_features).state_dict())
        mlp.fc2.load_state_dict(self.fc2.extract(hidden_features, out_features).state_dict())
        return mlp

    def regions(self, in_features: int, hidden_features: int, out_features: Optional[int] = None) -> dict:
        out_features = out_features or in_features
        return {**_prefixed("fc1", self.fc1.regions(in_features, hidden_features)),
                **_prefixed("fc2", self.fc2.regions(hidden_features, out_features))}


class TransformerBlock(nn.Module):
    """A plain pre-norm transformer block, ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``.

    Built from timm's ``Attention`` and ``Mlp`` with timm ``Block``'s parameter names, but with
    the attention's ``head_dim`` free (timm's ``Block`` derives it from ``dim / num_heads``,
    which a head-sliced block does not satisfy). What :class:`ElasticTransformerBlock` extracts.
    """

    def __init__(self, norm1: nn.Module, attn: nn.Module, norm2: nn.Module, mlp: nn.Module):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ElasticTransformerBlock(nn.Module):
    """Pre-norm transformer block with elastic token width, heads and MLP width.

    Mirrors timm's ``Block`` (without layer scale and stochastic depth) and uses its parameter
    names, so a timm ``Block``'s state dict loads into it. The residual stream keeps the input's
    width: both branches are projected back to the width of ``x``.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 head_dim: Optional[int] = None, act_layer: type = nn.GELU, eps: float = 1e-6,
                 attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        self.dim = dim
        self.norm1 = ElasticLayerNorm(dim, eps=eps)
        self.attn = ElasticAttention(dim, num_heads, head_dim=head_dim, qkv_bias=qkv_bias,
                                     attn_drop=attn_drop, proj_drop=proj_drop)
        self.norm2 = ElasticLayerNorm(dim, eps=eps)
        self.mlp = ElasticMlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)

    def set_active(self, num_heads: Optional[int] = None, mlp_hidden: Optional[int] = None) -> None:
        """Active heads and MLP width (None = full); the token width follows the input."""
        self.attn.active_heads = num_heads
        self.mlp.active_hidden = mlp_hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]  # the residual stream keeps the input's width
        x = x + self.attn(self.norm1(x), out_features=width)
        return x + self.mlp(self.norm2(x), out_features=width)

    def extract(self, dim: int, num_heads: int, mlp_hidden: int) -> TransformerBlock:
        return TransformerBlock(self.norm1.extract(dim), self.attn.extract(dim, num_heads),
                                self.norm2.extract(dim), self.mlp.extract(dim, mlp_hidden))

    def regions(self, dim: int, num_heads: int, mlp_hidden: int) -> dict:
        return {**_prefixed("norm1", self.norm1.regions(dim)),
                **_prefixed("attn", self.attn.regions(dim, num_heads)),
                **_prefixed("norm2", self.norm2.regions(dim)),
                **_prefixed("mlp", self.mlp.regions(dim, mlp_hidden))}
