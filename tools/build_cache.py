"""Build FEAST's fixed variant cache for one supernet configuration and write it as JSON.

    python tools/build_cache.py --output configs/caches/feast_cifar100.json
    python tools/build_cache.py --input-shape 3 64 64 --num-classes 200 --output tin.json
    python tools/build_cache.py --model-kwargs '{"width_scale": 0.25, "divisor": 4}' \\
        --num-classes 10 --segments '[[2e6, 60e6, 8, 0.6]]' --population 64 --generations 64 \\
        --output /tmp/small.json
    python tools/build_cache.py --construction deepfednas --output feast_cifar100_deepfednas.json

``--construction ofa_resnet`` (default) searches the ``ofa_resnet`` supernet built with
``--model-kwargs``: its default ``block`` is ``basic_pair`` (FEAST's construction, MACs in
DeepFedNAS's convention, the paper's); ``{"block": "bottleneck"}`` gives the bottleneck
construction with MACs in fvcore's convention. ``deepfednas`` searches the DeepFedNAS
construction directly (``elastic.search.cost.DeepFedNASArch``, its fields in ``--model-kwargs``),
with the same MACs as ``basic_pair``; it needs no model: the search is analytic.

Segments are ``paper`` (Supp. Table 1: 50M-596M x 50 at rho_0 = 0.31 and 25M-75M x 6 at 0.40)
or a JSON list of ``[low, high, count, rho0]``. Prints the cache as a table and the time taken.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from fl_lightning.elastic.models import build_model
from fl_lightning.elastic.search import DeepFedNASArch, FitnessConfig, build_cache, cost_model
from fl_lightning.errors import ConfigError
from fl_lightning.feast_protocol import CACHE_SEGMENTS, SEARCH_GENERATIONS, SEARCH_POPULATION
from fl_lightning.elastic.models import OFAResNet
from fl_lightning.tool_parser import ToolParser


def parse_segments(text: str) -> list[tuple[float, float, int, float]]:
    if text == "paper":
        return list(CACHE_SEGMENTS)
    try:
        rows = json.loads(text)
        segments = [(float(lo), float(hi), int(n), float(rho)) for lo, hi, n, rho in rows]
    except (ValueError, TypeError) as err:
        raise ConfigError("--segments", f"expected 'paper' or a JSON list of [low, high, count, rho0], "
                                        f"got {text!r} ({err})") from None
    if not segments:
        raise ConfigError("--segments", "need at least one segment")
    return segments


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("--construction", choices=("ofa_resnet", "deepfednas"), default="ofa_resnet",
                        help="supernet construction and its MAC convention (fvcore / DeepFedNAS's)")
    parser.add_argument("--model-kwargs", default="{}",
                        help="ofa_resnet options, or DeepFedNASArch fields, as JSON")
    parser.add_argument("--input-shape", type=int, nargs=3, default=(3, 32, 32), metavar=("C", "H", "W"))
    parser.add_argument("--num-classes", type=int, default=100)
    parser.add_argument("--segments", default="paper", help="'paper' or JSON [[low, high, count, rho0], ...]")
    parser.add_argument("--spacing", choices=("linear", "geometric"), default="linear",
                        help="target budgets within a segment")
    parser.add_argument("--population", type=int, default=SEARCH_POPULATION)
    parser.add_argument("--generations", type=int, default=SEARCH_GENERATIONS)
    parser.add_argument("--mutation", type=float, default=0.3)
    parser.add_argument("--tournament", type=int, default=3)
    parser.add_argument("--elitism", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fitness-layers", choices=("deepfednas", "bottleneck"), default="deepfednas",
                        help="convs that enter the entropy and rho (docs/variant_cache.md)")
    parser.add_argument("--output", required=True, help="JSON file to write")
    parser.add_argument("--quiet", action="store_true", help="no per-target progress lines")
    args = parser.parse_args(argv)

    try:
        kwargs = json.loads(args.model_kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError("not a JSON object")
        segments = parse_segments(args.segments)
        if args.construction == "deepfednas":
            model = DeepFedNASArch(num_classes=args.num_classes, input_shape=tuple(args.input_shape), **kwargs)
        else:
            with torch.device("meta"):  # only the channel arithmetic is needed, not the weights
                model = build_model(OFAResNet, args.num_classes, args.input_shape, **kwargs)
        if args.fitness_layers not in cost_model(model).layer_accountings:
            # the bottleneck accounting needs the bottleneck block
            raise ValueError(f"--fitness-layers {args.fitness_layers} does not apply to this construction "
                             f"(ofa_resnet needs --model-kwargs '{{\"block\": \"bottleneck\"}}')")
    except (ValueError, TypeError) as err:  # ConfigError included
        print(f"error: {err}", file=sys.stderr)
        return 2

    def progress(k, total, variant):
        if not args.quiet:
            info = variant.info
            print(f"[{k + 1:>3}/{total}] target {info['target'] / 1e6:8.2f}M (rho <= {info['rho_limit']:g}): "
                  f"{variant.macs / 1e6:8.2f}M MACs  rho {info['rho']:.3f}  {variant.spec}", flush=True)

    start = time.perf_counter()
    cache = build_cache(model, args.input_shape, segments, args.population, args.generations, args.mutation,
                        args.seed, args.spacing, args.tournament, args.elitism,
                        FitnessConfig(layers=args.fitness_layers), progress=progress)
    seconds = time.perf_counter() - start
    cache.save(args.output)
    print(cache.table())
    print(f"{len(cache)} variants ({cache.search['duplicates']} duplicate targets merged), "
          f"{cache.macs[0] / 1e6:.2f}M-{cache.macs[-1] / 1e6:.2f}M MACs, "
          f"built in {seconds:.1f} s; wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
