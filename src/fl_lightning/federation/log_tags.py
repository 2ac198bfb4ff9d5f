"""What the loggers call a run's figures: tags grouped by what they measure.

``metrics.jsonl`` keeps the loop's own keys (``train_loss``, ``val_acc``, ``sum/bytes_down``...),
which the tools read. The loggers (TensorBoard, CSV, W&B, MLflow) receive the same figures
under tags whose first part is the group a reader looks for, so that TensorBoard shows one
section per group:

- ``train/``: loss, learning rate.
- ``val/``, ``test/``: the evaluated figures. ``<split>/served/<name>``: the accuracy of each
  model a method serves (FEAST's cached variants, HeteroFL's tiers, ScaleFL's levels, FedSGA's
  cuts), named by the method (``Algorithm.served_names``, by their MACs) or else by its key.
  ``test/best/``: the best-validation checkpoint's headline test figures, at the round it was saved.
- ``traffic/``: MB (10^6 bytes) down and up per round, and ``_cumulative`` since round 0.
- ``compute/``: training GMACs (10^9 MACs) per round and cumulative, samples, steps.
- ``clients/``: the cohort, the skipped clients, other client figures summed over the cohort.
- ``time/``: seconds of the round, of its slowest client, of all its clients together.
- ``method/``: whatever else a method reports (``finish_round``'s figures).

A figure a method adds finds its group by its key alone. The custom-scalars ``LAYOUT`` overlays
on one chart what the per-tag cards cannot: the served models, the splits' accuracy and loss,
the cumulative costs.
"""

from __future__ import annotations

import math
import re
from typing import Dict, Iterable, Mapping, Optional, Tuple

SPLITS = ("train", "val", "test")
# one served model's accuracy, as the methods' evaluation names it: variant03_acc, level2_acc, acc_cut1
SERVED = re.compile(r"^(?:(?P<stem>[a-z_]*?\d+)_acc|acc_(?P<cut>[a-z_]*?\d+))$")
TRAINING_MACS = ("train_macs", "client_macs")
"""Client figures that count training compute: summed over the rounds as well as per round."""
TOP_LEVEL = {"lr": "train/lr", "round_seconds": "time/round_seconds", "client_seconds_max": "time/client_seconds_max",
             "clients": "clients/cohort", "clients_skipped": "clients/skipped"}
MB, GMACS = 1e6, 1e9

LAYOUT = {
    "accuracy and loss": {
        "accuracy": ["Multiline", [r"^(val|test)/acc$", r"^test/best/acc$"]],
        "loss": ["Multiline", [r"^(train|val|test)/loss$"]],
    },
    "served models": {
        "validation accuracy of each served model": ["Multiline", [r"^val/served/"]],
        "test accuracy of each served model": ["Multiline", [r"^test/served/"]],
    },
    "cost": {
        "cumulative traffic (MB)": ["Multiline", [r"^traffic/.*_cumulative$"]],
        "cumulative training compute (GMACs)": ["Multiline", [r"^compute/.*_cumulative$"]],
    },
}
"""TensorBoard's custom-scalars layout: {category: {chart: ["Multiline", [tag regex, ...]]}}."""


def tag_name(text: str) -> str:
    """``text`` in the characters a TensorBoard tag keeps ([-/\\w.]; others become '_')."""
    return re.sub(r"[^-\w.]+", "_", text).strip("_")


class RunTags:
    """The tags of one run's figures, and the cumulative costs carried from round to round.

    ``served_names``: ``{evaluation figure key: display name}`` of the models the method serves
    (``{"variant03_acc": "variant03 4.46M MACs"}``); a served figure without a name keeps its key.
    """

    def __init__(self, served_names: Optional[Mapping[str, str]] = None):
        self.served_names = dict(served_names or {})
        self.totals: Dict[str, float] = {}

    def tag(self, key: str) -> Tuple[str, float]:
        """``(tag, scale)`` of a metrics.jsonl key: the logged value is the row's times ``scale``."""
        if key in TOP_LEVEL:
            return TOP_LEVEL[key], 1.0
        if key.startswith("sum/"):
            return _summed(key[4:])
        split, _, rest = key.partition("_")
        if split in SPLITS and rest:
            return self._evaluated(split, rest), 1.0
        return f"method/{key}", 1.0

    def _evaluated(self, split: str, key: str) -> str:
        match = SERVED.match(key)
        if key in self.served_names or (match and split != "train"):
            name = self.served_names.get(key) or match.group("stem") or match.group("cut")
            return f"{split}/served/{tag_name(name)}"
        return f"{split}/{key}"

    def figures(self, row: Mapping[str, object]) -> Dict[str, float]:
        """The row's numeric figures (not ``round``; NaN and inf kept) by tag."""
        out = {}
        for key, value in row.items():
            if key == "round" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            tag, scale = self.tag(key)
            out[tag] = value * scale if scale != 1.0 else value
        return out

    def round_figures(self, row: Mapping[str, object]) -> Dict[str, float]:
        """A round's figures by tag, with the cumulative traffic and training compute after it."""
        out = self.figures(row)
        for key, value in row.items():
            if _cumulative(key) and isinstance(value, (int, float)) and math.isfinite(value):
                tag, scale = self.tag(key)
                self.totals[tag] = self.totals.get(tag, 0.0) + value * scale
                out[f"{tag}_cumulative"] = self.totals[tag]
        return out

    def carry(self, rows: Iterable[Mapping[str, object]]) -> None:
        """Start the cumulative figures from the rounds already run (a resumed run's rows)."""
        for row in rows:
            self.round_figures(row)

    def best(self, figures: Mapping[str, object]) -> Dict[str, float]:
        """The best-validation checkpoint's test figures under ``test/best/``, but each served
        model's (one point each; summary.json holds them)."""
        tests = self.figures({k: v for k, v in figures.items() if k.startswith("test_")})
        return {f"test/best/{tag[len('test/'):]}": value for tag, value in tests.items()
                if not tag.startswith("test/served/")}


def _summed(key: str) -> Tuple[str, float]:
    """The tag of a client figure summed over the cohort (``sum/<key>``)."""
    if "bytes" in key:
        return f"traffic/{re.sub(r'_?bytes_?', '_', key).strip('_')}_MB", 1 / MB
    if "macs" in key:
        return f"compute/{key.replace('macs', 'GMACs')}", 1 / GMACS
    if key in ("samples", "steps"):
        return f"compute/{key}", 1.0
    if "seconds" in key:
        return f"time/client_{key}_sum", 1.0
    return f"clients/{key}_sum", 1.0


def _cumulative(key: str) -> bool:
    return key.startswith("sum/") and ("bytes" in key or key[4:] in TRAINING_MACS)


__all__ = ["LAYOUT", "RunTags", "tag_name"]
