"""The batched training augmentation (``data/batch_augment.py``) against torchvision's own,
per example: each op's result on every image, the crop windows and flips it draws, and the
distribution of whole augmented batches against the per-example pipeline's."""

from __future__ import annotations

import math

import pytest
import torch
from torchvision.transforms import v2

from fl_lightning.data.base import ArrayDataset
from fl_lightning.data.batch_augment import (GEOMETRIC, PerExampleCrop, PerExampleFlip, PerExampleRandAugment,
                                             batched_pipeline)
from fl_lightning.data.datasets import CIFAR100_STATS, image_transforms
from fl_lightning.data.federated import with_randaugment


def _images(count: int, seed: int = 0) -> torch.Tensor:
    images = torch.randint(0, 256, (count, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    if count >= 3:
        images[1] = 77  # a flat image: autocontrast's and equalize's special case
        images[2, 0] = 0  # one flat channel
    return images


@pytest.mark.parametrize("fill", [None, [10, 200, 30]])
def test_every_op_and_sign_equals_torchvision_on_every_image(fill):
    """Per (op, sign) the batched op (geometric ones through their source-pixel maps) gives
    torchvision's per-image result exactly, fill included."""
    step = v2.RandAugment(num_ops=2, magnitude=9, fill=fill)
    augment = PerExampleRandAugment(step)
    images = _images(12)
    magnitudes, signed = augment._table(32, 32)
    seen = set()
    for op, name in enumerate(augment.names):
        for sign in ((0, 1) if signed[op] else (0,)):
            magnitude = -magnitudes[op] if sign else magnitudes[op]
            expected = torch.stack([step._apply_image_or_video_transform(
                x, name, magnitude, interpolation=step.interpolation, fill=step._fill) for x in images])
            if name in GEOMETRIC:
                got = augment._move(images, torch.full((len(images),), 2 * op + sign), magnitudes)
            else:
                got = augment._colour(images, name, magnitude)
            assert torch.equal(got, expected), (name, sign)
            seen.add(name)
    assert seen == set(step._AUGMENTATION_SPACE)  # all 14


def _windows(padded: torch.Tensor, size: int) -> dict:
    """Every crop of ``padded`` and its mirror image, by its bytes: (top, left, flipped)
    (unique for random pixels)."""
    out = {}
    for top in range(padded.shape[-2] - size + 1):
        for left in range(padded.shape[-1] - size + 1):
            window = padded[:, top:top + size, left:left + size]
            for flipped, candidate in ((False, window), (True, window.flip(-1))):
                out[candidate.contiguous().numpy().tobytes()] = (top, left, flipped)
    return out


def test_crop_windows_are_uniform_and_flips_have_their_rate():
    """4,000 crops of one image: each of the 9 x 9 offsets of RandomCrop(32, padding=4) about
    equally often (chi-square with 80 degrees of freedom below its 1e-4 quantile, 132; an
    offset range one short leaves cells empty and fails), and flips at rate p = 0.3 within 4
    standard errors (0.029; the complement 0.7 fails)."""
    crop, flip = PerExampleCrop(v2.RandomCrop(32, padding=4)), PerExampleFlip(0.3)
    image = _images(1, seed=3)[0]
    padded = torch.nn.functional.pad(image, (4, 4, 4, 4))
    draws = 4000
    generator = torch.Generator().manual_seed(11)
    out = flip(crop(image.expand(draws, -1, -1, -1), generator), generator)
    windows = _windows(padded, 32)
    counts = torch.zeros(9, 9)
    flips = 0
    for x in out:
        top, left, flipped = windows[x.numpy().tobytes()]  # a KeyError: not a window of the padded image
        counts[top, left] += 1
        flips += flipped
    expected = draws / 81
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 132 and counts.min() > 0, chi_square
    assert abs(flips / draws - 0.3) < 4 * math.sqrt(0.3 * 0.7 / draws)


def _feast_transform(magnitude: int = 6, flip: bool = True, padding: int = 4):
    train, _ = image_transforms(CIFAR100_STATS, crop=32, padding=padding, flip=flip)
    store = ArrayDataset(torch.zeros(1, 3, 32, 32, dtype=torch.uint8), torch.zeros(1, dtype=torch.long), train)
    return with_randaugment(store, 2, magnitude).transform


def _ramps() -> torch.Tensor:
    rows, cols = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    return torch.stack([torch.stack([cols * 8, rows * 4 + 60, 255 - cols * 6]),
                        torch.stack([rows * 8, 200 - cols * 5, (rows + cols) * 4])]).clamp(0, 255).to(torch.uint8)


def _largest_z(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """Largest |z| over pixels of the difference of per-pixel means and of variances between two
    samples of ``n`` draws (standard errors from the samples: var / n for a mean, (m4 - var^2) / n
    for a variance)."""
    n = len(a)

    def moments(x):
        mean, var = x.mean(0), x.var(0)
        return mean, var, ((x - mean) ** 4).mean(0)

    (ma, va, ka), (mb, vb, kb) = moments(a.double()), moments(b.double())
    z_mean = (ma - mb) / ((va + vb) / n).clamp_min(1e-12).sqrt()
    z_var = (va - vb) / ((ka - va ** 2 + kb - vb ** 2) / n).clamp_min(1e-12).sqrt()
    return float(z_mean.abs().max()), float(z_var.abs().max())


Z_LIMIT = 5.4
"""Both paths draw from one distribution: each of the 2 x 2 x 3,072 per-pixel z statistics
exceeds 5.4 with probability 6.7e-8, so all of them stay below it but with probability 8e-4."""


def test_batched_pipeline_draws_the_per_example_pipelines_distribution():
    """1,500 draws of FEAST's CIFAR-100 pipeline on two ramp images, per example as the host
    path applies it and batched: per-pixel means and variances agree within sampling error,
    while the same batched pipeline with a neighbouring setting (RandAugment magnitude 9 or 4,
    no flip, padding 3) is told apart."""
    draws, images = 1500, _ramps()
    host_transform = _feast_transform()
    torch.manual_seed(1)
    host = torch.stack([torch.stack([host_transform(x) for _ in range(draws)]) for x in images], 1)

    def batched(transform, seed):
        pipeline = batched_pipeline(transform)
        torch.manual_seed(seed)
        return torch.stack([pipeline(x.expand(draws, -1, -1, -1).contiguous()) for x in images], 1)

    assert max(_largest_z(host, batched(host_transform, 2))) < Z_LIMIT
    for neighbour in ({"magnitude": 9}, {"magnitude": 4}, {"flip": False}, {"padding": 3}):
        assert max(_largest_z(host, batched(_feast_transform(**neighbour), 3))) > Z_LIMIT, neighbour


def test_a_pipeline_with_a_step_it_cannot_draw_per_example_has_no_batched_form():
    assert batched_pipeline(v2.Compose([v2.RandomResizedCrop(32), v2.ToDtype(torch.float32, scale=True)])) is None
    assert batched_pipeline(v2.RandAugment(interpolation=v2.InterpolationMode.BILINEAR)) is None
    assert batched_pipeline(v2.RandomCrop(32, padding=4, padding_mode="reflect")) is None
    images = _images(3)
    assert torch.equal(batched_pipeline(None)(images), images)


def test_normalize_is_torchvisions_arithmetic():
    images = _images(5).float() / 255
    step = v2.Normalize(list(CIFAR100_STATS[0]), list(CIFAR100_STATS[1]))
    assert torch.equal(batched_pipeline(step)(images), step(images))
