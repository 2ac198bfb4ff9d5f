"""The three-round case of the FedRolex golden values (``tools/reference/fedrolex.py``,
``tests/test_reference_fedrolex.py``).

Our side: ``FedRolex`` on digits, 6 clients with Dirichlet(0.5) shards of unequal sizes (242,
215, 249, 238, 246 and 148 examples), 3 per round, caps chosen so that the three rounds' cohorts
({1, 4, 5}, {0, 1, 4}, {2, 4, 5}) train at 1/4, 1/2, 3/4 and 1; the project's CNN with channels
(4, 8), so one round counter reduced modulo 4 and modulo 8 gives different window starts per
layer; one local epoch of batches of 32, SGD lr 0.05, momentum 0.9, weight decay 5e-4 (the
authors' MNIST setting), clipping at norm 1 (their client), HeteroFL's Scaler (their runs' ``scale
1``), static BN and one weight per client (their plain mean). In float64 (``run_rounds``), as the
reference replays it. :func:`run_case` records, besides the rounds, each client's regions and the
sub-model it was sent.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Dict, Optional

import torch

from reference_case import TRAIN, batch_digest, float64_bound, grey_levels, make_spec, run_rounds

ROUNDS, CLIENTS, PER_ROUND = 3, 6, 3
CAPS = [0.75, 0.5, 0.75, 0.25, 1.0, 0.25]
CASE_TRAIN = replace(TRAIN, weight_decay=5e-4, grad_clip=1.0)
PARAMS = ("features.block0.conv.weight", "features.block0.bn.weight", "features.block0.bn.bias",
          "features.block1.conv.weight", "features.block1.bn.weight", "features.block1.bn.bias",
          "fc.weight", "fc.bias")
BATCH_TERMS = 32 * 8 * 8  # the longest sums of a training step: a batch's 8x8 positions (BN, conv gradients)


def algorithm(**overrides):
    from fl_lightning.algorithms import FedRolex

    return FedRolex(**{"caps": CAPS, "bn": "sbn", "scaler": True, "weighting": "uniform", **overrides})


def region_indices(region) -> tuple:
    """The global positions a region holds, per dimension (a leading slice: 0..n-1)."""
    indices = getattr(region, "indices", None)
    if indices is None:
        return tuple(torch.arange(n) for n in region.local_shape)
    return tuple(i.clone() for i in indices)


def run_case(out_dir=None, alg=None, case: Optional[Dict] = None):
    """Our three rounds in float64: ``(run, sent, regions)``, the last two keyed by (round,
    client). ``case``: a stored case, whose initial model and grey levels the run starts from;
    ``alg``: an already built FedRolex (a test perturbs one)."""
    alg = alg or algorithm()
    sent, regions = {}, {}
    route = alg.route

    def recording_route(task, plan):
        routed = route(task, plan)
        sent[(plan.round_idx, task.client)] = {k: v.detach().clone() for k, v in routed.module.state_dict().items()}
        regions[(plan.round_idx, task.client)] = {k: region_indices(r) for k, (_, r) in routed.regions.items()}
        return routed

    alg.route = recording_route
    spec = make_spec(Path(out_dir or tempfile.mkdtemp()), alg, num_clients=CLIENTS, clients_per_round=PER_ROUND,
                     rounds=ROUNDS, train=CASE_TRAIN)
    run = run_rounds(spec, ROUNDS, dtype=torch.float64, levels=None if case is None else case["levels"],
                     initial=None if case is None else case["initial"])
    return run, sent, regions


def case_record(run) -> Dict:
    """What the golden file keeps of our run's case (batches as digests, not images)."""
    ctx = run.fed.ctx
    return {"initial": {k: v.float() if v.is_floating_point() else v for k, v in run.initial.items()},
            "levels": grey_levels(run.fed), "caps": list(CAPS), "cohorts": run.cohorts,
            "sizes": {c: len(ctx.shards[c]) for c in range(ctx.num_clients)},
            "digests": [{c: [batch_digest(x, y) for x, y in b[c]] for c in cohort}
                        for cohort, b in zip(run.cohorts, run.batches)],
            "lr": CASE_TRAIN.lr, "momentum": CASE_TRAIN.momentum, "weight_decay": CASE_TRAIN.weight_decay,
            "grad_clip": CASE_TRAIN.grad_clip}


def tolerance(case: Dict, scale: float) -> float:
    """float64 rounding along the longest chain of local steps (``float64_bound``)."""
    steps = sum(max(len(d) for d in rnd.values()) for rnd in case["digests"])
    return float64_bound(steps, BATCH_TERMS, scale)
