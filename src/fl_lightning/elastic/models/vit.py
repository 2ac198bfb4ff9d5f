"""timm's VisionTransformer as an elastic model that split FL cuts at block boundaries.

FedSGA (Sec. 3.3) picks split depths from the backbone's block boundaries. A cut after ``k``
transformer blocks leaves the client with patch embedding, class and position embedding
(position dropout, patch dropout, pre-norm) and ``blocks[:k]``, and the server with
``blocks[k:]``, the final norm and timm's head (pool, fc norm, classifier).

The features of :meth:`ViT.forward_features` are the residual stream after the last block,
*before* timm's final norm, which :meth:`ViT.forward_head` applies. Every boundary, the last one
included, is then a cut of the same kind (an un-normalised token sequence), and
``forward(x)`` is exactly timm's ``VisionTransformer.forward(x)``.

The ViT is not width-elastic yet: its spec space holds the full model only
(``WidthSpec((1.0,))``), so ``max_spec() == min_spec()`` and ``extract`` builds a copy
(plain and elastic alike).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import nn
from timm.models.vision_transformer import VisionTransformer

from fl_lightning.elastic.models import register_model
from fl_lightning.elastic.models.base import ElasticModel
from fl_lightning.elastic.routing import RegionMap, full_region_map
from fl_lightning.elastic.specs import WidthSpec
from fl_lightning.errors import ConfigError

# timm's architectures by name (the suffix names the pretraining resolution; the image size
# here comes from ``input_shape``). Weights are never loaded.
VIT_VARIANTS = {
    "vit_tiny_patch16_224": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "vit_small_patch16_224": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "vit_small_patch32_224": dict(patch_size=32, embed_dim=384, depth=12, num_heads=6),
    "vit_base_patch16_224": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
    "vit_base_patch32_224": dict(patch_size=32, embed_dim=768, depth=12, num_heads=12),
    "vit_large_patch16_224": dict(patch_size=16, embed_dim=1024, depth=24, num_heads=16),
}

Cut = Union[int, str]


class ViTClient(nn.Module):
    """Client half of a cut ViT: embeddings and ``blocks[:k]``, sharing the model's parameters."""

    # timm's own token embedding, reading the attributes registered below
    _pos_embed = VisionTransformer._pos_embed

    def __init__(self, vit: VisionTransformer, k: int):
        super().__init__()
        self.patch_embed = vit.patch_embed
        self.cls_token = vit.cls_token
        self.reg_token = vit.reg_token
        self.pos_embed = vit.pos_embed
        self.pos_drop = vit.pos_drop
        self.patch_drop = vit.patch_drop
        self.norm_pre = vit.norm_pre
        self.blocks = nn.Sequential(*vit.blocks[:k])
        self.no_embed_class = vit.no_embed_class
        self.dynamic_img_size = vit.dynamic_img_size
        self.num_prefix_tokens = vit.num_prefix_tokens

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.embed(x))


class ViTServer(nn.Module):
    """Server half of a cut ViT: ``blocks[k:]``, final norm and head, sharing the parameters."""

    # timm's own pooling and head, reading the attributes registered below
    pool = VisionTransformer.pool
    forward_head = VisionTransformer.forward_head

    def __init__(self, vit: VisionTransformer, k: int):
        super().__init__()
        self.blocks = nn.Sequential(*vit.blocks[k:])
        self.norm = vit.norm
        self.attn_pool = vit.attn_pool
        self.fc_norm = vit.fc_norm
        self.head_drop = vit.head_drop
        self.head = vit.head
        self.global_pool = vit.global_pool
        self.num_prefix_tokens = vit.num_prefix_tokens
        self.pool_include_prefix = vit.pool_include_prefix

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.norm(self.blocks(h)))


