"""What a partition looks like: sizes, label histograms, label skew, a table and a plot.

Label skew is the total-variation distance TV_i = 0.5 * sum_c |P_i(c) - P(c)| between client
i's label distribution and the distribution over all examples held by clients: 0 when a
client mirrors the population, 1 when it shares no label mass with it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import BinaryIO, Dict, List, Optional, Sequence

import numpy as np
import torch

from fl_lightning.runtime.output_files import write_file
from fl_lightning.units import count


def _label_counts(client_indices: Sequence, y: np.ndarray, num_classes: int) -> np.ndarray:
    counts = np.zeros((len(client_indices), num_classes), dtype=np.int64)
    for i, idx in enumerate(client_indices):
        labels = y[np.asarray(torch.as_tensor(idx, dtype=torch.long))]
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise ValueError(f"client {i} has a label outside [0, {num_classes})")
        counts[i] = np.bincount(labels, minlength=num_classes)
    return counts


def _tv_distances(counts: np.ndarray) -> List[Optional[float]]:
    total = counts.sum(axis=0)
    global_p = total / max(int(total.sum()), 1)
    tv: List[Optional[float]] = []
    for row in counts:
        n = int(row.sum())
        tv.append(None if n == 0 else float(0.5 * np.abs(row / n - global_p).sum()))
    return tv


def partition_report(
    client_indices: Sequence[torch.Tensor],
    targets,
    num_classes: int,
    budgets: Optional[Sequence[float]] = None,
) -> Dict:
    """Describe a partition as a JSON-ready dict.

    Keys: ``num_clients``, ``num_classes``, ``num_examples`` (held by clients), ``sizes``,
    ``label_counts`` (list of per-client lists of length num_classes), ``num_labels`` (distinct
    labels per client), ``global_distribution`` (over all client-held examples), ``tv_distance``
    (per client; None for an empty client), ``budgets`` (if given) and ``summary`` with
    min/median/max/mean size and mean/max TV over non-empty clients.
    """
    y = np.asarray(targets.cpu() if isinstance(targets, torch.Tensor) else targets).reshape(-1).astype(np.int64)
    counts = _label_counts(client_indices, y, int(num_classes))
    sizes = counts.sum(axis=1)
    total = counts.sum(axis=0)
    tv = _tv_distances(counts)
    tv_known = [t for t in tv if t is not None]
    report = {
        "num_clients": len(client_indices),
        "num_classes": int(num_classes),
        "num_examples": int(sizes.sum()),
        "sizes": sizes.tolist(),
        "label_counts": counts.tolist(),
        "num_labels": (counts > 0).sum(axis=1).tolist(),
        "global_distribution": (total / max(int(total.sum()), 1)).tolist(),
        "tv_distance": tv,
        "summary": {
            "min_size": int(sizes.min()) if len(sizes) else 0,
            "median_size": float(np.median(sizes)) if len(sizes) else 0.0,
            "max_size": int(sizes.max()) if len(sizes) else 0,
            "mean_size": float(sizes.mean()) if len(sizes) else 0.0,
            "mean_tv": float(np.mean(tv_known)) if tv_known else None,
            "max_tv": float(np.max(tv_known)) if tv_known else None,
        },
    }
    if budgets is not None:
        report["budgets"] = [float(b) for b in torch.as_tensor(budgets, dtype=torch.float64).reshape(-1)]
    return report


def _top_labels(row: Sequence[int], k: int = 3) -> str:
    row = np.asarray(row)
    top = [c for c in np.argsort(-row, kind="stable")[:k] if row[c] > 0]
    return " ".join(f"{c}:{row[c]}" for c in top)


def format_report(report: Dict, top_k: int = 3) -> str:
    """A plain-text table, one line per client: id, size, TV, (budget,) top labels."""
    s = report["summary"]
    mean_tv = "n/a" if s["mean_tv"] is None else f"{s['mean_tv']:.3f}"
    lines = [
        f"{report['num_clients']} clients, {report['num_examples']} examples, {report['num_classes']} classes; "
        f"size min/median/max {s['min_size']}/{s['median_size']:g}/{s['max_size']}; mean TV {mean_tv}",
    ]
    budgets = report.get("budgets")
    header = f"{'client':>6} {'size':>7} {'TV':>6}" + (f" {'budget':>9}" if budgets else "") + "  top labels (label:count)"
    lines.append(header)
    for i, (n, tv, row) in enumerate(zip(report["sizes"], report["tv_distance"], report["label_counts"])):
        tv_s = "  n/a" if tv is None else f"{tv:.3f}"
        b_s = f" {count(budgets[i]):>9}" if budgets else ""
        lines.append(f"{i:>6} {n:>7} {tv_s:>6}{b_s}  {_top_labels(row, top_k)}")
    return "\n".join(lines)


def _plot(report: Dict, path: BinaryIO) -> None:
    # Figure + Agg canvas directly: no pyplot global state, no display needed.
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    counts = np.asarray(report["label_counts"], dtype=np.float64).reshape(report["num_clients"], -1)
    n_clients, n_classes = counts.shape
    height = min(max(3.0, 0.12 * n_clients + 1.5), 16.0)
    fig = Figure(figsize=(11, height))
    FigureCanvasAgg(fig)
    y = np.arange(n_clients)
    budgets = report.get("budgets")
    # panels side by side on the clients' axis: the labels, (with many classes) the sizes, the budgets
    widths = [4] + ([1] if n_classes > 20 else []) + ([1] if budgets else [])
    axes = list(np.atleast_1d(fig.subplots(1, len(widths), sharey=True, gridspec_kw={"width_ratios": widths})))
    ax = axes[0]
    if n_classes <= 20:
        # few classes: stacked bars read directly as "how many of each label"
        colors = colormaps["tab20"](np.arange(n_classes) % 20)
        left = np.zeros(n_clients)
        for c in range(n_classes):
            ax.barh(y, counts[:, c], left=left, color=colors[c], height=0.85, label=str(c), linewidth=0)
            left += counts[:, c]
        axes[-1].legend(*ax.get_legend_handles_labels(), title="label", fontsize=6, title_fontsize=7, ncol=1,
                        loc="center left", bbox_to_anchor=(1.0, 0.5))  # right of the rightmost panel
        ax.set_xlabel("examples")
    else:
        # many classes: a heat-map of counts beside the per-client sizes stays legible at 100 x 100
        im = ax.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower")
        fig.colorbar(im, ax=ax, fraction=0.04, pad=0.01, label="examples")
        ax.set_xlabel("label")
        axes[1].barh(y, counts.sum(axis=1), height=0.85, color="tab:gray")
        axes[1].set_xlabel("examples")
    if budgets:
        axes[-1].barh(y, budgets, height=0.85, color="tab:brown")
        axes[-1].set_xscale("log")  # Zipf budgets span orders of magnitude
        axes[-1].set_xlabel("MAC budget")
    ax.set_ylabel("client")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(-0.5, n_clients - 0.5)
    s = report["summary"]
    mean_tv = "n/a" if s["mean_tv"] is None else f"{s['mean_tv']:.3f}"
    fig.suptitle(f"{n_clients} clients, sizes {s['min_size']}-{s['max_size']}, mean TV {mean_tv}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")


def save_report(report: Dict, out_dir) -> Dict[str, Path]:
    """Write ``partition.json`` and ``partition.png`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "partition.json", "png": out / "partition.png"}
    write_file(paths["json"], json.dumps(report, indent=1) + "\n")
    image = io.BytesIO()
    _plot(report, image)
    write_file(paths["png"], image.getbuffer())
    return paths


__all__ = ["format_report", "partition_report", "save_report"]
