"""Figures of the sub-model study from saved runs (``<root>/<policy>_s<seed>``).

    python tools/submodel_figures.py runs/submodel/digits --out docs/figures/submodel_digits
    python tools/submodel_figures.py --widths --out docs/figures/submodel_cost   # Fig. 2

Writes PNGs: ``fig4_hbar_pbar.png`` (H_bar and p_bar over rounds, HAS-FL), ``fig5_allocations.png``
(final HAS-FL allocation per client grouped by cap tier), ``fig6_acc_vs_capacity.png`` (final
accuracy against average capacity, every policy and seed), ``fig3_curves.png`` (test accuracy
and training loss over rounds, mean over seeds), and with ``--widths`` ``fig2_cost.png``
(parameters and MACs per width for the CNN and the LSTM, relative to full width).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def fig_widths(out: Path) -> None:
    from fl_lightning.elastic.macs import count_macs, count_params
    from fl_lightning.elastic.models import build_model
    from fl_lightning.elastic.specs import WidthSpec

    widths = [0.25, 0.5, 0.75, 1.0]
    archs = {"CNN 3x32x32": ("cnn", 10, (3, 32, 32), None), "CNN 1x28x28": ("cnn", 62, (1, 28, 28), None),
             "LSTM (80 chars)": ("lstm", 80, (80,), __import__("torch").long)}
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for label, (name, classes, shape, dtype) in archs.items():
        model = build_model(name, num_classes=classes, input_shape=shape)
        stages = len(model.max_spec().widths)
        costs = []
        for w in widths:
            local = model.extract(WidthSpec.uniform(w, stages)).module
            costs.append((count_params(local), count_macs(local, shape, dtype)))
        costs = np.array(costs, dtype=np.float64)
        axes[0].plot(widths, costs[:, 0] / costs[-1, 0], "o-", label=label)
        axes[1].plot(widths, costs[:, 1] / costs[-1, 1], "o-", label=label)
    for ax, what in zip(axes, ("parameters", "MACs")):
        ax.plot(widths, np.square(widths), "k:", label="p²")
        ax.set_xlabel("width p"), ax.set_ylabel(f"{what} / full"), ax.legend(fontsize=7)
    fig.tight_layout(), fig.savefig(out / "fig2_cost.png", dpi=120), plt.close(fig)


def run_figures(root: Path, out: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from submodel_tables import collect, run_figures as figures_of

    runs = collect(root)
    has = runs.get("hasfl", {})
    if has:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for seed, run in sorted(has.items()):
            rounds = [m["round"] for m in run["metrics"]]
            axes[0].plot(rounds, [m["H_bar"] for m in run["metrics"]], label=f"seed {seed}")
            axes[1].plot(rounds, [m["p_bar"] for m in run["metrics"]], label=f"seed {seed}")
        axes[0].set_ylabel("H̄ (mean H̃)"), axes[1].set_ylabel("p̄ (cohort mean width)")
        for ax in axes:
            ax.set_xlabel("round"), ax.legend(fontsize=7)
        fig.tight_layout(), fig.savefig(out / "fig4_hbar_pbar.png", dpi=120), plt.close(fig)

        fig, ax = plt.subplots(figsize=(5, 3.5))
        for seed, run in sorted(has.items()):
            last, caps = run["metrics"][-1], run["caps"]
            p = np.array([last[f"p/{c}"] for c in range(len(caps))])
            jitter = (seed - 1) * 0.03
            ax.scatter(caps + jitter, p, s=14, label=f"seed {seed}")
        ax.plot([0.25, 1.0], [0.25, 1.0], "k:", lw=0.8)
        ax.set_xlabel("cap tier p_max"), ax.set_ylabel("final allocation p")
        ax.legend(fontsize=7), fig.tight_layout(), fig.savefig(out / "fig5_allocations.png", dpi=120), plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for policy, seeds in runs.items():
        f = [figures_of(r) for r in seeds.values()]
        ax.scatter([x["p"] for x in f], [100 * x["final"] for x in f], label=policy, s=18)
    ax.set_xlabel("average capacity"), ax.set_ylabel("final test accuracy (%)"), ax.legend(fontsize=7)
    fig.tight_layout(), fig.savefig(out / "fig6_acc_vs_capacity.png", dpi=120), plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for policy, seeds in runs.items():
        curves = defaultdict(list)
        losses = defaultdict(list)
        for run in seeds.values():
            for m in run["metrics"]:
                losses[m["round"]].append(m["train_loss"])
                if m.get("test_acc") is not None:
                    curves[m["round"]].append(100 * m["test_acc"])
        r = sorted(curves)
        axes[0].plot(r, [np.mean(curves[k]) for k in r], label=policy)
        r = sorted(losses)
        axes[1].plot(r, [np.mean(losses[k]) for k in r], label=policy)
    axes[0].set_ylabel("test accuracy (%)"), axes[1].set_ylabel("training loss"), axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("round"), ax.legend(fontsize=7)
    fig.tight_layout(), fig.savefig(out / "fig3_curves.png", dpi=120), plt.close(fig)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, nargs="?")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--widths", action="store_true", help="Fig. 2: parameters and MACs per width")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.widths:
        fig_widths(args.out)
    if args.root:
        run_figures(args.root, args.out)
    print(f"figures in {args.out}")
