"""What one rank holds in memory, estimated before anything is allocated, and the refusal of a
model that would not fit.

A CPU rank's resident set peaks while a client trains its costliest forward pass (measured by
``benchmarks/main_job_round.py``: during forward and backward, for the main job and the quick
start alike). It then holds (:class:`Holdings`):

- the libraries and the loop: :data:`RANK_BASE_BYTES`;
- the dataset in memory (each dataset states its bytes: ``DatasetSource.footprint``);
- the global model: its parameters and buffers at their element sizes;
- the round's accumulator: a float64 value for every floating element of the global model,
  allocated as the round begins. The per-position counts of sub-model and supernet methods
  (another 8 bytes each) are built at the reduction, once the clients are done, in memory the
  allocator has just freed, and do not raise the peak;
- the client's model, its gradients and SGD's momentum: three times the parameter bytes of the
  largest model a client trains (the method's, e.g. FEAST's envelope of its cached variants;
  by default the whole model), plus its buffers once;
- the activations: the tensors the costliest forward pass keeps for its backward, at the
  training batch size, counted by running that pass on the meta device, times
  :data:`ACTIVATION_RESIDENT`.

Only the two constants are measured; every other term is counted from the config. The main
job (55.7M parameters) at the peak: 0.17 GB of data, 0.21 GB model, 0.41 GB accumulator,
0.40 GB client state (its 35.6M-parameter envelope), 1.28 GB of saved activations (its
578M-MAC variant at batch 64). GB are 2^30 bytes.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from fl_lightning.errors import ConfigError

RANK_BASE_BYTES = int(0.88 * 2**30)
"""Python, torch, Lightning, torchvision and torchmetrics as a rank has them loaded, the loop's
own state, and what training first adds besides its activations (the libraries' working
memory). Measured with :data:`ACTIVATION_RESIDENT` below (two constants, two measured peaks)."""

ACTIVATION_RESIDENT = 2.38
"""Growth of the resident set per byte of saved activations over a round's client steps:
forward saves them; the backward's gradients of activations and the zero-padded gradients of
sliced weights come on top, and the allocator keeps the blocks one pass frees while the next
pass, of other shapes, allocates, so the resident set keeps growing for a while. With
:data:`RANK_BASE_BYTES`, from two peaks over whole rounds measured by
``benchmarks/main_job_round.py --profile-steps 0`` (torch 2.14, Linux, glibc): the quick start
(0.94 GB over 2 rounds; 0.015 GB saved per pass) and the main job (5.11 GB over round 1;
1.28 GB saved by its 578M-MAC variant at batch 64): each peak less the counted terms is
``RANK_BASE_BYTES + ACTIVATION_RESIDENT x saved``. The same run cut to 2 steps per client
peaked at 4.44 GB: the estimate is of a whole round."""

COPIES = 4
"""A device's share of a model: the global model, the client's, its gradients and momentum
(:func:`check_model_fits`)."""


def shapes_model(model, num_classes: int, input_shape: Sequence[int]):
    """The model of section ``model`` on the meta device, without initialisers (no memory)."""
    from fl_lightning.elastic.models import build_model
    from fl_lightning.elastic.models.base import shapes_only

    with shapes_only():
        return build_model(model, num_classes, input_shape)


def state_bytes(module: torch.nn.Module, parameters_only: bool = False) -> int:
    tensors = module.parameters() if parameters_only else itertools.chain(module.parameters(), module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Holdings:
    """Bytes of what a rank holds when its resident set peaks (see the module's doc)."""

    data: int
    model: int
    accumulator: int
    client: int
    activations: int

    @property
    def total(self) -> int:
        return (RANK_BASE_BYTES + self.data + self.model + self.accumulator + self.client
                + int(ACTIVATION_RESIDENT * self.activations))

    @classmethod
    def of(cls, built: torch.nn.Module, data_bytes: int, input_shape: Sequence[int],
           batch_size: Optional[int] = None, algorithm: Any = None) -> "Holdings":
        """For ``built``, the global model on the meta device, trained by ``algorithm`` at
        ``batch_size`` (None: activations not counted)."""
        floating = sum(t.numel() for t in built.state_dict().values() if t.is_floating_point())
        client, costliest = largest_client(built, algorithm)
        client_bytes = 3 * state_bytes(client, parameters_only=True) + sum(
            b.numel() * b.element_size() for b in client.buffers())
        activations = 0
        if batch_size is not None:
            activations = saved_activation_bytes(built, costliest, input_shape, batch_size)
        return cls(data_bytes, state_bytes(built), 8 * floating, client_bytes, activations)


def largest_client(built: torch.nn.Module, algorithm: Any = None):
    """(the largest module a client of ``algorithm`` trains, the spec of its costliest forward),
    on the meta device: the method's own answer (``largest_client_model(built)``, e.g. FEAST's
    envelope of its cached variants and its costliest variant), else the whole model at its
    largest operating point."""
    from fl_lightning.elastic.models.base import shapes_only

    answer = getattr(algorithm, "largest_client_model", None)
    found = answer(built) if answer is not None else None
    if found is None:
        return built, built.max_spec() if hasattr(built, "max_spec") else None
    bounds, costliest = found
    with shapes_only():
        return built.build_local(bounds, elastic=True), costliest


def saved_activation_bytes(built: torch.nn.Module, spec: Any, input_shape: Sequence[int], batch_size: int) -> int:
    """Bytes of the tensors one training forward of ``built`` at ``spec`` keeps for its
    backward, for a batch of ``batch_size``, counted on the meta device (parameters and views
    of kept tensors hold no memory of their own and are not counted; 0 where the model cannot
    run on the meta device)."""
    held = {id(t) for t in itertools.chain(built.parameters(), built.buffers())}
    saved = {}

    def pack(tensor):
        if id(tensor) not in held and not tensor._is_view():
            saved[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    dtype = getattr(built, "input_dtype", None) or torch.get_default_dtype()
    mode = built.training
    try:
        if spec is not None and hasattr(built, "set_active"):
            built.set_active(spec)
        built.train()
        x = torch.zeros(batch_size, *input_shape, dtype=dtype, device="meta")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            built(x)
    except Exception:  # a model whose forward needs real values (token models' lookups may)
        return 0
    finally:
        built.train(mode)
    return sum(saved.values())


# ------------------------------------------------------------------------------------------
# A model too large for the device
# ------------------------------------------------------------------------------------------

def model_bytes(model, num_classes: int, input_shape: Sequence[int]) -> int:
    """Bytes of the parameters and buffers of ``model`` (a config section), counted without
    allocating them."""
    return state_bytes(shapes_model(model, num_classes, input_shape))


def inflating_option(model, num_classes: int, input_shape: Sequence[int]) -> str:
    """``model.<option>``: of the options the config sets, the one whose default shrinks the
    model most (``--model.width 1000`` is ``model.width``); ``model`` when no option shrinks it."""
    from fl_lightning.elastic.models import model_options

    options = model_options(model)
    if not options:
        return "model"
    full = model_bytes(model, num_classes, input_shape)
    best, smallest = "model", full
    for name in options:
        reduced = {"class_path": _class_path(model), "init_args": {k: v for k, v in options.items() if k != name}}
        try:
            size = model_bytes(reduced, num_classes, input_shape)
        except Exception:  # without this option the model cannot be built: not the one to blame
            continue
        if size < smallest:
            best, smallest = f"model.{name}", size
    return best


def _class_path(model) -> str:
    from fl_lightning.elastic.models import model_class

    cls = model_class(model)
    return f"{cls.__module__}.{cls.__qualname__}"


def available_bytes(device: torch.device) -> int:
    """Free memory of ``device`` (a CUDA GPU's free memory, else the machine's available RAM)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_model_fits(model, num_classes: int, input_shape: Sequence[int], device: torch.device) -> None:
    """ConfigError naming the option that makes ``model`` (a config section) large when about
    COPIES times its bytes exceed what ``device`` has free."""
    from fl_lightning.elastic.models import model_class, model_options

    try:
        nbytes = model_bytes(model, num_classes, input_shape)
    except ConfigError:
        raise
    except Exception:  # a model that cannot be built on the meta device is not estimated
        return
    needed, free = COPIES * nbytes, available_bytes(device)
    if needed > free:
        shown = f"{model_class(model).__name__} with {model_options(model)}"
        raise ConfigError(inflating_option(model, num_classes, input_shape),
                          f"{shown} holds {_gb(nbytes)} of weights, and a run holds about {COPIES} copies "
                          f"({_gb(needed)}), more than the {_gb(free)} free on {device.type}; choose a smaller model")


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
