"""Write ``partition.pt`` back into run folders that were archived without it.

    python tools/restore_partitions.py RUN [RUN ...]

The archives under ``docs/data/runs`` keep a run's text (config, metrics, summary, caches) and
leave the binary partition out. The partition is a pure function of the saved config and seed,
so it is rebuilt here exactly as ``fit`` built it, and the table tools can read the run again.
A folder that already holds ``partition.pt`` is left as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fl_lightning.data.federated import build_federated_data
from fl_lightning.runtime.checkpoint import save_checkpoint
from fl_lightning.cli.saved_runs import load_run_spec
from fl_lightning.tool_parser import ToolParser


def restore(run: Path) -> bool:
    """Rebuild ``run/partition.pt``; False when it was already there."""
    target = run / "partition.pt"
    if target.exists():
        return False
    spec = load_run_spec(run)
    save_checkpoint(build_federated_data(spec.data, spec.partition, spec.seed).state_dict(), target)
    return True


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for run in args.runs:
        print(f"{run}: {'restored' if restore(run) else 'kept (partition.pt present)'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
