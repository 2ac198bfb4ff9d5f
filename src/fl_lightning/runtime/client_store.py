"""Per-client state that persists across rounds (control variates, estimates, prompts)."""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional

import torch

ClientState = Dict[str, torch.Tensor]
PREFIX = "clients/"  # where a store's entries sit in an algorithm's checkpointed state


class ClientStateStore:
    """Server-side store of per-client tensors, created on first use from ``initial``.

    Ranks train disjoint clients: a method registers its store with the round's accumulator
    (``runtime/round_state.py``), which sums each cohort member's entry across ranks in the
    round's reduction (owners contribute their values, the others zeros), so every rank holds
    the same store.
    """

    def __init__(self, initial: Callable[[], ClientState]):
        """``initial()`` returns a new client's state; it must be all zeros (what a rank that
        does not hold the client contributes to the reduction)."""
        self.initial = initial
        self.states: Dict[int, ClientState] = {}

    def get(self, client: int) -> ClientState:
        if client not in self.states:
            self.states[client] = self.initial()
        return self.states[client]

    def set(self, client: int, state: ClientState) -> None:
        self.states[client] = state

    def kept(self, client: int, flag: str) -> Optional[ClientState]:
        """The client's state when its ``flag`` entry is set (e.g. once it holds a trained
        model), else None."""
        state = self.states.get(client)
        return state if state is not None and float(state[flag]) > 0 else None

    def holding(self, flag: str) -> List[int]:
        """The clients whose ``flag`` entry is set, in order."""
        return sorted(c for c in self.states if self.kept(c, flag) is not None)

    # -- checkpoint: every entry as PREFIX + "<client>/<key>" ------------------------------------
    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {f"{PREFIX}{client}/{key}": value for client, state in self.states.items()
                for key, value in state.items()}

    def load_state_dict(self, flat: Mapping[str, torch.Tensor]) -> None:
        """Load the entries of ``flat`` under PREFIX (an algorithm's whole state may hold others)."""
        self.states = {}
        for name, value in flat.items():
            if not name.startswith(PREFIX):
                continue
            client, key = name[len(PREFIX):].split("/", 1)
            self.states.setdefault(int(client), {})[key] = value
