"""Ground-truth heterogeneity and the capacity-confound statistics of the sub-model study.

- :func:`label_tv`: total-variation distance between each client's label distribution and the
  distribution over all client-held examples (for Shakespeare the labels are the
  next-character targets).
- :func:`pearson`, :func:`partial_corr`: Pearson's r and the partial correlation of x and y
  given z, ``(r_xy - r_xz r_yz) / sqrt((1 - r_xz^2)(1 - r_yz^2))``.
- :func:`table4_row`: r(H_tilde, TV), r(H_tilde, p_max), partial r(H_tilde, TV | p_max) and
  partial r(p, TV | p_max) of one saved HAS-FL run (:func:`load_run`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from fl_lightning.analysis.partition_report import _label_counts, _tv_distances


def label_tv(client_indices: Sequence, targets, num_classes: int) -> np.ndarray:
    """TV_i = 0.5 sum_c |P_i(c) - P(c)| per client (NaN for an empty client)."""
    y = np.asarray(targets.cpu() if isinstance(targets, torch.Tensor) else targets).reshape(-1).astype(np.int64)
    tv = _tv_distances(_label_counts(client_indices, y, int(num_classes)))
    return np.array([math.nan if t is None else t for t in tv], dtype=np.float64)


def pearson(x, y) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    x, y = x - x.mean(), y - y.mean()
    den = math.sqrt(float((x * x).sum() * (y * y).sum()))
    return float((x * y).sum() / den) if den > 0 else math.nan


def partial_corr(x, y, z) -> float:
    """Correlation of x and y with z held fixed (linearly)."""
    rxy, rxz, ryz = pearson(x, y), pearson(x, z), pearson(y, z)
    den = math.sqrt(max((1 - rxz ** 2) * (1 - ryz ** 2), 0.0))
    return float((rxy - rxz * ryz) / den) if den > 0 else math.nan


def read_jsonl(path: Path) -> List[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def load_run(run_dir) -> Dict:
    """A saved sub-model run: caps, per-round metrics and client rows, summary, config."""
    import yaml

    run = Path(run_dir)
    out = {"dir": run, "metrics": read_jsonl(run / "metrics.jsonl"), "clients": read_jsonl(run / "clients.jsonl"),
           "config": yaml.safe_load((run / "config.yaml").read_text())}
    out["caps"] = np.array(json.loads((run / "caps.json").read_text())) if (run / "caps.json").exists() else None
    out["summary"] = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else None
    return out


def run_tv(run: Dict) -> np.ndarray:
    """Label TV of every client of a saved run (reloads its dataset and partition)."""
    from fl_lightning.runtime.checkpoint import load_checkpoint
    from fl_lightning.saved_configs import dataset_of

    source, root = dataset_of(run["config"])
    bundle = source.load(root, False, False)
    part = load_checkpoint(run["dir"] / "partition.pt")
    clients = [part[f"client/{i}"] for i in range(len([k for k in part if k.startswith("client/")]))]
    return label_tv(clients, bundle.train_targets, bundle.num_classes)


def final_estimates(run: Dict) -> tuple:
    """(H_tilde, p) per client after the last round of a HAS-FL run."""
    last = run["metrics"][-1]
    n = len(run["caps"])
    return (np.array([last[f"H_tilde/{c}"] for c in range(n)]), np.array([last[f"p/{c}"] for c in range(n)]))


def table4_row(run: Dict, tv: Optional[np.ndarray] = None) -> Dict[str, float]:
    tv = run_tv(run) if tv is None else tv
    h, p = final_estimates(run)
    caps = run["caps"]
    return {"r(H,TV)": pearson(h, tv), "r(H,pmax)": pearson(h, caps),
            "pr(H,TV|pmax)": partial_corr(h, tv, caps), "pr(p,TV|pmax)": partial_corr(p, tv, caps)}


__all__ = ["label_tv", "pearson", "partial_corr", "load_run", "run_tv", "final_estimates", "table4_row", "read_jsonl"]
