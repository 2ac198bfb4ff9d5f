"""The console's view of the rounds: a progress bar on a terminal, one plain line per round elsewhere.

A bar redraws itself with carriage returns, which a file (a cluster job's log) keeps as one
long line, and a terminal that reports no size shows as nothing. So the bar is drawn only on
standard error that is a terminal with a width; otherwise each round prints one line, as
Lightning prints one per epoch::

    round 3 (4/50): train_loss=1.2345 val_acc=0.8123 val_loss=0.5312 MB_down=1.2 MB_up=1.2 MB_total=9.6 seconds=2.1

Rounds are counted from 0, as in metrics.jsonl; ``(4/50)`` is how many are done of how many.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, Mapping, Optional, TextIO, Tuple

from tqdm import tqdm

from fl_lightning.federation.log_tags import MB

HEADLINE = ("acc", "loss")
"""The evaluated figures a round's line shows, of each split scored."""


def terminal_width(stream: TextIO) -> int:
    """Columns of the terminal ``stream`` writes to; 0 when it is not a terminal or has no size."""
    try:
        return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else 0
    except (AttributeError, ValueError, OSError):
        return 0


class RoundProgress:
    """Progress over a run's ``rounds``, shown where ``shown`` (rank 0)."""

    def __init__(self, name: str, rounds: int, shown: bool, stream: Optional[TextIO] = None):
        self.name, self.rounds, self.shown = name, rounds, shown
        self.stream = stream or sys.stderr
        self.traffic = 0.0  # MB both ways since round 0
        self.bar = None

    def carry(self, rows: Iterable[Mapping[str, object]]) -> None:
        """Count the traffic of the rounds run before (a resumed run's rows), so totals run on."""
        self.traffic = sum(sum(round_traffic(row)) for row in rows)

    def start(self, start_round: int) -> None:
        if self.shown and terminal_width(self.stream) > 0:
            self.bar = tqdm(total=self.rounds, initial=start_round, desc=self.name, unit="round",
                            dynamic_ncols=True, file=self.stream)

    def round_done(self, row: Mapping[str, object], seconds: float) -> None:
        """Show one finished round's figures (its metrics.jsonl row) and its ``seconds``
        (training, evaluation and writes)."""
        traffic = round_traffic(row)
        self.traffic += sum(traffic)
        if self.bar is not None:
            shown = [(key, row[key]) for key in ("test_acc", "val_acc") if isinstance(row.get(key), float)]
            self.bar.set_postfix({key: f"{value:.4f}" for key, value in shown[:1]}, refresh=False)
            self.bar.update(1)
        elif self.shown:
            print(round_line(row, self.rounds, traffic, self.traffic, seconds), file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def round_traffic(row: Mapping[str, object]) -> Tuple[float, float]:
    """MB down and up in a round (its metrics.jsonl row)."""
    return tuple(float(row.get(f"sum/bytes_{way}") or 0.0) / MB for way in ("down", "up"))


def round_line(row: Mapping[str, object], rounds: int, traffic_mb: tuple, total_mb: float, seconds: float) -> str:
    """``round R (done/rounds): train_loss=... <split>_acc=... MB_down=... MB_up=... MB_total=... seconds=...``."""
    figures = [("train_loss", row.get("train_loss"))]
    figures += [(f"{split}_{name}", row.get(f"{split}_{name}")) for split in ("val", "test") for name in HEADLINE]
    parts = [f"{key}={value:.4f}" for key, value in figures if isinstance(value, (int, float))]
    parts += [f"MB_down={traffic_mb[0]:.3g}", f"MB_up={traffic_mb[1]:.3g}", f"MB_total={total_mb:.4g}",
              f"seconds={seconds:.1f}"]
    return f"round {row['round']} ({int(row['round']) + 1}/{rounds}): " + " ".join(parts)


def end_line(summary: Mapping, path) -> str:
    """What the run came to, in one line, and where its summary is."""
    done, rounds = summary["rounds_done"], summary["rounds"]
    if done < rounds:
        return f"stopped after round {done - 1} ({done}/{rounds}); --resume auto continues; summary in {path}"
    parts = []
    final, best = summary.get("final", {}), summary.get("best", {})
    if isinstance(final.get("test_acc"), float):
        parts.append(f"last model test_acc={final['test_acc']:.4f}")
    if isinstance(best.get("test_acc"), float):
        parts.append(f"best-validation model (round {best['round']}) test_acc={best['test_acc']:.4f}")
    return f"done after {rounds} rounds: " + ", ".join(parts + [f"summary in {path}"])


__all__ = ["RoundProgress", "end_line", "round_line", "terminal_width"]
