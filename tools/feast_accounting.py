"""FEAST's communication, computation and footprint accounting for a config, without its
dataset, next to the paper's figures.

    python tools/feast_accounting.py configs/feast_cifar100.yaml [--pool 45000 --classes 100]
    python tools/feast_accounting.py configs/feast_cifar100.yaml --deepfednas --seed 8854 --seeds 3000

Budgets come from the config and seed (``--seed`` overrides it) exactly as in a run. Communication
and footprints need only budgets, cache and supernet; the training-computation figure needs
shard sizes, which are taken from the gamma-Dirichlet partition of a balanced label vector of
the pool's size (for CIFAR-100 after the stratified server split, 450 per class, these are the
run's sizes exactly: the partition depends on class sizes only).

By default the supernet is the config's model and the cache its file (MACs in fvcore's
convention). ``--deepfednas`` uses instead the DeepFedNAS construction in DeepFedNAS's MAC
convention (the paper's; ``elastic.search.cost.FEAST_DEEPFEDNAS``) and ``--cache`` (default: its
analytic cache ``tests/data/feast_cifar100_deepfednas_cache.json``); parameters, routed
envelopes included, come from the cost model, no module is built. ``--seeds N`` adds the mean
and std of the mean routed parameters and the traffic reduction over population seeds 0..N-1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fl_lightning.algorithms.supernet import feast_accounting as acc
from fl_lightning.cli import build_parser
from fl_lightning.data.budgets import zipf_budgets
from fl_lightning.data.partition import alpha_data_for, make_partition
from fl_lightning.elastic.envelope import full_param_count
from fl_lightning.elastic.models import build_model
from fl_lightning.elastic.search.cache import VariantCache
from fl_lightning.elastic.search.cost import FEAST_DEEPFEDNAS, cost_model
from fl_lightning.tool_parser import ToolParser

DEEPFEDNAS_CACHE = Path(__file__).resolve().parent.parent / "tests" / "data" / "feast_cifar100_deepfednas_cache.json"


def main() -> None:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--pool", type=int, default=45000, help="client-training examples")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--input-shape", type=int, nargs=3, default=[3, 32, 32])
    parser.add_argument("--seed", type=int, default=None, help="population seed (default: the config's)")
    parser.add_argument("--seeds", type=int, default=0, help="also summarize population seeds 0..N-1")
    parser.add_argument("--deepfednas", action="store_true",
                        help="the DeepFedNAS construction and MAC convention, analytically")
    parser.add_argument("--cache", type=Path, default=None, help="cache file (default: the config's, or "
                        "with --deepfednas the analytic DeepFedNAS-convention cache)")
    args = parser.parse_args()
    cli = build_parser()
    run = cli.instantiate(cli.parse_args(["fit", "--config", args.config])).fit
    seed = run.seed if args.seed is None else args.seed
    algorithm = run.algorithm
    if args.deepfednas:
        space = FEAST_DEEPFEDNAS.at_input(tuple(args.input_shape), args.classes)
        cost = cost_model(space)
        cache = VariantCache.load(args.cache or DEEPFEDNAS_CACHE, space)
        routed = acc.analytic_routed_counter(cost, cache)
        full = cost.full_params()
        footprints = acc.analytic_footprints(cost, cache, acc.default_anchors(cache.macs))
        space_cost = cost
        what = f"DeepFedNAS construction, DeepFedNAS MACs, analytic parameters; cache {args.cache or DEEPFEDNAS_CACHE}"
    else:
        model = build_model(run.model, args.classes, tuple(args.input_shape))
        cache = VariantCache.load(args.cache or algorithm.cache_path)
        if algorithm.retarget:
            cache = cache.retarget(model, tuple(args.input_shape))
        routed = acc.model_routed_counter(model, cache)
        full = full_param_count(model)
        footprints = acc.parameter_footprints(model, cache, acc.default_anchors(cache.macs))
        space_cost = cost_model(model, tuple(args.input_shape))
        what = f"model {type(model).__name__}, fvcore MACs; cache {args.cache or algorithm.cache_path}"
    p = run.partition
    b = p.budgets
    budgets = zipf_budgets(p.num_clients, seed, s=b.zipf_s, b_min=b.b_min, b_max=b.b_max)
    targets = torch.arange(args.pool) % args.classes
    alpha = alpha_data_for(p.alpha_eff, args.pool, args.classes, p.num_clients) if p.alpha_eff else p.alpha
    shards = make_partition(p.method, targets, p.num_clients, seed, alpha=alpha, gamma=p.gamma,
                            budgets=budgets, min_size=p.min_size, b_cap=b.b_cap)
    sizes = [len(s) for s in shards]
    sets = acc.affordable_sets(cache, budgets.tolist())
    client_routed = [routed(s) for s in sets]
    summary = acc.population_summary(cache, budgets.tolist(), sizes, client_routed)
    comm = acc.communication(full, client_routed)
    compute = acc.training_computation(cache, sets, sizes, run.federation.rounds, run.federation.clients_per_round,
                                       run.train.epochs, algorithm.rule)
    over_seeds = None
    if args.seeds:
        over_seeds = acc.seed_accounting(cache, routed, full, range(args.seeds), p.num_clients, b.zipf_s,
                                         b.b_min, b.b_max)
    least = acc.least_reachable_clients(cache, budgets.tolist(), space_cost.encode_many(cache.specs),
                                        space_cost.num_stages)
    print(f"{what}; seed {seed}")
    print(acc.format_accounting(summary, comm, compute, footprints))
    print()
    print(acc.format_paper_comparison(comm, footprints, over_seeds,
                                      (summary["afford_1"], summary["afford_2"], summary["afford_3_or_more"]), least))
    out = {"communication": comm, "computation": compute}
    if over_seeds is not None:
        out["over_seeds"] = {k: over_seeds[k] for k in ("mean_routed_params_stats", "traffic_reduction_stats")}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
