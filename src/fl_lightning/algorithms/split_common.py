"""Pieces the split-FL methods (SplitFed, FedSGA, MergeSFL, MU-SplitFed, MultiSFL) share: the
regions of one half's keys, the per-client figures of docs/fedsga.md ("The cut"), and the
default cut candidates."""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

import torch

from fl_lightning.elastic.routing import RegionMap, full_region_map


def key_regions(state: Mapping[str, torch.Tensor], keys: Sequence[str], prefix: str = "") -> RegionMap:
    """Whole-tensor regions of ``keys`` of ``state``, local keys prefixed by ``prefix``."""
    return {prefix + k: v for k, v in full_region_map({k: state[k] for k in keys}).items()}


def split_metrics(halves, cut: str, *, steps: int, seconds: float, client_seconds: float,
                  server_seconds: float, examples: int) -> Dict[str, float]:
    """A client's row as SplitFed writes it (its traffic comes from the channel): activated
    client parameters and client MACs (fvcore's forward count times three)."""
    return {"steps": steps, "seconds": seconds, "client_seconds": client_seconds, "server_seconds": server_seconds,
            "client_params": halves.front_params[cut], "client_macs": 3 * halves.front_macs[cut] * examples}


def label_counts(targets: torch.Tensor, clients: List[torch.Tensor], num_classes: int) -> torch.Tensor:
    """``(num_clients, num_classes)`` float64 label histograms of the clients' shards."""
    targets = torch.as_tensor(targets, dtype=torch.long)
    return torch.stack([torch.bincount(targets[idx], minlength=num_classes)[:num_classes].to(torch.float64)
                        for idx in clients])


def default_candidates(names: List[str]) -> List[str]:
    """Ends of all but the last stage for ``stage.index`` block names, else the boundaries
    after a quarter, a half and three quarters of the blocks."""
    inner = names[:-1]
    stages: Dict[str, str] = {}
    for name in inner:
        if "." in name:
            stages[name.split(".")[0]] = name  # the last block seen of each stage
    last_stage = names[-1].split(".")[0] if "." in names[-1] else None
    ends = [end for stage, end in stages.items() if stage != last_stage]
    if len(ends) >= 2:
        return ends
    depth = len(names)
    counts = sorted({min(max(1, round(depth * q)), depth - 1) for q in (0.25, 0.5, 0.75)})
    return [names[k - 1] for k in counts]
