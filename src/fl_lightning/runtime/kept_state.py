"""What a method keeps across rounds, as parts the base checkpoints (``Algorithm.keep``).

A method never writes ``state_dict``: it registers each piece of its state once, in
``prepare``, as one of these parts, and the base's ``state_dict`` / ``load_state_dict`` carry
them. Each part names its checkpoint keys and restores exactly what it saved (values, dtypes),
so a resumed run continues bit for bit.

- :class:`KeptTensors`: a mapping of tensors the method updates in place (SCAFFOLD's control
  variate, FedMut's previous model, a client-state table);
- :class:`KeptAttributes`: tensors held in attributes the method replaces (HAS-FL's
  heterogeneity estimates, the capacities), restored with their dtype on the CPU;
- :class:`KeptModule`: anything with its own ``state_dict`` / ``load_state_dict`` (a module,
  a level assignment), under a key prefix;
- :class:`KeptRecord`: figures saved for the record and recomputed at set-up.

Client-state stores (``runtime/client_store.py``) and the server step
(``runtime/server_optimizer.py``) are parts of the same kind.
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, MutableMapping, Optional

import torch


class KeptTensors:
    """Tensors of ``tensors`` (a mapping the method updates in place) under ``prefix``.

    Args:
        prefix: the checkpoint keys' prefix (``c/``: SCAFFOLD's ``c/<name>``).
        tensors: the method's mapping. Loading copies into the tensors it holds and adds the
            saved ones it lacks (state created lazily, such as SplitFed V2's server momentum).
        stored_as: the dtype written to the checkpoint (``torch.uint8`` for boolean masks);
            None: as held.
    """

    def __init__(self, prefix: str, tensors: MutableMapping[str, torch.Tensor], stored_as: Optional[torch.dtype] = None):
        self.prefix, self.tensors, self.stored_as = prefix, tensors, stored_as

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {self.prefix + key: value if self.stored_as is None else value.to(self.stored_as)
                for key, value in self.tensors.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for key, value in state.items():
                if not key.startswith(self.prefix):
                    continue
                name = key[len(self.prefix):]
                if name in self.tensors:
                    self.tensors[name].copy_(value)
                else:
                    self.tensors[name] = value


class KeptAttributes:
    """Tensor attributes of ``owner`` under the keys of ``attributes`` (key -> attribute name),
    restored as ``dtype`` on the CPU (the server's bookkeeping lives there)."""

    def __init__(self, owner, attributes: Mapping[str, str], dtype: torch.dtype):
        self.owner, self.attributes, self.dtype = owner, dict(attributes), dtype

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {key: getattr(self.owner, name).clone() for key, name in self.attributes.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for key, name in self.attributes.items():
            setattr(self.owner, name, state[key].detach().to(self.dtype).cpu().clone())


class KeptModule:
    """The state of ``part`` (anything with ``state_dict`` / ``load_state_dict``) under ``prefix``."""

    def __init__(self, prefix: str, part):
        self.prefix, self.part = prefix, part

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {self.prefix + key: value for key, value in self.part.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        n = len(self.prefix)
        self.part.load_state_dict({key[n:]: value for key, value in state.items() if key.startswith(self.prefix)})


class KeptRecord:
    """Figures saved with the state for the record (what the state was made with, such as
    ScaleFL's level MACs) under ``key``; never loaded back: set-up recomputes them."""

    def __init__(self, key: str, value: Callable[[], torch.Tensor]):
        self.key, self.value = key, value

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {self.key: self.value()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        pass


__all__ = ["KeptTensors", "KeptAttributes", "KeptModule", "KeptRecord"]
