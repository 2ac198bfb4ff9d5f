"""Where a run writes: config, metrics, TensorBoard events, checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

from fl_lightning.errors import ConfigError

LAST, BEST = "last.ckpt", "best.ckpt"


class RunDir:
    """``<out_dir>/<name>/`` with ``config.yaml``, ``metrics.jsonl``, ``clients.jsonl``,
    ``tensorboard/``, ``checkpoints/{last,best}.ckpt``, ``partition.pt`` and ``summary.json``."""

    def __init__(self, out_dir: str, name: str):
        self.path = Path(out_dir) / name
        self.checkpoints = self.path / "checkpoints"
        self.last = self.checkpoints / LAST
        self.best = self.checkpoints / BEST
        self.metrics = self.path / "metrics.jsonl"
        self.clients = self.path / "clients.jsonl"
        self.summary = self.path / "summary.json"

    def resolve_resume(self, resume: Optional[str]) -> Optional[Path]:
        """The checkpoint to continue from, or None for a fresh run; refuses to overwrite."""
        if resume is None:
            if self.last.exists():
                raise ConfigError("name", f"{self.path} already holds a run; pass --resume auto to continue it "
                                          "or choose another --name")
            return None
        if resume == "auto":
            return self.last if self.last.exists() else None
        path = Path(resume)
        if not path.is_file():
            raise ConfigError("resume", f"no checkpoint file at {path}")
        return path

    def create(self) -> None:
        self.checkpoints.mkdir(parents=True, exist_ok=True)


class JsonLines:
    """Append-only JSON-lines file; on resume, rows at or after the resumed round are dropped
    so the file reads as one uninterrupted run."""

    def __init__(self, path: Path, keep_before_round: Optional[int] = None):
        self.path = path
        if keep_before_round is not None and path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            self._rewrite(r for r in rows if r.get("round", -1) < keep_before_round)
        elif path.exists():
            path.unlink()

    def _rewrite(self, rows: Iterable[dict]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(self.path)

    def write(self, row: dict) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row) + "\n")
