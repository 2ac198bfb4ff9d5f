"""Time FEAST's sparse aggregation of routed envelopes against a dense add of the same bytes.

    python benchmarks/sparse_aggregation.py [--clients 10] [--cache 56] [--repeats 5] [--seed 0]
        [--block basic_pair]

From the full 55.68M-parameter supernet (CIFAR-100) the script draws a random cache of
``--cache`` architectures, orders it by MACs (fvcore), gives each of ``--clients`` clients the
cheapest ``k`` cached variants (``k`` drawn low-end heavy, as FEAST's Zipf budgets are), and
routes each client's envelope (Eq. 4). It then times adding the returned tensors into value and
count accumulators of the full supernet (``SparseAccumulator.add`` = ``Region.scatter_add`` per
tensor, then the per-position counts via ``Region.fill_add``), against plain in-place ``add_``
of flat buffers holding the same number of values in the same dtypes (float32 into float64).
A ratio near 1 means the sparse path costs what moving those bytes costs.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from fl_lightning.elastic.aggregation import SparseAccumulator
from fl_lightning.elastic.envelope import full_param_count, route_envelope, routed_param_count
from fl_lightning.elastic.macs import spec_macs
from fl_lightning.elastic.models import build_model
from fl_lightning.elastic.models import OFAResNet

from _timing import median_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--cache", type=int, default=56)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--block", choices=("basic_pair", "bottleneck"), default="basic_pair",
                        help="supernet construction (docs/feast_supernet.md measured bottleneck)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)  # memory-bound adds; keep the comparison about work done
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    shape = (3, 32, 32)
    model = build_model(OFAResNet, 100, shape, block=args.block)
    start = time.perf_counter()
    cache = sorted({model.sample_spec(generator) for _ in range(args.cache)},
                   key=lambda s: spec_macs(model, s, shape))
    t_cache = time.perf_counter() - start
    # Low-end heavy affordable-set sizes: k = ceil(K * u^2), u uniform.
    sizes = [max(1, math.ceil(len(cache) * float(torch.rand((), generator=generator)) ** 2))
             for _ in range(args.clients)]
    start = time.perf_counter()
    routed = [route_envelope(model, cache[:k]) for k in sizes]
    t_route = time.perf_counter() - start
    weights = [float(torch.randint(50, 800, (), generator=generator)) for _ in routed]

    global_state = model.state_dict()
    full = full_param_count(model)
    payload = [routed_param_count(model, cache[:k]) for k in sizes]
    print(f"supernet: {full:,} parameters; cache of {len(cache)} specs "
          f"({spec_macs(model, cache[0], shape) / 1e6:.1f}M..{spec_macs(model, cache[-1], shape) / 1e6:.1f}M MACs, "
          f"{t_cache:.1f} s to count)")
    print(f"affordable-set sizes: {sizes}")
    print(f"routed params per client (M): {[round(p / 1e6, 2) for p in payload]}  "
          f"mean {sum(payload) / len(payload) / 1e6:.2f}M; aggregate reduction "
          f"{len(payload) * full / sum(payload):.2f}x; routing all took {t_route:.2f} s")

    # What each client returns: its routed state (floating tensors are aggregated).
    states = [r.module.state_dict() for r in routed]
    numels = [sum(v.numel() for v in s.values() if v.is_floating_point()) for s in states]
    total = sum(numels)
    acc = SparseAccumulator(global_state)  # float64 value accumulators of the full supernet

    # Accumulators are not re-zeroed between repeats: zeroing the full-size sparse accumulators
    # would be charged to one side only, and the sums' values do not change the cost.
    def sparse_values():
        for state, weight, r in zip(states, weights, routed):
            acc.add(state, weight, r.regions)

    def sparse_counts():
        acc.counts = None
        acc.tensors()  # allocates full-size counts and fills them with Region.fill_add

    flat_locals = [torch.randn(n) for n in numels]
    flat_acc = torch.zeros(max(numels), dtype=torch.float64)

    def dense_one_op():
        for flat, weight in zip(flat_locals, weights):
            flat_acc[:flat.numel()].add_(flat, alpha=weight)

    # A float32 -> float64 add_ casts its input into a temporary of the input's size; for tens
    # of millions of values that is fresh memory, page-faulted on every call (several times
    # slower). Chunks of 2^20 values keep the temporary reusable, so this is the fair baseline.
    chunk = 1 << 20

    def dense():
        for flat, weight in zip(flat_locals, weights):
            for start in range(0, flat.numel(), chunk):
                piece = flat[start:start + chunk]
                flat_acc[start:start + piece.numel()].add_(piece, alpha=weight)

    t_values = median_time(sparse_values, args.repeats)
    t_counts = median_time(sparse_counts, args.repeats)
    t_dense = median_time(dense, args.repeats)
    t_one_op = median_time(dense_one_op, args.repeats)
    print(f"values added: {total:,} ({total * 4 / 2**20:.0f} MiB float32 into float64 accumulators)")
    print(f"sparse values (Region.scatter_add):   {1e3 * t_values:8.1f} ms")
    print(f"sparse counts (alloc + fill_add):     {1e3 * t_counts:8.1f} ms")
    print(f"dense flat add_, 2^20-value chunks:   {1e3 * t_dense:8.1f} ms")
    print(f"dense flat add_, one op per client:   {1e3 * t_one_op:8.1f} ms  (large-temporary artefact)")
    print(f"ratio values/dense: {t_values / t_dense:.2f}   ratio (values+counts)/dense: "
          f"{(t_values + t_counts) / t_dense:.2f}   (target <= 2.0; median of {args.repeats}, "
          f"{args.threads} thread(s))")


if __name__ == "__main__":
    main()
