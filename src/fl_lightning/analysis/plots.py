"""Plot pieces shared by the report tools (matplotlib is imported by the caller's backend)."""

from __future__ import annotations


def mac_log_axis(ax, xlabel: str, ylabel: str) -> None:
    """A log-scale MAC axis labelled in plain numbers (1, 2, 5, 10, ... millions), with the
    grid and legend every accuracy-against-MACs figure uses."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    # minor ticks at 2x and 5x a power of ten only; the leading digit is read in scientific form
    # so that 0.2 and 0.5 count as well as 20 and 50
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
