"""Find run seeds whose FEAST CIFAR-100 population has the paper's published statistics.

    python tools/population_seed_search.py --seeds 0 2000000
    python tools/population_seed_search.py --cache configs/caches/feast_cifar100.json --seeds 0 100000

A run's seed draws the client budgets (Supp. A, Eq. 1-2), the server split and the
gamma-Dirichlet partition (Eq. 4-8). For every seed in ``[first, last)`` the budgets are drawn as
a run draws them; seeds with the published budget statistics (clients affording 1 / 2 / >= 3
cached variants: 31 / 6 / 63, Supp. E.4; 32 clients below 35M MACs, E.1) get their partition of
CIFAR-100's 45,000 client examples (450 per class after the stratified server split) drawn,
and are ranked by how close their shard-size range comes to the published 36-1906 (F.5).

``--cache`` gives the cached MACs that decide affordability: a cache JSON (tools/build_cache.py)
or a CSV with a ``macs`` column. The default is the cache of FEAST's supernet in DeepFedNAS's
MAC convention (``tests/data/feast_cifar100_deepfednas_cache.json``, built analytically, see
docs/variant_cache.md); only its three cheapest variants matter for the counts.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

from fl_lightning.data.budgets import PAPER_CIFAR100_POPULATION, search_population_seeds

DEFAULT_CACHE = Path(__file__).resolve().parent.parent / "tests" / "data" / "feast_cifar100_deepfednas_cache.json"


def cache_macs(path: Path) -> list[float]:
    if path.suffix == ".csv":
        with path.open() as f:
            return [float(row["macs"]) for row in csv.DictReader(f)]
    return [float(v["macs"]) for v in json.loads(path.read_text())["variants"]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="cache JSON or CSV with a macs column")
    parser.add_argument("--seeds", type=int, nargs=2, default=(0, 200000), metavar=("FIRST", "LAST"),
                        help="scan seeds FIRST..LAST-1")
    parser.add_argument("--stop-after-exact", type=int, default=None,
                        help="stop once this many seeds match every statistic exactly")
    parser.add_argument("--top", type=int, default=10, help="matches to print")
    parser.add_argument("--json", type=Path, default=None, help="also write the matches here")
    args = parser.parse_args(argv)

    macs = sorted(cache_macs(args.cache))
    target = PAPER_CIFAR100_POPULATION
    print(f"cache {args.cache} ({len(macs)} variants, cheapest {', '.join(f'{m / 1e6:.2f}M' for m in macs[:3])})")
    print(f"target: afford 1/2/>=3 = {'/'.join(map(str, target.afford))}, {target.below} clients below "
          f"{target.below_macs / 1e6:g}M, shards {target.shard_min}-{target.shard_max}")
    start = time.perf_counter()
    matches = search_population_seeds(macs, range(*args.seeds), target, stop_after_exact=args.stop_after_exact)
    seconds = time.perf_counter() - start
    exact = [m for m in matches if m.distance(target) == 0]
    print(f"{len(matches)} seeds of [{args.seeds[0]}, {args.seeds[1]}) match the budget statistics, "
          f"{len(exact)} the shard range too ({seconds:.0f} s)")
    print(f"{'seed':>9}  afford    below  shards     distance")
    for m in matches[:args.top]:
        print(f"{m.seed:>9}  {'/'.join(map(str, m.afford)):8}  {m.below:>5}  {m.shard_min:>4}-{m.shard_max:<5}  "
              f"{m.distance(target):.4f}")
    if args.json is not None:
        args.json.write_text(json.dumps([m._asdict() for m in matches], indent=1) + "\n")
    return 0 if matches else 1


if __name__ == "__main__":
    sys.exit(main())
