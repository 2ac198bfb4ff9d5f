"""A torchvision v2 training pipeline run on whole mini-batches, its random draws made per example.

torchvision's transforms accept a batch ``(B, C, H, W)`` but draw their parameters once per
call, so a whole batch would share one crop, one flip and one RandAugment op. Here the pipeline
is applied with each example's parameters drawn as torchvision draws them for one example, so
the augmented images have the per-example pipeline's distribution:

- ``RandAugment``: per example and op slot an op uniformly among torchvision's 14 and, for a
  signed op, a sign with probability 1/2; the examples that drew the same (op, sign) are
  gathered and transformed together (:class:`PerExampleRandAugment`);
- ``RandomCrop`` (constant padding): each example's window drawn uniformly, one gather for all;
- ``RandomHorizontalFlip``: each example flipped with probability ``p``;
- deterministic steps (``ToDtype``, ``Identity``) applied to the batch as they are, and
  ``Normalize`` in torchvision's arithmetic with its mean and std made once per device.

Nothing waits for the device: the draws are made on the host (from ``generator``; torch's
global generator when None, as the per-example pipeline draws) and cross to the device as small
index tensors in non-blocking copies, and no op waits for the device. torchvision's geometric
ops, sharpness, autocontrast and normalisation would (they build small tensors on the device
from Python lists, a blocking copy, or index with a mask), so those are done here: geometric
ops as a gather through a source-pixel map that torchvision's own op computes once on the host
(nearest interpolation moves pixels without changing them), the others in torchvision's
arithmetic with their constants made once per device. Each op equals torchvision's on every
image (``tests/test_batch_augment.py``).

:func:`batched_pipeline` returns None for a pipeline holding any other random step (the caller
then keeps the per-example path).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as nnf
from torchvision.transforms import v2
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as F
from torchvision.transforms.v2._utils import _get_fill

BatchStep = Callable[[torch.Tensor, Optional[torch.Generator]], torch.Tensor]

DETERMINISTIC = (v2.ToDtype, v2.Identity, v2.ToPureTensor)
"""Steps without randomness or device-made constants that act on a batch as on one image."""

GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
"""RandAugment's ops that move pixels (torchvision's affine and rotate)."""


def batched_pipeline(transform) -> Optional["BatchPipeline"]:
    """The batched form of ``transform`` (a v2 step or ``Compose``; None: no transform), or None
    when it holds a step that cannot be drawn per example here."""
    steps: List[BatchStep] = []
    for step in _flatten(transform):
        made = _batched_step(step)
        if made is None:
            return None
        steps.append(made)
    return BatchPipeline(steps)


class BatchPipeline:
    """``pipeline(images, generator)``: the steps in order on a uint8 batch ``(B, C, H, W)``."""

    def __init__(self, steps: Sequence[BatchStep]):
        self.steps = list(steps)

    def __call__(self, images: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        for step in self.steps:
            images = step(images, generator)
        return images


def _flatten(transform) -> list:
    if transform is None:
        return []
    if isinstance(transform, v2.Compose):
        return [s for t in transform.transforms for s in _flatten(t)]
    return [transform]


def _batched_step(step) -> Optional[BatchStep]:
    if type(step) is v2.Normalize:
        return BatchNormalize(step)
    if isinstance(step, DETERMINISTIC):
        return lambda images, generator: step(images)
    if type(step) is v2.RandAugment and InterpolationMode(step.interpolation) == InterpolationMode.NEAREST:
        return PerExampleRandAugment(step)
    if type(step) is v2.RandomCrop and step.padding_mode == "constant" and not step.pad_if_needed:
        return PerExampleCrop(step)
    if type(step) is v2.RandomHorizontalFlip:
        return PerExampleFlip(step.p)
    return None


def _to(device: torch.device, host: torch.Tensor) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device's queue."""
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def _fill_value(fill: dict) -> Optional[list]:
    """torchvision's fill for plain tensors: None (zeros) or one value per channel."""
    value = _get_fill(fill, torch.Tensor)
    return None if value is None else [float(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


class PerExampleRandAugment:
    """torchvision's ``RandAugment`` with each example's ops and signs drawn on their own.

    Per op slot the batch is sorted by (op, sign), geometric ops first: the geometric examples
    go through one gather with each one's source-pixel map, every other (op, sign) group through
    its op once; the results return to the examples' places with one ``index_select``.
    """

    def __init__(self, step: v2.RandAugment):
        self.step = step
        names = list(step._AUGMENTATION_SPACE)
        self.names = [n for n in names if n in GEOMETRIC] + [n for n in names if n not in GEOMETRIC]
        self.geometric = sum(n in GEOMETRIC for n in self.names)
        self.fill = _fill_value(step._fill)
        self._tables: Dict[tuple, tuple] = {}
        self._maps: Dict[tuple, tuple] = {}
        self._sharpen: Dict[tuple, torch.Tensor] = {}

    def _table(self, height: int, width: int) -> tuple:
        """(magnitude of each op, whether each op's sign is drawn) at this image size."""
        if (height, width) not in self._tables:
            step, magnitudes, signed = self.step, [], []
            for name in self.names:
                values, is_signed = step._AUGMENTATION_SPACE[name]
                values = values(step.num_magnitude_bins, height, width)
                magnitudes.append(0.0 if values is None else float(values[step.magnitude]))
                signed.append(is_signed and values is not None)
            self._tables[height, width] = magnitudes, torch.tensor(signed)
        return self._tables[height, width]

    def __call__(self, images: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
        step, count = self.step, len(images)
        height, width = images.shape[-2:]
        magnitudes, signed = self._table(height, width)
        ops = torch.randint(len(self.names), (step.num_ops, count), generator=generator)
        # torchvision negates a signed magnitude when rand() <= 0.5
        negative = (torch.rand((step.num_ops, count), generator=generator) <= 0.5) & signed[ops]
        keys, order = torch.sort(ops * 2 + negative.long(), dim=1, stable=True)
        sizes = torch.stack([torch.bincount(k, minlength=2 * len(self.names)) for k in keys]).tolist()  # host
        on_device = _to(images.device, torch.stack([order, keys, torch.argsort(order, dim=1)]))
        for slot in range(step.num_ops):
            order, keys, back = on_device[:, slot]
            gathered = images.index_select(0, order)
            moved = sum(sizes[slot][:2 * self.geometric])
            pieces = [self._move(gathered[:moved], keys[:moved], magnitudes)] if moved else []
            start = moved
            for key in range(2 * self.geometric, 2 * len(self.names)):
                size = sizes[slot][key]
                if size:
                    op, sign = divmod(key, 2)
                    magnitude = -magnitudes[op] if sign else magnitudes[op]
                    pieces.append(self._colour(gathered[start:start + size], self.names[op], magnitude))
                    start += size
            images = torch.cat(pieces).index_select(0, back)
        return images

    def _move(self, images: torch.Tensor, keys: torch.Tensor, magnitudes: List[float]) -> torch.Tensor:
        """Each image through the geometric op of its key: ``out[p] = image[map[key, p]]``, the
        last source position being the fill."""
        count, channels, height, width = images.shape
        maps, edge = self._source_maps(images, magnitudes)
        flat = torch.cat([images.reshape(count, channels, height * width), edge.expand(count, channels, 1)], dim=2)
        index = maps.index_select(0, keys)[:, None, :].expand(count, channels, height * width)
        return flat.gather(2, index).view(count, channels, height, width)

    def _source_maps(self, images: torch.Tensor, magnitudes: List[float]) -> tuple:
        """Per geometric (op, sign) key, the source position of every output pixel (``height *
        width`` where torchvision fills): torchvision's op on an image of pixel coordinates; and
        the fill pixel, ``(1, channels, 1)``. Made once per image shape and device."""
        _, channels, height, width = images.shape
        cache = (channels, height, width, images.dtype, images.device)
        if cache not in self._maps:
            rows, cols = torch.meshgrid(torch.arange(height, dtype=torch.float32),
                                        torch.arange(width, dtype=torch.float32), indexing="ij")
            coordinates = torch.stack([rows, cols, torch.ones_like(rows)])
            maps = []
            for key in range(2 * self.geometric):
                op, sign = divmod(key, 2)
                magnitude = -magnitudes[op] if sign else magnitudes[op]
                moved = self.step._apply_image_or_video_transform(coordinates, self.names[op], magnitude,
                                                                  interpolation=self.step.interpolation,
                                                                  fill={"others": None})
                source = moved[0].round().long() * width + moved[1].round().long()
                maps.append(torch.where(moved[2] > 0.5, source, height * width).reshape(-1))
            edge = torch.tensor(self.fill if self.fill is not None else [0.0], dtype=images.dtype)
            edge = edge.expand(channels).reshape(1, channels, 1)
            self._maps[cache] = _to(images.device, torch.stack(maps)), _to(images.device, edge.contiguous())
        return self._maps[cache]

    def _colour(self, images: torch.Tensor, name: str, magnitude: float) -> torch.Tensor:
        if name == "Sharpness":
            return self._sharpness(images, 1.0 + magnitude)
        if name == "AutoContrast":
            return autocontrast(images)
        return self.step._apply_image_or_video_transform(images, name, magnitude,
                                                         interpolation=self.step.interpolation, fill=self.step._fill)

    def _sharpness(self, images: torch.Tensor, factor: float) -> torch.Tensor:
        """torchvision's ``adjust_sharpness_image`` on uint8 images, its kernel made once per device."""
        channels = images.shape[1]
        if images.shape[-2] <= 2 or images.shape[-1] <= 2:
            return images
        key = (channels, images.device)
        if key not in self._sharpen:
            a, b = 1.0 / 13.0, 5.0 / 13.0
            kernel = torch.tensor([[a, a, a], [a, b, a], [a, a, a]], dtype=torch.float32)
            self._sharpen[key] = _to(images.device, kernel).expand(channels, 1, 3, 3)
        output = images.to(dtype=torch.float32, copy=True)
        blurred = nnf.conv2d(output, self._sharpen[key], groups=channels).round_()
        view = output[..., 1:-1, 1:-1]
        view.add_(blurred.sub_(view), alpha=(1.0 - factor))
        return output.clamp_(0, 255).to(images.dtype)


def autocontrast(images: torch.Tensor) -> torch.Tensor:
    """torchvision's ``autocontrast_image`` on uint8 images, its flat-channel case by
    ``torch.where`` rather than a masked assignment (which reads the mask back on a GPU)."""
    float_images = images.to(torch.float32)
    minimum = float_images.amin(dim=(-2, -1), keepdim=True)
    maximum = float_images.amax(dim=(-2, -1), keepdim=True)
    flat = maximum == minimum
    inv_scale = torch.where(flat, 1.0, maximum.sub_(minimum).mul_(1.0 / 255))
    minimum = torch.where(flat, 0.0, minimum)
    return float_images.sub_(minimum).div_(inv_scale).clamp_(0, 255).to(images.dtype)


class PerExampleCrop:
    """``RandomCrop`` with constant padding: the batch padded once, each example's window
    (uniform offsets, as torchvision draws them) taken in one gather."""

    def __init__(self, step: v2.RandomCrop):
        self.height, self.width = step.size
        left, right, top, bottom = step.padding if step.padding is not None else (0, 0, 0, 0)
        self.padding = [left, top, right, bottom]  # F.pad's order
        fill = _fill_value(step._fill)
        self.fill = 0 if fill is None else (fill[0] if len(fill) == 1 else fill)

    def __call__(self, images: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
        if any(self.padding):
            images = F.pad(images, padding=self.padding, fill=self.fill, padding_mode="constant")
        count, padded_h, padded_w = len(images), images.shape[-2], images.shape[-1]
        if padded_h < self.height or padded_w < self.width:
            raise ValueError(f"crop {(self.height, self.width)} is larger than the padded image {(padded_h, padded_w)}")
        # torchvision draws top, then left, each uniform over the valid offsets
        top = torch.randint(0, padded_h - self.height + 1, (count,), generator=generator)
        left = torch.randint(0, padded_w - self.width + 1, (count,), generator=generator)
        # the window's pixels as positions in each padded image, gathered at once
        start = _to(images.device, top * padded_w + left)
        window = (torch.arange(self.height, device=images.device)[:, None] * padded_w
                  + torch.arange(self.width, device=images.device)).reshape(1, 1, -1)
        channels = images.shape[1]
        index = (start.view(count, 1, 1) + window).expand(count, channels, self.height * self.width)
        flat = images.reshape(count, channels, padded_h * padded_w)
        return flat.gather(2, index).view(count, channels, self.height, self.width)


class PerExampleFlip:
    """``RandomHorizontalFlip(p)``: each example flipped when its ``rand() < p``."""

    def __init__(self, p: float):
        self.p = p

    def __call__(self, images: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
        flip = _to(images.device, torch.rand(len(images), generator=generator) < self.p)
        return torch.where(flip[:, None, None, None], images.flip(-1), images)


class BatchNormalize:
    """torchvision's ``normalize_image`` (``(x - mean) / std``), mean and std made once per
    device rather than from Python lists at every call."""

    def __init__(self, step: v2.Normalize):
        if not all(step.std):
            raise ValueError("std evaluated to zero, leading to division by zero.")
        self.mean, self.std = step.mean, step.std
        self._on: Dict[tuple, tuple] = {}

    def __call__(self, images: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        key = (images.dtype, images.device)
        if key not in self._on:
            self._on[key] = tuple(_to(images.device, torch.as_tensor(v, dtype=images.dtype).view(-1, 1, 1))
                                  for v in (self.mean, self.std))
        mean, std = self._on[key]
        return images.sub(mean).div_(std)
