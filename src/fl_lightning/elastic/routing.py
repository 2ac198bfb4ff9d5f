"""A client's routed model: a physical module plus the map back to global positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Tuple

import torch
from torch import nn

from fl_lightning.elastic.regions import Full, Region

# local state-dict key -> (global state-dict key, region of that global tensor)
RegionMap = Dict[str, Tuple[str, Region]]


@dataclass
class Routed:
    """What the server sends a client: ``module`` holds copies of the routed slices only."""

    module: nn.Module
    regions: RegionMap

    def payload_bytes(self) -> int:
        """Bytes sent one way: every routed position (parameters and buffers) at the size of
        the local tensor's element, what the federation loop counts as traffic down and up."""
        state = self.module.state_dict()
        return sum(region.numel() * state[key].element_size() for key, (_, region) in self.regions.items())


def full_region_map(state: Mapping[str, torch.Tensor]) -> RegionMap:
    """The identity map of a dense model: every key covers its whole global tensor."""
    return {key: (key, Full(value.shape)) for key, value in state.items()}


def load_routed_state(module: nn.Module, global_state: Mapping[str, torch.Tensor], regions: RegionMap) -> None:
    """Copy the routed slices of ``global_state`` into ``module`` in place (no new allocations)."""
    local_state = module.state_dict()
    with torch.no_grad():
        for key, (global_key, region) in regions.items():
            region.read_into(local_state[key], global_state[global_key])


def write_back(global_state: Mapping[str, torch.Tensor], local_state: Mapping[str, torch.Tensor], regions: RegionMap) -> None:
    """Write a client's local values into their global positions (extraction's inverse)."""
    with torch.no_grad():
        for key, (global_key, region) in regions.items():
            region.scatter(global_state[global_key], local_state[key].to(global_state[global_key].dtype))
