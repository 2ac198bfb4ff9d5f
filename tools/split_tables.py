"""Tables of the split-FL comparison from saved multi-seed runs (``<root>/<method>_s<seed>``).

    python tools/split_tables.py runs/split/resnet18_narrow [more roots ...] [--reference fedsga]
        [--noise runs/split/resnet18_narrow_threads2]

Each root holds one setting (dataset, partition, backbone). Prints, per method, best (peak test accuracy over the evaluations) and final test accuracy
as mean +- std over seeds (Tables 2-4, Fig. 4), how many runs have levelled off (last three
evaluations within 1 point), paired per-seed differences against the
reference with the 95% interval of their mean and what it shows (a difference is a finding
only when the interval excludes zero), the split decisions (mean candidate index, share of client rounds at p1, share of
calibration labels that found p1 sufficient), and the client cost per client and round
(Table 5): activated client parameters, client forward+backward MACs, traffic both ways
(what crosses the cut plus the model exchange) and client wall time, and the run's totals;
with several roots, a final-accuracy table with a column per setting (Tables 2/3). ``--noise``
names a root of the same methods and seeds run under other arithmetic (e.g.
``--fabric.threads_per_rank 2``): the per-seed spread it prints is the noise floor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from submodel_tables import collect, finished_runs, print_before_after, print_noise_floor, print_paired, run_figures
from submodel_tables import pm as _pm

from fl_lightning.tool_parser import ToolParser


def pm(values, scale=100.0, digits=1) -> str:
    """mean +- std, or a dash for a figure the method does not have (a fixed cut, no labels)."""
    if all(np.isnan(v) for v in values):
        return "–"
    return _pm(values, scale, digits)


def whole_model_cost(config: dict) -> tuple[int, int]:
    """Parameters and forward MACs (fvcore, one example) of a run's whole model: what an FL
    client trains, where a split method logs its front's."""
    from fl_lightning.elastic.macs import count_macs
    from fl_lightning.elastic.models import build_model
    from fl_lightning.saved_configs import dataset_of, upgrade_tree

    config = upgrade_tree(config) or config  # a run saved with a named model or dataset
    model = config["model"]
    source, root = dataset_of(config)
    bundle = source.load(root, False, False)
    net = build_model(model, bundle.num_classes, bundle.input_shape)
    return sum(p.numel() for p in net.parameters()), count_macs(net, bundle.input_shape)


def cost_figures(run, whole=None) -> dict:
    """Per client and round: client parameters and forward+backward MACs (split methods log
    their front's; FL clients train ``whole``), traffic both ways (cut and model exchange),
    client wall time; the run's totals; and the split decisions."""
    rows = run["clients"]

    def mean(values):
        values = list(values)
        return float(np.mean(values)) if values else float("nan")
    if all("client_macs" in r for r in rows):
        params = [r["client_params"] for r in rows]
        macs = [r["client_macs"] for r in rows]
    else:  # an FL method: the whole model, forward and backward (3x) over every example of every epoch
        epochs = run["config"]["train"].get("epochs", 1)
        params = [whole[0]] * len(rows)
        macs = [3 * whole[1] * r["samples"] * epochs for r in rows]
    traffic = [r.get("bytes_up", 0) + r.get("bytes_down", 0) for r in rows]
    cuts = [r["cut"] for r in rows if "cut" in r]
    # calibration labels and probe losses: per round in metrics.jsonl (the server labels from
    # held-out probe examples); runs before that logged them per client
    calibrations = [m for m in run["metrics"] if "calibration/probe_loss_p1" in m]
    if calibrations:
        labels = [m["calibration/frac_sufficient"] for m in calibrations]
        probe_p1 = [m["calibration/probe_loss_p1"] for m in calibrations]
        probe_ref = [m["calibration/probe_loss_ref"] for m in calibrations]
    else:
        labels = [r["sufficient"] for r in rows if "sufficient" in r]
        probe_p1 = [r["probe_loss_p1"] for r in rows if "probe_loss_p1" in r]
        probe_ref = [r["probe_loss_ref"] for r in rows if "probe_loss_ref" in r]
    last = max((r["round"] for r in rows), default=0)
    return {"params": mean(params), "macs": mean(macs), "bytes": mean(traffic),
            "cut_hist": [mean(c == k for c in cuts) for k in range(3)],
            "probe_p1": mean(probe_p1), "probe_ref": mean(probe_ref),
            "prompt_norm": mean(r["prompt_norm"] for r in rows if "prompt_norm" in r and r["round"] == last),
            "seconds": mean(r.get("client_seconds", r.get("seconds", 0.0)) for r in rows),
            "total_macs": float(sum(macs)), "total_bytes": float(sum(traffic)),
            "cut": mean(cuts), "p1": mean(c == 0 for c in cuts), "sufficient": mean(labels)}


def print_probe_against_static(adaptive: dict, static: str = "fedsga_static") -> None:
    """Whether the p1 probe loss depends on how many clients the strategy sends to p1: each
    adaptive row's mean calibration probe loss at p1 minus the static strategy's (no client at
    p1) on the same seeds, with its share of client rounds at p1."""
    from submodel_tables import paired_interval, verdict

    if static not in adaptive:
        return
    print(f"\nProbe loss at p1 against {static} (no client at p1), paired over seeds (95% Student-t interval):\n")
    print("| method | at p1 | seeds | probe loss p1 minus static | finding |")
    print("| --- | --- | --- | --- | --- |")
    base = {s: c["probe_p1"] for s, c in adaptive[static].items()}
    for method, seeds in adaptive.items():
        common = sorted(s for s in set(seeds) & set(base) if np.isfinite(seeds[s]["probe_p1"]))
        if method == static or len(common) < 2:
            continue
        mean, half = paired_interval([seeds[s]["probe_p1"] - base[s] for s in common])
        share = np.mean([seeds[s]["p1"] for s in common])
        print(f"| {method} | {share:.2f} | {len(common)} | {mean:+.3f} ± {half:.3f} | {verdict(mean, half, static)} |")


