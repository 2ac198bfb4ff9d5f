"""Where post-hoc extraction lands relative to a variant cache, without a trained supernet.

    python tools/extraction_distances.py configs/caches/feast_cifar100.json --budgets 25e6 30e6 ...
    python tools/extraction_distances.py CACHE --budgets ... --space full --no-reuse-cache   # as published

For each budget it runs the search of ``python -m fl_lightning extract`` (the same settings,
derived from the cache: ``fl_lightning.algorithms.supernet.extraction_search``) and prints the architecture
found, its MACs, and how many genes (depths, expansions, widths, position by position) it
differs from the nearest cached variant; then the mean distance and how many budgets land
within 0 and 1 genes. The search is analytic, so this needs only the cache file (a cache of
the DeepFedNAS construction, as both shipped FEAST caches are).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fl_lightning.elastic.search.cache import VariantCache
from fl_lightning.elastic.search.cost import DeepFedNASArch
from fl_lightning.algorithms.supernet.extraction_search import (SPACES, extraction_architecture, extraction_search,
                                                    nearest_distance)
from fl_lightning.elastic.search.genetic import InfeasibleError
from fl_lightning.errors import ConfigError
from fl_lightning.feast_protocol import EXTRACTION_POPULATION, SEARCH_GENERATIONS
from fl_lightning.tool_parser import ToolParser


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def load_space(path: Path):
    """The cache and the search space it was built for (the DeepFedNAS construction)."""
    cache = VariantCache.load(path, key="cache")
    if cache.model_options.get("construction") != "deepfednas":
        raise ConfigError("cache", f"{path}: not a cache of the DeepFedNAS construction (its model options "
                                   "hold no 'construction: deepfednas'); extract on a run measures other caches")
    return cache, DeepFedNASArch.from_dict(cache.model_options)


def distances(cache, space, budgets, population, generations, rho=None, seed=None, where="trained",
              reuse_cache=True) -> list:
    """One row per budget: budget, ceiling, spec, MACs, genes from the nearest cached variant,
    whether the cache answered (None for spec and genes when the search finds nothing)."""
    rows = []
    for budget in budgets:
        settings = extraction_search(cache, budget, rho, seed, where, reuse_cache)
        try:
            found, answered = extraction_architecture(space, cache, budget, settings, population, generations)
        except InfeasibleError:
            rows.append({"budget": budget, "rho": settings.rho_limit, "spec": None, "macs": None, "genes": None,
                         "answered": False})
            continue
        rows.append({"budget": budget, "rho": settings.rho_limit, "spec": found.spec, "macs": found.macs,
                     "genes": nearest_distance(found.spec, cache.specs), "answered": answered is not None})
    return rows


def table(rows) -> str:
    lines = [f"{'budget':>9} {'rho_0':>5} {'MACs':>9} {'genes':>5}  architecture"]
    for r in rows:
        if r["spec"] is None:
            lines.append(f"{r['budget'] / 1e6:8.2f}M {r['rho']:5.2f} {'-':>9} {'-':>5}  (no architecture found)")
            continue
        note = "  (cached variant, no search)" if r["answered"] else ""
        lines.append(f"{r['budget'] / 1e6:8.2f}M {r['rho']:5.2f} {r['macs'] / 1e6:8.2f}M {r['genes']:>5}  "
                     f"{r['spec']}{note}")
    found = [r["genes"] for r in rows if r["genes"] is not None]
    if found:
        lines.append(f"{len(found)} of {len(rows)} budgets found: mean {sum(found) / len(found):.2f} genes from "
                     f"the nearest cached variant; {sum(g == 0 for g in found)} at 0 genes, "
                     f"{sum(g <= 1 for g in found)} within 1 gene")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", type=Path, help="variant cache (JSON)")
    parser.add_argument("--budgets", type=positive, nargs="+", required=True, help="MAC limits")
    parser.add_argument("--population", type=int, default=EXTRACTION_POPULATION)
    parser.add_argument("--generations", type=int, default=SEARCH_GENERATIONS)
    parser.add_argument("--rho", type=positive, default=None, help="ceiling (default: the cache's at each budget)")
    parser.add_argument("--seed", type=int, default=None, help="search seed (default: the cache's)")
    parser.add_argument("--space", choices=SPACES, default="trained")
    parser.add_argument("--no-reuse-cache", dest="reuse_cache", action="store_false",
                        help="random start only, no cached answers (the search as Supp. E.3 states it)")
    args = parser.parse_args(argv)
    if args.population < 2 or args.generations < 1:
        parser.error("--population: needs >= 2 and --generations >= 1")
    try:
        cache, space = load_space(args.cache)
    except ConfigError as error:
        parser.error(str(error))
    rows = distances(cache, space, args.budgets, args.population, args.generations, args.rho, args.seed,
                     args.space, args.reuse_cache)
    print(f"{args.cache}: {len(cache)} cached variants, {cache.macs[0] / 1e6:.2f}M-{cache.macs[-1] / 1e6:.2f}M "
          f"MACs; space {args.space}, {'reusing' if args.reuse_cache else 'not reusing'} the cache")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
