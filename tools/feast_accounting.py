"""FEAST's communication, computation and footprint accounting for a config, without its dataset.

    python tools/feast_accounting.py configs/feast_cifar100.yaml [--pool 45000 --classes 100]

Budgets come from the config and seed exactly as in a run. Communication and footprints need
only budgets, cache and supernet; the training-computation figure needs shard sizes, which are
taken from the gamma-Dirichlet partition of a balanced label vector of the pool's size (the
real run partitions the dataset's own label order, so its sizes differ in detail).
"""

from __future__ import annotations

import argparse
import json

import torch

from fl_lightning.analysis import feast_accounting as acc
from fl_lightning.cli import build_parser
from fl_lightning.data.federated import client_budgets
from fl_lightning.data.partition import alpha_data_for, make_partition
from fl_lightning.elastic.envelope import full_param_count
from fl_lightning.elastic.models import build_model
from fl_lightning.elastic.search.cache import VariantCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--pool", type=int, default=45000, help="client-training examples")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--input-shape", type=int, nargs=3, default=[3, 32, 32])
    args = parser.parse_args()
    cli = build_parser()
    run = cli.instantiate(cli.parse_args(["fit", "--config", args.config])).fit
    model = build_model(run.model.name, args.classes, tuple(args.input_shape), **run.model.kwargs)
    algorithm = run.algorithm
    cache = VariantCache.load(algorithm.cache_path)
    if algorithm.retarget:
        cache = cache.retarget(model, tuple(args.input_shape))
    budgets = client_budgets(run.partition, run.seed)
    p = run.partition
    targets = torch.arange(args.pool) % args.classes
    alpha = alpha_data_for(p.alpha_eff, args.pool, args.classes, p.num_clients) if p.alpha_eff else p.alpha
    shards = make_partition(p.method, targets, p.num_clients, run.seed, alpha=alpha, gamma=p.gamma,
                            budgets=budgets, min_size=p.min_size, b_cap=p.budgets.b_cap)
    sizes = [len(s) for s in shards]
    sets = acc.affordable_sets(cache, budgets.tolist())
    routed = acc.client_routed_params(model, cache, sets)
    summary = acc.population_summary(cache, budgets.tolist(), sizes, routed)
    comm = acc.communication(full_param_count(model), routed)
    compute = acc.training_computation(cache, sets, sizes, run.federation.rounds, run.federation.clients_per_round,
                                       run.train.epochs, algorithm.rule)
    footprints = acc.parameter_footprints(model, cache, acc.default_anchors(cache.macs))
    print(acc.format_accounting(summary, comm, compute, footprints))
    print(json.dumps({"communication": comm, "computation": compute}, indent=2))


if __name__ == "__main__":
    main()