def root_tables(root: Path, reference: str) -> dict:
    runs = collect(root)
    accuracy = {m: {s: run_figures(r) for s, r in seeds.items()} for m, seeds in runs.items()}
    whole = None
    if any(not all("client_macs" in row for row in r["clients"]) for seeds in runs.values() for r in seeds.values()):
        whole = whole_model_cost(next(iter(next(iter(runs.values())).values()))["config"])
    cost = {m: {s: cost_figures(r, whole) for s, r in seeds.items()} for m, seeds in runs.items()}
    print(f"### {root}\n")
    print("| method | seeds | best acc (%) | final acc (%) | levelled | mean cut index | at p1 | p1 sufficient |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for method, seeds in accuracy.items():
        vals, costs = list(seeds.values()), list(cost[method].values())
        print(f"| {method} | {len(vals)} | {pm([v['best'] for v in vals])} | {pm([v['final'] for v in vals])} | "
              f"{sum(v['levelled'] for v in vals)} of {len(vals)} | {pm([c['cut'] for c in costs], 1.0, 2)} | {pm([c['p1'] for c in costs], 1.0, 2)} | "
              f"{pm([c['sufficient'] for c in costs], 1.0, 2)} |")
    print_paired(accuracy, reference, "method")
    adaptive = {m: c for m, c in cost.items() if any(np.isfinite(x["probe_p1"]) for x in c.values())}
    if adaptive:
        print("\nSplit decisions (share of client rounds at each candidate), calibration probe losses and the "
              "clients' prompt norms in the last round:\n")
        print("| method | at p1 / p_ref / deepest | probe loss p1 | probe loss p_ref | p1 sufficient | prompt norm |")
        print("| --- | --- | --- | --- | --- | --- |")
        for method, seeds in adaptive.items():
            c = list(seeds.values())
            hist = " / ".join(f"{np.mean([x['cut_hist'][k] for x in c]):.2f}" for k in range(3))
            print(f"| {method} | {hist} | {pm([x['probe_p1'] for x in c], 1.0, 3)} | "
                  f"{pm([x['probe_ref'] for x in c], 1.0, 3)} | {pm([x['sufficient'] for x in c], 1.0, 2)} | "
                  f"{pm([x['prompt_norm'] for x in c], 1.0, 3)} |")
        print_probe_against_static(adaptive)
    print("\nClient cost per client and round (Table 5):\n")
    print("| method | client params (K) | client MACs (G) | traffic (MB) | client time (s) "
          "| run total client MACs (T) | run total traffic (GB) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for method, seeds in cost.items():
        c = list(seeds.values())
        print(f"| {method} | {pm([x['params'] for x in c], 1e-3, 1)} | {pm([x['macs'] for x in c], 1e-9, 2)} | "
              f"{pm([x['bytes'] for x in c], 1e-6, 2)} | {pm([x['seconds'] for x in c], 1.0, 3)} | "
              f"{pm([x['total_macs'] for x in c], 1e-12, 2)} | {pm([x['total_bytes'] for x in c], 1e-9, 2)} |")
    print()
    return accuracy


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", type=Path, nargs="+", help="one folder of <method>_s<seed> runs per setting")
    parser.add_argument("--reference", default="fedsga")
    parser.add_argument("--noise", type=Path, default=None,
                        help="the same methods and seeds under other arithmetic (noise floor of the first root)")
    parser.add_argument("--before", type=Path, default=None,
                        help="the same methods and seeds under an earlier protocol (beside the first root)")
    parser.add_argument("--before-label", default="the earlier protocol", help="what --before ran under")
    args = parser.parse_args(argv)
    for option, folder in [("roots", r) for r in args.roots] + [("--noise", args.noise), ("--before", args.before)]:
        if folder is not None and not folder.is_dir():
            parser.error(f"{option}: no folder at {folder}")
    for root in args.roots:  # refused before any table is printed
        methods = sorted({method for method, _, _ in finished_runs(root)})
        if args.reference not in methods:
            parser.error(f"--reference: no runs named {args.reference}_s<seed> under {root} "
                         f"(methods there: {', '.join(methods) or 'none'})")
    tables = {root: root_tables(root, args.reference) for root in args.roots}
    if args.noise is not None:
        other = {m: {s: run_figures(r) for s, r in seeds.items()} for m, seeds in collect(args.noise).items()}
        print_noise_floor(tables[args.roots[0]], other, "method")
    if args.before is not None:
        before = {m: {s: run_figures(r) for s, r in seeds.items()} for m, seeds in collect(args.before).items()}
        print_before_after(tables[args.roots[0]], before, "method", args.before_label)
    if len(tables) > 1:  # Tables 2/3: a column per setting (dataset, partition, backbone)
        methods = list(dict.fromkeys(m for t in tables.values() for m in t))
        print("### Final test accuracy (%) per setting\n")
        print("| method | " + " | ".join(r.name for r in tables) + " |")
        print("| --- |" + " --- |" * len(tables))
        for m in methods:
            cells = [pm([v["final"] for v in t[m].values()]) if m in t else "–" for t in tables.values()]
            print(f"| {m} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
