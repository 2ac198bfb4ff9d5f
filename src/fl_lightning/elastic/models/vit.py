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

FedSGA's prompt tokens (VPT-shallow) enter at the client: ``ViTClient(x, prompt_tokens)``
inserts ``m`` learned tokens right after the class token, before the client's first block, and
every later block and the server half run on ``1 + m + n`` tokens. The server's "token" pooling
reads the class token at index 0, unaffected; "avg" pooling averages every token after the class
token, the prompts included (timm's pooling knows only the class and register tokens as a
prefix).

``pretrained`` loads a timm ``VisionTransformer`` checkpoint from a local file
(:meth:`ViT.load_timm`); nothing is downloaded.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from timm.models.vision_transformer import VisionTransformer, _load_weights, checkpoint_filter_fn

from fl_lightning.elastic.models.base import ElasticModel
from fl_lightning.elastic.pretrained import KEY as PRETRAINED_KEY
from fl_lightning.elastic.pretrained import copy_matching, read_state_dict, shape_text, warn_skipped
from fl_lightning.elastic.routing import RegionMap, full_region_map
from fl_lightning.elastic.specs import WidthSpec
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import PositiveInt, WidthMultiplier, number_type

# timm's architectures by name (the suffix names the pretraining resolution; the image size
# here comes from ``input_shape``). Weights are never downloaded (see ``pretrained``).
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

    def __init__(self, vit: VisionTransformer, k: int, image_size: Optional[int] = None):
        super().__init__()
        self.image_size = image_size
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
        x = resize_input(x, self.image_size)
        return self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))

    def forward(self, x: torch.Tensor, prompt_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tokens after the client's blocks; ``prompt_tokens`` (``(B or 1, m, D)``) are inserted
        after the class token first (:func:`insert_prompts`)."""
        h = self.embed(x)
        if prompt_tokens is not None:
            h = insert_prompts(h, prompt_tokens, self.num_prefix_tokens)
        return self.blocks(h)


def resize_input(x: torch.Tensor, size: Optional[int]) -> torch.Tensor:
    """Images bilinearly resized to ``size`` squared (None: unchanged), as ViT-B/16 on 32x32
    CIFAR images is usually run at its native 224."""
    if size is None or tuple(x.shape[-2:]) == (size, size):
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)


def insert_prompts(tokens: torch.Tensor, prompts: torch.Tensor, num_prefix_tokens: int = 1) -> torch.Tensor:
    """``tokens`` (B, 1 + n, D) with ``prompts`` (B or 1, m, D) inserted after the prefix tokens.

    VPT-shallow (Jia et al., 2022), as FedSGA's prompt tokens: the prompts join the embedded
    sequence (after position embedding, dropout and timm's pre-norm, none of which they get:
    they are free vectors in the space block 0 reads) right after the class token (and timm's
    register tokens, if any), so index 0 stays the class token the "token" head reads. One set
    of prompts (batch 1) is shared by every sample.
    """
    if prompts.dim() != 3 or prompts.shape[0] not in (1, tokens.shape[0]) or prompts.shape[2] != tokens.shape[2]:
        raise ValueError(f"prompt tokens need shape (B or 1, m, {tokens.shape[2]}) for tokens of shape "
                         f"{tuple(tokens.shape)}, got {tuple(prompts.shape)}")
    prompts = prompts.to(tokens.dtype).expand(tokens.shape[0], -1, -1)
    return torch.cat([tokens[:, :num_prefix_tokens], prompts, tokens[:, num_prefix_tokens:]], dim=1)


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
        """Logits from the tokens at the cut, of any length (prompt tokens included)."""
        return self.forward_head(self.norm(self.blocks(h)))


class ViT(ElasticModel):
    """A timm ``VisionTransformer`` with named block boundaries.

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
        image_size: resize inputs to this side (bilinear) before the patch embedding, on the
            client side of any cut (ViT-B/16 at 224 on 32x32 images); None keeps the input size.
        pretrained: path of a local timm ``VisionTransformer`` checkpoint of the same
            architecture to start from (never downloaded): a ``torch.save``d state dict (or one
            under "state_dict"/"model"), or a JAX ``.npz``. The position embedding is resized
            to this model's patch grid and a classifier of another class count is skipped
            (:meth:`load_timm`). A local copy (``build_local``) does not reload it: its weights
            come from the global model by routing.
    """

    spec_type = WidthSpec

    @classmethod
    def check_options(cls, variant: Optional[str] = None, embed_dim: int = 64, num_heads: int = 4, **_) -> None:
        """Rules between options, checked before anything is built: the heads split the width."""
        if variant is None and embed_dim % num_heads:
            raise ConfigError("model.num_heads", f"must divide embed_dim ({embed_dim}) into equal heads, "
                                                        f"got {num_heads}")

    def __init__(self, num_classes: int, input_shape: Sequence[int], variant: Optional[str] = None,
                 patch_size: PositiveInt = 4, embed_dim: PositiveInt = 64, depth: PositiveInt = 4,
                 num_heads: PositiveInt = 4, mlp_ratio: WidthMultiplier = 4.0,
                 drop_path_rate: number_type(float, ge=0, lt=1) = 0.0, global_pool: str = "token",
                 image_size: Optional[PositiveInt] = None, pretrained: Optional[str] = None):
        if variant is not None:
            if variant not in VIT_VARIANTS:
                raise ConfigError("model.variant",
                                  f"unknown ViT {variant!r}; known: {', '.join(VIT_VARIANTS)}")
            arch = VIT_VARIANTS[variant]
            patch_size, embed_dim, depth, num_heads = (
                arch["patch_size"], arch["embed_dim"], arch["depth"], arch["num_heads"])
        input_shape = tuple(input_shape)
        if image_size is not None and image_size < patch_size:
            raise ConfigError("model.image_size", f"must be >= the patch size {patch_size}, got {image_size}")
        grid = tuple(input_shape[1:]) if image_size is None else (image_size, image_size)
        if len(input_shape) != 3:
            raise ConfigError("data.dataset", f"a ViT takes images (channels, height, width), got inputs of shape "
                                              f"{list(input_shape)}")
        if any(side % patch_size for side in grid):  # the dataset's sides, or image_size
            key = "model.variant" if variant is not None else "model.patch_size"
            if image_size is not None:
                raise ConfigError(key, f"patch size {patch_size} must divide model.image_size {image_size}")
            raise ConfigError(key, f"patch size {patch_size} must divide the images' sides {list(grid)}; choose a "
                                   "divisor of them, or set model.image_size to a multiple of it")
        config = dict(num_classes=num_classes, input_shape=input_shape, variant=variant,
                      patch_size=patch_size, embed_dim=embed_dim, depth=depth, num_heads=num_heads,
                      mlp_ratio=mlp_ratio, drop_path_rate=drop_path_rate, global_pool=global_pool,
                      image_size=image_size)
        super().__init__(**config)
        self.config = config  # rebuilds the same architecture in ``build_local``
        self.num_classes = num_classes
        self.input_shape = input_shape
        self.embed_dim = embed_dim
        self.depth = depth
        self.image_size = image_size
        self.vit = VisionTransformer(
            img_size=grid, patch_size=patch_size, in_chans=input_shape[0],
            num_classes=num_classes, global_pool=global_pool, embed_dim=embed_dim, depth=depth,
            num_heads=num_heads, mlp_ratio=mlp_ratio, drop_path_rate=drop_path_rate,
        )
        if pretrained is not None:
            self.load_timm(pretrained)

    def load_timm(self, path: str) -> None:
        """Load the timm checkpoint at ``path`` into ``self.vit``.

        A state dict goes through timm's own ``checkpoint_filter_fn``, which resamples the
        position embedding to this model's patch grid (and the patch embedding to its patch
        size); a ``.npz`` goes through timm's ``_load_weights``, which does the same. The
        classifier (``head.*``) is skipped, with a warning, when its shape differs (another
        class count); any other difference (width, depth, pooling) means another architecture
        and is a ConfigError naming the tensors.
        """
        if str(path).endswith(".npz"):
            self._load_npz(path)
            return
        state = read_state_dict(path)
        try:
            state = checkpoint_filter_fn(state, self.vit)
        except (AttributeError, KeyError, RuntimeError, ValueError) as error:  # a layout timm cannot convert
            raise ConfigError(PRETRAINED_KEY, f"{path} is not a timm ViT checkpoint ({type(error).__name__}: "
                                              f"{' '.join(str(error).split())[:160]})") from None
        own = self.vit.state_dict()
        misfits = [k for k, v in state.items() if k in own and v.shape != own[k].shape]
        head_misfits = [k for k in misfits if k.startswith("head.")]
        problems = ([f"{k} only in the file" for k in state if k not in own]
                    + [f"{k} not in the file" for k in own if k not in state and not k.startswith("head.")]
                    + [f"{k} {shape_text(state[k])} in the file, {shape_text(own[k])} here"
                       for k in misfits if k not in head_misfits])
        if problems:  # checked before anything is copied
            raise ConfigError(PRETRAINED_KEY, f"{path} is not a checkpoint of this ViT: {len(problems)} "
                                              f"differences, e.g. {'; '.join(problems[:3])}")
        outcome = copy_matching(own, {k: v for k, v in state.items() if k not in head_misfits})
        outcome["mismatched"] = [f"{k} {shape_text(state[k])} vs {shape_text(own[k])}" for k in head_misfits]
        outcome["missing"] = [k for k in outcome["missing"] if k not in head_misfits]  # a headless checkpoint
        warn_skipped(path, outcome, kinds=("mismatched", "missing"))

    def _load_npz(self, path: str) -> None:
        if not Path(path).is_file():
            raise ConfigError(PRETRAINED_KEY, f"no such file: {path}")
        try:
            _load_weights(self.vit, str(path))
        except (KeyError, ValueError, OSError) as error:
            raise ConfigError(PRETRAINED_KEY, f"{path} is not a timm ViT .npz checkpoint of this architecture "
                                              f"({type(error).__name__}: {' '.join(str(error).split())[:160]})") from None

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

        Prompt tokens (FedSGA) join this output (:func:`insert_prompts`) before
        :meth:`forward_blocks`, as :class:`ViTClient` does with its ``prompt_tokens``.
        """
        vit = self.vit
        x = resize_input(x, self.image_size)
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
        """Client and server modules for ``cut`` (a block name, as :meth:`ElasticModel.split`, or a
        count of client blocks), sharing (not copying) this model's parameters:
        ``client(x) == forward_until(x, cut)`` and ``server(h) == forward_from(h, cut)``."""
        k = self.num_client_blocks(cut)
        return ViTClient(self.vit, k, self.image_size), ViTServer(self.vit, k)

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
