"""The data path (``runtime/client_data.py``, ``runtime/evaluation.py``, ``runtime/calibration.py``):
batches made on the device carry the host path's examples in the host path's order, keyed by
(seed, round, client); ``augment_on`` chooses and refuses; evaluation splits are transformed once
and served from what was kept; BN recalibration gives ``momentum=None``'s statistics without
reading a device value per layer and batch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fl_lightning.data.base import ArrayDataset
from fl_lightning.data.datasets import CIFAR100_STATS, image_transforms
from fl_lightning.data.federated import with_randaugment
from fl_lightning.elastic.bn import recalibrate_bn
from fl_lightning.elastic.layers.norm import ElasticBatchNorm2d
from fl_lightning.errors import ConfigError
from fl_lightning.runtime import evaluation
from fl_lightning.runtime.calibration import recalibrate_without_waiting
from fl_lightning.runtime.client_data import (ClientData, DeviceBatches, HostBatches, eval_batches,
                                              training_batches)
from fl_lightning.runtime.seeding import client_generator, seed_client

CPU = torch.device("cpu")


def _cifar_like(count: int = 40, randaugment: bool = True) -> ArrayDataset:
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (count, 3, 32, 32), dtype=torch.uint8, generator=generator)
    train, _ = image_transforms(CIFAR100_STATS, crop=32, padding=4, flip=True)
    dataset = ArrayDataset(images, torch.arange(count) % 7, train)
    return with_randaugment(dataset, 2, 6) if randaugment else dataset


def _epoch(data: ClientData, seed: int, round_idx: int, client: int) -> list:
    seed_client(seed, round_idx, client)
    return list(data.epoch(client_generator(seed, round_idx, client)))


def test_device_batches_hold_the_host_batches_examples_keyed_by_seed_round_and_client():
    """Same examples in the same order as the host path (the targets, and the un-augmented
    images through a transform without randomness); the augmentation a function of (seed,
    round, client) only; another client's draws differ."""
    dataset = _cifar_like()
    shard = torch.tensor([3, 17, 5, 30, 8, 21, 11, 2, 39, 26, 14])
    host = ClientData(dataset, shard, 4, CPU, source=HostBatches(dataset, CPU))
    device = ClientData(dataset, shard, 4, CPU, source=training_batches(dataset, CPU, "device"))
    assert isinstance(device.source, DeviceBatches)
    host_batches, device_batches = _epoch(host, 5, 2, 7), _epoch(device, 5, 2, 7)
    assert [y.tolist() for _, y in host_batches] == [y.tolist() for _, y in device_batches]
    assert [len(y) for _, y in device_batches] == [4, 4, 3]
    again = _epoch(device, 5, 2, 7)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(device_batches, again))
    other = _epoch(device, 5, 2, 8)
    assert not torch.equal(other[0][0], device_batches[0][0])
    plain = dataset.with_transform(image_transforms(CIFAR100_STATS)[1])  # scaling and normalisation only
    unaugmented = [ClientData(plain, shard, 4, CPU, source=s) for s in (HostBatches(plain, CPU),
                                                                          training_batches(plain, CPU, "device"))]
    for (a, _), (b, _) in zip(_epoch(unaugmented[0], 5, 2, 7), _epoch(unaugmented[1], 5, 2, 7)):
        assert torch.equal(a, b)


def test_augment_on_auto_keeps_the_host_path_on_a_cpu_and_device_refuses_what_it_cannot_batch():
    dataset = _cifar_like()
    assert isinstance(training_batches(dataset, CPU, "auto"), HostBatches)
    assert isinstance(training_batches(dataset, CPU, "host"), HostBatches)
    blurred = dataset.with_transform(nn.Sequential())  # not a torchvision step it can draw per example
    with pytest.raises(ConfigError, match="^data.augment_on: device, but its transform has a step without"):
        training_batches(blurred, CPU, "device")
    assert isinstance(training_batches(blurred, CPU, "auto"), HostBatches)


def test_an_evaluation_split_is_transformed_once_and_served_as_eval_batches_would():
    """The first pass keeps the transformed split; every pass yields eval_batches' tensors, in
    its batches; a second pass applies no transform."""
    dataset = _cifar_like(30, randaugment=False).with_transform(image_transforms(CIFAR100_STATS)[1])
    calls = []
    transform = dataset.transform
    dataset.transform = lambda x: calls.append(1) or transform(x)
    indices = torch.tensor([4, 9, 1, 22, 13, 7, 28])
    expected = list(eval_batches(dataset, indices, 3, CPU))
    calls.clear()
    first = list(evaluation.split_batches(dataset, indices, 3, CPU))
    assert len(calls) == len(indices)
    second = list(evaluation.split_batches(dataset, indices, 3, CPU))
    assert len(calls) == len(indices), "the kept split is not transformed again"
    for batches in (first, second):
        assert [len(y) for _, y in batches] == [3, 3, 1]
        assert all(torch.equal(a, b) and torch.equal(ya, yb) for (a, ya), (b, yb) in zip(expected, batches))
    assert list(evaluation.split_batches(dataset, indices[:2], 3, CPU))[0][1].tolist() == [4 % 7, 9 % 7]


def _batches() -> list:
    generator = torch.Generator().manual_seed(3)
    sizes = (9, 9, 4)  # a short last batch: momentum=None weighs batches, not examples
    return [torch.randn(n, 3, 8, 8, generator=generator) * 2 + 1 for n in sizes]


def _model() -> nn.Module:
    torch.manual_seed(0)
    wide = ElasticBatchNorm2d(8)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 6, 1), wide)
    return model  # the elastic norm sees 6 of its 8 channels: a partial width


def test_recalibration_is_the_plain_average_of_batch_statistics_without_reading_the_batch_count(monkeypatch):
    """Running statistics are the mean over batches of each batch's mean and unbiased variance
    (float64 reference), bit for bit those of ``recalibrate_bn``'s ``momentum=None``, and no
    tensor is read on the host meanwhile (``momentum=None`` reads ``num_batches_tracked`` once
    per layer and batch: 6 reads here)."""
    batches = _batches()
    reference, ours = _model(), _model()
    recalibrate_bn(reference, batches)
    reads = []
    original = torch.Tensor.__float__
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: reads.append(1) or original(t))
    recalibrate_without_waiting(ours, batches)
    assert reads == []
    recalibrate_bn(copy.deepcopy(reference), batches)
    assert len(reads) == 2 * len(batches)  # momentum=None reads the count: 2 layers x 3 batches
    monkeypatch.undo()
    for (key, a), (_, b) in zip(reference.state_dict().items(), ours.state_dict().items()):
        assert torch.equal(a, b), key
    with torch.no_grad():
        inputs = [ours[0](x).double() for x in batches]
    means = torch.stack([x.mean((0, 2, 3)) for x in inputs]).mean(0)
    variances = torch.stack([x.var((0, 2, 3), unbiased=True) for x in inputs]).mean(0)
    assert torch.allclose(ours[1].running_mean.double(), means, rtol=1e-5, atol=1e-6)
    assert torch.allclose(ours[1].running_var.double(), variances, rtol=1e-5, atol=1e-6)
    assert ours[1].momentum == 0.1 and ours[4].momentum == 0.1  # restored
