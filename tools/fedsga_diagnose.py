"""Do FedSGA's prompts leave batch-norm statistics the unprompted served model does not fit?

    python tools/fedsga_diagnose.py runs/split/r/fedsga_s0 [more runs ...] [--batches 2]

For each finished FedSGA run, the served model of its last checkpoint (docs/fedsga.md) is
scored on the test set three ways: with the running statistics training left; after
re-estimating every batch norm (backbone and harmonizer) on the clients' own training examples
without prompts; and after re-estimating them on the same examples with each client's prompt
applied, as training saw them. The two re-estimations differ only in the prompt, so their gap
is what the prompts do to the statistics; the first against them is what the running
statistics carry besides (the order of a shared server's clients, momentum 0.1).
Prints one row per run and the mean gaps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from fl_lightning.tool_parser import ToolParser


def client_batches(ctx, client: int, batches: int, batch_size: int, seed: int):
    """The first ``batches`` batches of a fixed shuffle of the client's shard (evaluation view)."""
    from fl_lightning.runtime.client_data import eval_batches

    indices = ctx.data.clients[client]
    order = indices[torch.randperm(len(indices), generator=torch.Generator().manual_seed(seed + client))]
    chosen = order[:batches * batch_size]
    return [x for x, _ in eval_batches(ctx.data.bundle.train_eval, chosen, batch_size, ctx.fabric.device)]


def diagnose(run: Path, batches: int, batch_size: int) -> dict:
    from fl_lightning.config import FabricConfig
    from fl_lightning.elastic.bn import recalibrate_bn
    from fl_lightning.modules.harmonizer import HarmonizedNetwork
    from fl_lightning.runtime.evaluation import evaluate
    from fl_lightning.cli.saved_runs import open_saved_run

    saved = open_saved_run(run, "last", FabricConfig(accelerator="cpu", devices=1, threads_per_rank=1))
    algorithm, ctx = saved.spec.algorithm, saved.ctx
    if not hasattr(algorithm, "prompts"):
        raise SystemExit(f"error: run: {run} is not a FedSGA run")
    cut, depth = algorithm.cuts[algorithm.eval_index], algorithm.eval_index
    served = HarmonizedNetwork(ctx.model, algorithm.harmonizer, cut, depth) if algorithm.harmonized else ctx.model
    dataset, indices = ctx.data.split("test")

    def score() -> float:
        return evaluate(ctx.fabric, served, dataset, indices, ctx.data.bundle.num_classes, 512)["acc"]

    saved_state = {k: v.clone() for k, v in served.state_dict().items()}
    out = {"running": score()}
    work = [(c, x) for c in range(ctx.num_clients) for x in client_batches(ctx, c, batches, batch_size, saved.spec.seed)]
    recalibrate_bn(served, [x for _, x in work])
    out["unprompted"] = score()
    served.load_state_dict(saved_state)
    front, back = ctx.model.split(cut)

    def prompted(item):
        client, x = item
        prompt = algorithm.store.get(client)["prompt"]
        z = algorithm.prompts.apply(front, prompt)(x)
        logits = back(z)
        if algorithm.harmonized:
            logits = logits + algorithm.harmonizer.head(algorithm.harmonizer.project(z, depth))
        return logits
    if algorithm.adaptation_channel:
        recalibrate_bn(served, work, forward=prompted)
        out["prompted"] = score()
    served.load_state_dict(saved_state)
    return out


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--batches", type=int, default=2, help="batches per client for each re-estimation")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    rows = {}
    print("| run | running statistics | re-estimated without prompts | re-estimated with prompts |")
    print("| --- | --- | --- | --- |")
    for run in args.runs:
        if not (run / "summary.json").exists():
            print(f"skipped {run}: not a finished run", file=sys.stderr)
            continue
        r = rows[run.name] = diagnose(run, args.batches, args.batch_size)
        print(f"| {run.name} | {100 * r['running']:.1f} | {100 * r['unprompted']:.1f} | "
              f"{100 * r['prompted']:.1f} |" if "prompted" in r else
              f"| {run.name} | {100 * r['running']:.1f} | {100 * r['unprompted']:.1f} | – |")
    if not rows:
        print("error: runs: none of the given folders is a finished run", file=sys.stderr)
        return 2
    both = [r for r in rows.values() if "prompted" in r]
    if both:
        gap = sum(r["unprompted"] - r["prompted"] for r in both) / len(both)
        print(f"\nmean (without prompts - with prompts): {100 * gap:+.2f} points over {len(both)} runs")
    if rows:
        gap = sum(r["unprompted"] - r["running"] for r in rows.values()) / len(rows)
        print(f"mean (re-estimated without prompts - running): {100 * gap:+.2f} points over {len(rows)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
