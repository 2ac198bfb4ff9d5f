"""Figures of the sub-model study from saved runs (``<root>/<policy>_s<seed>``).

    python tools/submodel_figures.py runs/submodel/digits --out docs/figures/submodel_digits
    python tools/submodel_figures.py --widths --out docs/figures/submodel_cost   # Fig. 2

Writes PNGs: ``fig4_hbar_pbar.png`` (H_bar and p_bar over rounds, HAS-FL), ``fig5_allocations.png``
(final HAS-FL allocation per client grouped by cap tier), ``fig6_acc_vs_capacity.png`` (final
accuracy against average capacity, every policy and seed), ``fig3_curves.png`` (test accuracy
over rounds, a panel per policy, a line per seed), ``fig8_test_loss.png`` (test loss over
rounds, mean and seeds per policy), and with ``--widths`` ``fig2_cost.png``
(parameters and MACs per width for the CNN and the LSTM, relative to full width).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from fl_lightning.tool_parser import ToolParser


def fig_widths(out: Path) -> None:
    from fl_lightning.elastic.macs import count_macs, count_params
    from fl_lightning.elastic.models import CNN, CharLSTM, build_model
    from fl_lightning.elastic.specs import WidthSpec

    widths = [0.25, 0.5, 0.75, 1.0]
    archs = {"CNN 3x32x32": (CNN, 10, (3, 32, 32), None), "CNN 1x28x28": (CNN, 62, (1, 28, 28), None),
             "LSTM (80 chars)": (CharLSTM, 80, (80,), __import__("torch").long)}
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

    fig3_curves(runs, out)
    fig8_test_loss(runs, out)


def evaluated(run, key: str):
    """(rounds, values) of an evaluation figure of one run (rounds where it was logged)."""
    rows = [m for m in run["metrics"] if m.get(key) is not None]
    return [m["round"] for m in rows], [m[key] for m in rows]


def fig3_curves(runs: dict, out: Path) -> None:
    """Fig. 3: test accuracy over rounds, one panel per policy, one line per seed (the
    rise-and-decline of Uniform and the oscillation of FjORD are per-seed shapes a mean hides)."""
    policies = list(runs)
    cols = min(3, len(policies))
    rows = -(-len(policies) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), sharex=True, sharey=True, squeeze=False)
    for ax, policy in zip(axes.flat, policies):
        for seed, run in sorted(runs[policy].items()):
            r, acc = evaluated(run, "test_acc")
            ax.plot(r, [100 * a for a in acc], lw=1, label=f"seed {seed}")
        ax.set_title(policy, fontsize=9), ax.legend(fontsize=6)
    for ax in axes[-1]:
        ax.set_xlabel("round")
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy (%)")
    for ax in list(axes.flat)[len(policies):]:
        ax.set_visible(False)
    fig.tight_layout(), fig.savefig(out / "fig3_curves.png", dpi=120), plt.close(fig)


def fig8_test_loss(runs: dict, out: Path) -> None:
    """Fig. 8: test loss over rounds, mean over seeds per policy (thin lines: seeds)."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for i, (policy, seeds) in enumerate(runs.items()):
        color = f"C{i % 10}"
        per_round = defaultdict(list)
        for run in seeds.values():
            r, loss = evaluated(run, "test_loss")
            ax.plot(r, loss, color=color, lw=0.5, alpha=0.4)
            for k, v in zip(r, loss):
                per_round[k].append(v)
        r = sorted(per_round)
        ax.plot(r, [np.mean(per_round[k]) for k in r], color=color, lw=1.6, label=policy)
    ax.set_xlabel("round"), ax.set_ylabel("test loss"), ax.set_yscale("log"), ax.legend(fontsize=7)
    fig.tight_layout(), fig.savefig(out / "fig8_test_loss.png", dpi=120), plt.close(fig)

if __name__ == "__main__":
    parser = ToolParser(description=__doc__.splitlines()[0])
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