@register_model("vit")
class ViT(ElasticModel):
    """A timm ``VisionTransformer`` (never pretrained) with named block boundaries.

    Args:
        num_classes: classifier outputs.
        input_shape: (channels, height, width) of one input; height and width must be
            multiples of the patch size.
        variant: a timm architecture name from ``VIT_VARIANTS`` (e.g. ``vit_base_patch16_224``,
            FedSGA's ViT-B/16); it sets patch size, width, depth and heads, overriding the
            four options below. None builds the small model those options describe.
        patch_size: patch side in pixels.
        embed_dim: token width.
        depth: transformer blocks, the candidate split points.
        num_heads: attention heads per block.
        mlp_ratio: MLP hidden width over token width.
        drop_path_rate: stochastic depth rate of the last block (timm's linear schedule).
        global_pool: timm's pooling before the classifier ("token" = class token, "avg").
    """

    spec_type = WidthSpec

    def __init__(self, num_classes: int, input_shape: Sequence[int], variant: Optional[str] = None,
                 patch_size: int = 4, embed_dim: int = 64, depth: int = 4, num_heads: int = 4,
                 mlp_ratio: float = 4.0, drop_path_rate: float = 0.0, global_pool: str = "token"):
        if variant is not None:
            if variant not in VIT_VARIANTS:
                raise ConfigError("model.kwargs.variant",
                                  f"unknown ViT {variant!r}; known: {', '.join(VIT_VARIANTS)}")
            arch = VIT_VARIANTS[variant]
            patch_size, embed_dim, depth, num_heads = (
                arch["patch_size"], arch["embed_dim"], arch["depth"], arch["num_heads"])
        input_shape = tuple(input_shape)
        if len(input_shape) != 3 or any(side % patch_size for side in input_shape[1:]):
            raise ConfigError("model.input_shape",
                              f"needs (channels, height, width) with sides divisible by patch size "
                              f"{patch_size}, got {input_shape}")
        if depth < 1:
            raise ConfigError("model.kwargs.depth", f"must be at least 1, got {depth}")
        config = dict(num_classes=num_classes, input_shape=input_shape, variant=variant,
                      patch_size=patch_size, embed_dim=embed_dim, depth=depth, num_heads=num_heads,
                      mlp_ratio=mlp_ratio, drop_path_rate=drop_path_rate, global_pool=global_pool)
        super().__init__(**config)
        self.config = config  # rebuilds the same architecture in ``build_local``
        self.num_classes = num_classes
        self.input_shape = input_shape
        self.embed_dim = embed_dim
        self.depth = depth
        self.vit = VisionTransformer(
            img_size=input_shape[1:], patch_size=patch_size, in_chans=input_shape[0],
            num_classes=num_classes, global_pool=global_pool, embed_dim=embed_dim, depth=depth,
            num_heads=num_heads, mlp_ratio=mlp_ratio, drop_path_rate=drop_path_rate,
        )

    # -- specs ------------------------------------------------------------------------------
    def max_spec(self) -> WidthSpec:
        return WidthSpec.uniform(1.0, 1)

    def min_spec(self) -> WidthSpec:
        return WidthSpec.uniform(1.0, 1)

    def _check_spec(self, spec: WidthSpec) -> None:
        if spec != self.max_spec():
            raise ValueError(f"the ViT runs at full width only ({self.max_spec()}), got {spec!r}")

    def set_active(self, spec: WidthSpec) -> None:
        self._check_spec(spec)
        self.active_spec = spec

    # -- forward pieces ---------------------------------------------------------------------
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Image -> token sequence entering block 0 (class + patch tokens, position-embedded).

        Prompt tokens (FedSGA) can be concatenated to this output before :meth:`forward_blocks`.
        """
        vit = self.vit
        return vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(x))))

    def forward_blocks(self, h: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Tokens through ``blocks[start:stop]``."""
        for block in self.vit.blocks[start:stop]:
            h = block(h)
        return h

    def _embed_and_first_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.vit.blocks[0](self.embed(x))

    def blocks(self):
        blocks = OrderedDict(block0=self._embed_and_first_block)
        for i in range(1, self.depth):
            blocks[f"block{i}"] = self.vit.blocks[i]
        return blocks

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        """Final norm, then timm's head (pool, fc norm, dropout, classifier)."""
        return self.vit.forward_head(self.vit.norm(features))

    def num_client_blocks(self, cut: Cut) -> int:
        """Blocks on the client side of ``cut``: a count ``k`` in ``[0, depth]``, or a block name
        (``"block{k-1}"``, the last client block, as in :meth:`ElasticModel.forward_until`)."""
        if isinstance(cut, str):
            return self._block_index(cut) + 1
        if not 0 <= int(cut) <= self.depth:
            raise ValueError(f"a cut of the ViT lies in [0, {self.depth}], got {cut}")
        return int(cut)

    def forward_until(self, x: torch.Tensor, cut: Cut) -> torch.Tensor:
        """Embed ``x`` and run the client's blocks (``k`` blocks, or up to and including a name)."""
        return self.forward_blocks(self.embed(x), 0, self.num_client_blocks(cut))

    def forward_from(self, h: torch.Tensor, cut: Cut) -> torch.Tensor:
        """Continue from the tokens at ``cut`` through the remaining blocks and the head."""
        return self.forward_head(self.forward_blocks(h, self.num_client_blocks(cut), self.depth))

    def split(self, cut: Cut) -> Tuple[ViTClient, ViTServer]:
        """Client and server modules for ``cut``, sharing (not copying) this model's parameters."""
        k = self.num_client_blocks(cut)
        return ViTClient(self.vit, k), ViTServer(self.vit, k)

    # -- routing ----------------------------------------------------------------------------
    def regions(self, spec: WidthSpec, kind: str = "leading", offset: int = 0) -> RegionMap:
        # the full model is the same set of positions for leading and rolling regions
        if kind not in ("leading", "rolling"):
            raise ValueError(f"unknown region kind {kind!r}")
        self._check_spec(spec)
        return full_region_map(self.state_dict())

    def build_local(self, spec: WidthSpec, elastic: bool) -> "ViT":
        self._check_spec(spec)
        return ViT(**self.config)
