"""Main-process CPU per training example of the two data paths (``data.augment_on``), in one run.

    python benchmarks/data_path.py [--examples N] [--batch-size B] [--device cpu|cuda]

The FEAST CIFAR-100 pipeline (``configs/feast_cifar100.yaml``: RandAugment(2, 6), then
``RandomCrop(32, padding=4)``, horizontal flip, scaling and normalisation, as
``data/datasets.py`` and ``data/federated.py`` build it) on uint8 32x32 images of random pixels,
one client's shard iterated by ``ClientData`` as the loop iterates it:

- host (the default on a CPU, and the code before ``augment_on``): each example through the
  torchvision transform in a DataLoader in this process;
- device: the images on ``--device``, each batch gathered and augmented there with per-example
  draws (``data/batch_augment.py``).

Both are measured as ``benchmarks/main_job_round.py`` measures its data phase: CPU seconds of
this process (``time.process_time``, one intra-op thread) spent producing the next batch, per
example. On a CPU the device path's figure includes the augmentation arithmetic itself; on a GPU
it is the host's dispatching only. Also printed: the top-level operators the device path
dispatches per batch (``torch.profiler``). The last line reads

    main-process CPU/example: host H ms, device D ms, ratio D/H R
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fl_lightning.data.base import ArrayDataset  # noqa: E402
from fl_lightning.data.batch_augment import batched_pipeline  # noqa: E402
from fl_lightning.data.datasets import CIFAR100_STATS, image_transforms  # noqa: E402
from fl_lightning.data.federated import with_randaugment  # noqa: E402
from fl_lightning.runtime.client_data import ClientData, DeviceBatches, HostBatches  # noqa: E402


def feast_cifar100_training_set(count: int, seed: int = 0) -> ArrayDataset:
    """``count`` random uint8 images seen through the FEAST CIFAR-100 training transform."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (count, 3, 32, 32), dtype=torch.uint8, generator=generator)
    targets = torch.randint(0, 100, (count,), generator=generator)
    train_transform, _ = image_transforms(CIFAR100_STATS, crop=32, padding=4, flip=True)
    return with_randaugment(ArrayDataset(images, targets, train_transform), 2, 6)


def cpu_per_example(data: ClientData, device: torch.device) -> float:
    """Main-process CPU milliseconds per example while the next batch is made (one epoch)."""
    batches = data.epoch(torch.Generator().manual_seed(1))
    spent, examples = 0.0, 0
    while True:
        started = time.process_time()
        batch = next(batches, None)
        spent += time.process_time() - started
        if batch is None:
            break
        examples += len(batch[1])
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 1000 * spent / examples


def dispatches_per_batch(data: ClientData, batches: int = 4) -> float:
    """Top-level ATen operators the batch maker issues per batch."""
    from torch.profiler import ProfilerActivity, profile

    iterator = data.epoch(torch.Generator().manual_seed(2))
    next(iterator)  # warm: source maps and constants made on first use
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(batches):
            next(iterator)
    top = [e for e in profiler.events() if e.name.startswith("aten::") and not _nested(e)]
    return len(top) / batches


def _nested(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2560, help="examples of the shard (one epoch each path)")
    parser.add_argument("--batch-size", type=int, default=64, help="FEAST's batch size")
    parser.add_argument("--device", default="cpu", help="where the device path runs (cpu or cuda)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    dataset = feast_cifar100_training_set(args.examples)
    shard = torch.arange(args.examples)
    host = ClientData(dataset, shard, args.batch_size, device, source=HostBatches(dataset, device))
    on_device = ClientData(dataset, shard, args.batch_size, device,
                           source=DeviceBatches(dataset, device, batched_pipeline(dataset.transform)))
    cpu_per_example(on_device, device)  # warm-up: the images' copy to the device, first-use constants
    torch.manual_seed(0)
    host_ms = cpu_per_example(host, device)
    torch.manual_seed(0)
    device_ms = cpu_per_example(on_device, device)
    print(f"data_path: {args.examples} examples in batches of {args.batch_size}, one thread, torch "
          f"{torch.__version__}, device path on {device}")
    print(f"device path: {dispatches_per_batch(on_device):.0f} top-level operators per batch")
    print(f"main-process CPU/example: host {host_ms:.3f} ms, device {device_ms:.3f} ms, "
          f"ratio D/H {device_ms / host_ms:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
