"""Find run seeds whose FEAST CIFAR-100 population has the paper's published statistics.

    python tools/population_seed_search.py --seeds 0 2000000
    python tools/population_seed_search.py --cache configs/caches/feast_cifar100.json --seeds 0 100000

A run's seed draws the client budgets (Supp. A, Eq. 1-2), the server split and the
gamma-Dirichlet partition (Eq. 4-8). For every seed in ``[first, last)`` the budgets are drawn as
a run draws them; seeds with the published budget statistics (clients affording 1 / 2 / >= 3
cached variants: 31 / 6 / 63, Supp. E.4; 32 clients below 35M MACs, E.1) get their partition of
CIFAR-100's 45,000 client examples (450 per class after the stratified server split) drawn,
and are ranked by how close their shard-size range comes to the published 36-1906 (F.5).

Ties are broken by the number of clients routing the least-reachable position, closest to the
published R_min = 11 (F.5; needs a cache JSON, whose architectures define the envelopes), then
by the smaller seed.

``--cache`` gives the cached MACs that decide affordability: a cache JSON (tools/build_cache.py)
or a CSV with a ``macs`` column. The default is the cache of FEAST's supernet in DeepFedNAS's
MAC convention (``tests/data/feast_cifar100_deepfednas_cache.json``, built analytically, see
docs/variant_cache.md); only its three cheapest variants matter for the counts.
``--only`` reports the given seeds instead of scanning.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path

import torch

from fl_lightning.algorithms.supernet.feast_accounting import least_reachable_clients
from fl_lightning.analysis.population import PAPER_CIFAR100_POPULATION, search_population_seeds
from fl_lightning.elastic.models.ofa_resnet import OFAResNet
from fl_lightning.elastic.search.cache import OPTION_DEFAULTS, VariantCache
from fl_lightning.elastic.search.cost import DeepFedNASArch, cost_model
from fl_lightning.tool_parser import ToolParser

DEFAULT_CACHE = Path(__file__).resolve().parent.parent / "tests" / "data" / "feast_cifar100_deepfednas_cache.json"


def load_cache(path: Path):
    """(cached MACs, R_min as a function of the budgets or None)."""
    if path.suffix == ".csv":
        with path.open() as f:
            return [float(row["macs"]) for row in csv.DictReader(f)], None
    cache = VariantCache.load(path)
    options = dict(cache.model_options)
    if options.get("construction") == "deepfednas":
        space = DeepFedNASArch.from_dict(options)
    else:
        with torch.device("meta"):  # files older than an option hold its value then
            space = OFAResNet(**{**OPTION_DEFAULTS, **options})
    cost = cost_model(space, cache.input_shape)
    genes = cost.encode_many(cache.specs)
    return cache.macs, lambda budgets: least_reachable_clients(cache, budgets, genes, cost.num_stages)


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="cache JSON or CSV with a macs column")
    parser.add_argument("--seeds", type=int, nargs=2, default=(0, 200000), metavar=("FIRST", "LAST"),
                        help="scan seeds FIRST..LAST-1")
    parser.add_argument("--only", type=int, nargs="+", default=None, help="report these seeds instead")
    parser.add_argument("--stop-after-exact", type=int, default=None,
                        help="stop once this many seeds match every statistic exactly")
    parser.add_argument("--top", type=int, default=10, help="matches to print")
    parser.add_argument("--json", type=Path, default=None, help="also write the matches here")
    args = parser.parse_args(argv)

    macs, reach = load_cache(args.cache)
    macs = sorted(macs)
    target = PAPER_CIFAR100_POPULATION
    print(f"cache {args.cache} ({len(macs)} variants, cheapest {', '.join(f'{m / 1e6:.2f}M' for m in macs[:3])})")
    print(f"target: afford 1/2/>=3 = {'/'.join(map(str, target.afford))}, {target.below} clients below "
          f"{target.below_macs / 1e6:g}M, shards {target.shard_min}-{target.shard_max}, "
          f"R_min {target.least_reachable}")
    seeds = args.only if args.only is not None else range(*args.seeds)
    what = f"the {len(seeds)} given seeds" if args.only is not None else f"seeds of [{args.seeds[0]}, {args.seeds[1]})"
    start = time.perf_counter()
    matches = search_population_seeds(macs, seeds, target, stop_after_exact=args.stop_after_exact,
                                      least_reachable=reach)
    seconds = time.perf_counter() - start
    exact = [m for m in matches if m.distance(target) == 0]
    print(f"{len(matches)} {what} match the budget statistics, {len(exact)} the shard range too ({seconds:.0f} s)")
    print(f"{'seed':>9}  afford    below  shards     R_min  distance")
    for m in matches[:args.top]:
        reach_text = "-" if m.least_reachable is None else str(m.least_reachable)
        print(f"{m.seed:>9}  {'/'.join(map(str, m.afford)):8}  {m.below:>5}  {m.shard_min:>4}-{m.shard_max:<5}  "
              f"{reach_text:>5}  {m.distance(target):.4f}")
    if matches:
        print(f"chosen seed: {matches[0].seed}")
    if args.json is not None:
        args.json.write_text(json.dumps([m._asdict() for m in matches], indent=1) + "\n")
    return 0 if matches else 1


if __name__ == "__main__":
    sys.exit(main())
