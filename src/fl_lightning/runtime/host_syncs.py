"""Host synchronisations counted on a CPU: the proxy of ``torch.cuda.set_sync_debug_mode``.

On a GPU, reading a tensor's value on the host (``.item()``, ``float(t)``, ``int(t)``,
``bool(t)``, ``.tolist()``, ``.cpu()``, ``.numpy()``) waits until the device has finished
everything queued before it; inside a client's training steps that leaves the GPU idle while
the host catches up. On a CPU nothing waits, so :class:`HostSyncs` counts those calls instead
(``benchmarks/main_job_round.py`` reports them, ``tests/test_host_syncs.py`` requires none
inside a client's steps), and :func:`step_windows` limits the count to the steps.

Values drawn from an explicit CPU generator (``torch.randint(..., generator=g)``: the
per-batch draws of a client's sandwich sampler and mixer) are host values by construction: on a
GPU run they are drawn and read on the host without waiting for the device, so reading them is
not counted.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
"""Tensor methods that hand a tensor's values to the host."""
DRAWS = ("randint", "randperm", "rand", "randn", "multinomial", "normal", "bernoulli")
"""Random functions that take a ``generator``; their results from a CPU generator are host values."""
_HOST_DRAW = "_fl_lightning_host_draw"


class HostSyncs:
    """Within ``with HostSyncs() as syncs:``, every read of a tensor's values on the host that
    is not a host draw (see the module's doc) is counted while ``active`` is true, in
    ``syncs.calls`` by ``"method at file:line"`` of its caller; ``on_sync(where)`` is told of
    each. Patches ``torch.Tensor`` for the block's duration (this process, every thread)."""

    def __init__(self, on_sync: Optional[Callable[[str], None]] = None, skip_files: tuple = ()):
        self.calls: Counter = Counter()
        self.active = True
        self.on_sync = on_sync
        self._skip = {__file__, *skip_files}  # frames whose caller is reported instead
        self._saved: dict = {}

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def __enter__(self) -> "HostSyncs":
        for name in READS:
            self._saved[(torch.Tensor, name)] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))
        for name in DRAWS:
            self._saved[(torch, name)] = getattr(torch, name)
            setattr(torch, name, _tagging(getattr(torch, name)))
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)
        self._saved.clear()

    def _counted(self, method: str, original):
        counter = self

        def counted(self, *args, **kwargs):
            if counter.active and not getattr(self, _HOST_DRAW, False):
                where = counter._caller(method)
                counter.calls[where] += 1
                if counter.on_sync is not None:
                    counter.on_sync(where)
            return original(self, *args, **kwargs)
        return counted

    def _caller(self, method: str) -> str:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename in self._skip:
            frame = frame.f_back
        if frame is None:
            return method
        return f"{method} at {Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


def _tagging(draw):
    def tagged(*args, **kwargs):
        out = draw(*args, **kwargs)
        generator = kwargs.get("generator")
        if generator is not None and generator.device.type == "cpu" and isinstance(out, torch.Tensor):
            setattr(out, _HOST_DRAW, True)
        return out
    return tagged


def step_windows(batches: Iterator, syncs: HostSyncs, on_step: Optional[Callable[[bool], None]] = None) -> Iterator:
    """``batches``, with ``syncs`` counting only between handing out a batch and the request
    for the next one: inside the training steps, not while the next batch is fetched.
    ``on_step(True)`` / ``on_step(False)`` is called as each step begins and ends."""
    syncs.active = False
    try:
        for batch in batches:
            syncs.active = True
            if on_step is not None:
                on_step(True)
            yield batch
            syncs.active = False
            if on_step is not None:
                on_step(False)
    finally:
        syncs.active = False
