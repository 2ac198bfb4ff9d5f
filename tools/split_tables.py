"""Tables of the split-FL comparison from saved multi-seed runs (``<root>/<method>_s<seed>``).

    python tools/split_tables.py runs/split/resnet18_narrow [--reference fedsga]

Prints, per method, best (peak test accuracy over the evaluations) and final test accuracy
as mean +- std over seeds (Tables 2-4, Fig. 4), paired per-seed differences against the
reference, the split decisions (mean candidate index, share of client rounds at p1, share of
calibration labels that found p1 sufficient), and the client cost per client and round
(Table 5): activated client parameters, client forward+backward MACs, bytes across the cut
(both ways) and client wall time, and the run's totals of client MACs and cut traffic.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from submodel_tables import collect, pm, print_paired, run_figures


def cost_figures(run) -> dict:
    rows = run["clients"]

    def mean(key):
        values = [r[key] for r in rows if key in r]
        return float(np.mean(values)) if values else float("nan")
    labels = [r["sufficient"] for r in rows if "sufficient" in r]
    return {"params": mean("client_params"), "macs": mean("client_macs"),
            "bytes": float(np.mean([r["cut_bytes_up"] + r["cut_bytes_down"] for r in rows])),
            "seconds": mean("client_seconds"), "cut": mean("cut") if any("cut" in r for r in rows) else float("nan"),
            "p1": float(np.mean([r["cut"] == 0 for r in rows if "cut" in r])) if any("cut" in r for r in rows)
            else float("nan"),
            "sufficient": float(np.mean(labels)) if labels else float("nan"),
            "total_macs": float(sum(r.get("client_macs", 0) for r in rows)),
            "total_bytes": float(sum(r["cut_bytes_up"] + r["cut_bytes_down"] for r in rows))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--reference", default="fedsga")
    args = parser.parse_args(argv)
    runs = collect(args.root)
    accuracy = {m: {s: run_figures(r) for s, r in seeds.items()} for m, seeds in runs.items()}
    cost = {m: {s: cost_figures(r) for s, r in seeds.items()} for m, seeds in runs.items()}
    print(f"### {args.root}\n")
    print("| method | seeds | best acc (%) | final acc (%) | mean cut index | at p1 | p1 sufficient |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for method, seeds in accuracy.items():
        vals, costs = list(seeds.values()), list(cost[method].values())
        print(f"| {method} | {len(vals)} | {pm([v['best'] for v in vals])} | {pm([v['final'] for v in vals])} | "
              f"{pm([c['cut'] for c in costs], 1.0, 2)} | {pm([c['p1'] for c in costs], 1.0, 2)} | "
              f"{pm([c['sufficient'] for c in costs], 1.0, 2)} |")
    print_paired(accuracy, args.reference, "method")
    print("\nClient cost per client and round (Table 5):\n")
    print("| method | client params (K) | client MACs (G) | cut traffic (MB) | client time (s) "
          "| run total client MACs (T) | run total cut traffic (GB) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for method, seeds in cost.items():
        c = list(seeds.values())
        print(f"| {method} | {pm([x['params'] for x in c], 1e-3, 1)} | {pm([x['macs'] for x in c], 1e-9, 2)} | "
              f"{pm([x['bytes'] for x in c], 1e-6, 2)} | {pm([x['seconds'] for x in c], 1.0, 3)} | "
              f"{pm([x['total_macs'] for x in c], 1e-12, 2)} | {pm([x['total_bytes'] for x in c], 1e-9, 2)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
