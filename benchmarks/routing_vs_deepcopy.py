"""Time routing a quarter-width ResNet-18 client against deep-copying the full model.

    python benchmarks/routing_vs_deepcopy.py [--repeats 50] [--width 0.25] [--classes 100]

Routing builds the small model directly and copies only its slices, so its cost should
follow the client's size (about 1/16 of the parameters at width 0.25), not the server's.
"""

from __future__ import annotations

import argparse
import copy

import torch

from fl_lightning.elastic.macs import count_params
from fl_lightning.elastic.models import build_model
from fl_lightning.elastic.specs import WidthSpec
from fl_lightning.elastic.models import ResNet18

from _timing import median_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--classes", type=int, default=100)
    args = parser.parse_args()

    torch.set_num_threads(1)  # copies are memory-bound; keep the comparison about work done
    model = build_model(ResNet18, args.classes, (3, 32, 32))
    spec = WidthSpec.uniform(args.width, 4)
    client = model.extract(spec)

    t_route = median_time(lambda: model.extract(spec), args.repeats)
    t_copy = median_time(lambda: copy.deepcopy(model), args.repeats)
    print(f"server params: {count_params(model):,}  client params: {count_params(client.module):,} "
          f"({count_params(client.module) / count_params(model):.3f} of full)")
    print(f"extract(width={args.width:g}): {1e3 * t_route:.2f} ms  (median of {args.repeats})")
    print(f"deepcopy(full):       {1e3 * t_copy:.2f} ms  (median of {args.repeats})")
    print(f"routing/deepcopy ratio: {t_route / t_copy:.3f}")


if __name__ == "__main__":
    main()
