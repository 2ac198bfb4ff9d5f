"""A round's plan: which clients train, and what each of them trains.

An algorithm decides the plan once per round from state that every rank holds identically
(the seed, the round index, last round's aggregated figures), so every rank computes the same
plan and the loop reads it top to bottom.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, List, Optional, TypeVar

Choice = TypeVar("Choice")


@dataclass
class ClientTask(Generic[Choice]):
    """What one client does in a round; ``ClientTask[CutChoice]`` names the method's choice type."""

    client: int
    """Client id (index into the partition)."""
    spec: Any = None
    """Operating point the client trains: a width, a subnet spec, an envelope (None: the whole model)."""
    cut: Optional[str] = None
    """Block boundary where the model is split between client and server (split learning)."""
    choice: Optional[Choice] = None
    """What else the server chose for the client's round, as the method's own typed record (a
    sub-model's width, FedSGA's cut index and calibration flag, FedNAS's sandwich role); None
    when the spec and the cut say everything."""


@dataclass
class RoundPlan:
    """The cohort of one round in order, with the learning rate every client uses."""

    round_idx: int
    lr: float
    tasks: List[ClientTask]

    @property
    def cohort(self) -> List[int]:
        return [task.client for task in self.tasks]

    def __post_init__(self):
        clients = self.cohort
        if len(set(clients)) != len(clients):
            raise ValueError(f"round {self.round_idx}: a client appears twice in the plan {clients}")
