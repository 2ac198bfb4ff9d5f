"""Golden values for FjORD from the Flower baseline (adap/flower, ``baselines/fjord``, written by
FjORD's authors S. Laskaridis and S. Horvath; the authors' own SamsungLabs/fjord could not be fetched).

    python tools/reference/fjord.py /path/to/flower [--commit SHA]

``/path/to/flower``: a checkout of adap/flower, or a folder holding its ``baselines/fjord`` as
``git archive`` extracts it (then ``--commit`` names the commit it was extracted from).

Case: Dirichlet(0.5) digits, 8 clients of unequal shards, 3 per round for 3 rounds (caps 0.2 to
1, a cap-1 client in every round; with ``sample: round`` the served width is drawn in round 1), the baseline's tiers (0.2, 0.4, 0.6, 0.8, 1), the project's
CNN with channels 6 and 10 (so that ``ceil`` differs from other roundings at these tiers) built
from the baseline's own ordered dropout layers (``fjord/od/layers``: ``ODConv2d``,
``ODBatchNorm2d`` with one set of statistics per width, ``ODLinear`` with fixed classes) in its
``SequentialWithSampler``, SGD lr 0.05, momentum 0.9, weight decay 1e-4, one epoch of batch 32.
For each of three forms of our ``FjORD`` (served statistics ``bn: per_width``, the default),
every round: the baseline's ``fjord/models.py: train`` (one client's local update) from the
global model (all its per-width statistics) on the batches our loop drew, and
``fjord/strategy.py: aggregate`` (the server step, weighted by examples, with the layer map of
``fjord/client.py: get_agg_config``) into the next global model:

- ``round`` (our default, the HAS-FL paper's FjORD): each client at the tier we drew for the
  round, for every step (the baseline's client with ``max_p`` = that tier and ``p_s`` = [it]).
- ``step`` (FjORD's Algorithm 1): each client at its cap, a width drawn at every step; the
  baseline's ``ODSampler`` draws through ``np.random.choice``, which the adapter answers with the
  widths our client drew (a stand-in for the random source only: every answer is checked to be
  one of the widths the sampler offers).
- ``step_kd``: the same with self-distillation (the baseline's ``fjord_kd`` mode).

Both sides run in float64 (networks and batches converted). Stored per form (``round.pt``,
``step.pt``, ``step_kd.pt``): the case (batches as SHA-256 digests, the digits' grey levels),
per round each client's width, per-step draws, trained parameters and the statistics of its own
width's set, and the global parameters with the full width's statistics.

Also stored: the output width of the baseline's layers for 1 to 64 channels at 17 ratios, and
``aggregate`` of synthetic client states with unequal example counts (our iid case has equal
ones).

Stand-ins (sys.modules, this adapter only): ``flwr`` (``flwr.client``, ``flwr.common``,
``flwr.server``: imported by ``client.py`` and ``strategy.py`` for the Flower client and
strategy classes, which are not called) and ``coloredlogs`` (the logger's colours).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import tempfile
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

import common
from reference_case import TRAIN, batch_digest, default_dtype, grey_levels, keep_training_modules, make_spec, run_rounds


from fl_lightning.algorithms.submodel import FjORD
from fl_lightning.elastic.models import CNN

CAPS = [0.2, 1.0, 0.4, 0.4, 0.6, 1.0, 0.8, 0.2]  # cohorts (4, 5, 6), (1, 2, 5), (1, 5, 6)
ROUNDS = 3
TIERS = (0.2, 0.4, 0.6, 0.8, 1.0)  # the baseline's p_s (conf/common.yaml)
CHANNELS = (6, 10)
CASES = {"round": {}, "step": {"sample": "step"}, "step_kd": {"sample": "step", "distill": True}}
WEIGHT_DECAY = 1e-4  # the baseline's default (momentum: ours, 0.9; the baseline's default is 0)
RATIOS = [0.0625, 0.1, 0.125, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.6000000000000001, 0.7, 0.75, 0.8, 0.9, 1.0,
          1 / 3, 2 / 3]  # 0.6000000000000001: the baseline's tier (cid // 20) * 0.2 + 0.2 for cid 40-59
MAX_CHANNELS = 64
OURS_TO_OD = {  # our CNN's keys -> the SequentialWithSampler's (0 conv, 1 bn, 2 relu, 3 pool, 4 conv, 5 bn,
    "features.block0.conv.weight": "0.weight",  # 6 relu, 7 avg pool, 8 flatten, 9 linear)
    "features.block0.bn.weight": "1.weight", "features.block0.bn.bias": "1.bias",
    "features.block1.conv.weight": "4.weight",
    "features.block1.bn.weight": "5.weight", "features.block1.bn.bias": "5.bias",
    "fc.weight": "9.weight", "fc.bias": "9.bias",
}
BN_STATS = {"features.block0.bn.": "1.bn.{}.", "features.block1.bn.": "5.bn.{}."}


def train_config():
    return replace(TRAIN, weight_decay=WEIGHT_DECAY)


def our_cnn():
    from fl_lightning.elastic.models import build_model

    return build_model(CNN, 10, (1, 8, 8), channels=list(CHANNELS))


# -- our side ------------------------------------------------------------------------------------
def algorithm(form: str):
    return FjORD(caps=CAPS, tiers=TIERS, **CASES[form])


def record(form: str):
    """Our 3 rounds of ``form`` in float64: the case, the batches, and per round each client's
    width and the widths it drew at its steps."""
    alg = algorithm(form)
    spec = make_spec(tempfile.mkdtemp(), alg, clients_per_round=3, rounds=ROUNDS, train=train_config(),
                     model={"class_path": "fl_lightning.elastic.models.CNN", "init_args": {"channels": list(CHANNELS)}})
    modules = keep_training_modules(alg)  # each client's training module, to read the widths it drew
    run = run_rounds(spec, ROUNDS, dtype=torch.float64)
    widths = [{t.client: t.choice.p for t in alg.plan(r).tasks} for r in range(ROUNDS)]  # plans depend on (seed, round)
    ctx = run.fed.ctx
    case = {"initial": run.initial,
            "levels": grey_levels(run.fed), "form": form, "options": CASES[form], "caps": CAPS,
            "tiers": list(TIERS), "channels": list(CHANNELS), "rounds": ROUNDS, "cohorts": run.cohorts,
            "sizes": {c: len(ctx.shards[c]) for c in range(ctx.num_clients)}, "lr": TRAIN.lr,
            "momentum": TRAIN.momentum, "weight_decay": WEIGHT_DECAY,
            "digests": [{c: [batch_digest(x, y) for x, y in b[c]] for c in cohort}
                        for cohort, b in zip(run.cohorts, run.batches)],
            "widths": widths,
            "draws": [{c: list(getattr(modules[(r, c)], "drawn", [])) for c in cohort}
                      for r, cohort in enumerate(run.cohorts)]}
    return case, run.batches


# -- the baseline's side -------------------------------------------------------------------------
def stub_flower():
    class Placeholder:
        def __init__(self, *args, **kwargs):
            pass

    common.stub_modules("coloredlogs", "flwr", "flwr.client", "flwr.common", "flwr.server",
                        "flwr.server.client_proxy", "flwr.server.strategy",
                        **{"coloredlogs.install": lambda *a, **k: None,
                           "flwr.client.NumPyClient": Placeholder, "flwr.client.Client": Placeholder,
                           "flwr.common.FitRes": Placeholder, "flwr.common.Metrics": dict,
                           "flwr.common.NDArrays": list, "flwr.common.Parameters": Placeholder,
                           "flwr.common.Scalar": float, "flwr.common.ndarrays_to_parameters": None,
                           "flwr.common.parameters_to_ndarrays": None,
                           "flwr.server.client_proxy.ClientProxy": Placeholder,
                           "flwr.server.strategy.FedAvg": Placeholder})
    sys.modules["flwr"].client = sys.modules["flwr.client"]
    sys.modules["flwr"].common = sys.modules["flwr.common"]


def baseline(repo):
    common.add_repo(repo, "baselines/fjord")
    stub_flower()
    from fjord import client, models, strategy
    from fjord.od.layers import ODBatchNorm2d, ODConv2d, ODLinear
    from fjord.od.models.utils import SequentialWithSampler, create_bn_layer
    from fjord.od.samplers import fixed_od
    from fjord.utils.logger import Logger

    Logger.setup_logging("warning")
    return types.SimpleNamespace(client=client, models=models, strategy=strategy, ODConv2d=ODConv2d,
                                 ODBatchNorm2d=ODBatchNorm2d, ODLinear=ODLinear, fixed_od=fixed_od,
                                 Sequential=SequentialWithSampler, create_bn_layer=create_bn_layer)


def od_cnn(fj, initial, p_s):
    """The project's CNN (channels 6, 10) from the baseline's layers, holding ``initial``."""
    c0, c1 = CHANNELS
    net = fj.Sequential(
        fj.ODConv2d(1, c0, 3, padding=1, bias=False), fj.create_bn_layer(True, list(p_s), num_features=c0), nn.ReLU(),
        nn.MaxPool2d(2),
        fj.ODConv2d(c0, c1, 3, padding=1, bias=False), fj.create_bn_layer(True, list(p_s), num_features=c1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), fj.ODLinear(c1, 10, is_od=False))
    state = net.state_dict()
    for ours, theirs in OURS_TO_OD.items():
        state[theirs] = initial[ours].reshape(state[theirs].shape).clone()
    for prefix, pattern in BN_STATS.items():
        for n in {int(np.ceil(initial[prefix + "weight"].numel() * p)) for p in p_s}:
            for stat in ("running_mean", "running_var"):
                state[pattern.format(n) + stat] = initial[prefix + stat][:n].clone()
    net.load_state_dict(state)
    return net


def check_same_function(fj, initial, x):
    """At every tier the baseline's network and ours give the same logits (batch statistics)."""
    from fl_lightning.elastic.specs import WidthSpec

    ours = our_cnn()
    ours.load_state_dict(initial)
    theirs = od_cnn(fj, initial, TIERS)
    for p in TIERS:
        ours.set_active(WidthSpec.uniform(p, 2))
        sampler = fj.fixed_od.ODSampler(p_s=[p], max_p=p, model=theirs)
        with torch.no_grad():
            diff = (ours(x) - theirs(x, sampler=sampler)).abs().max().item()
        assert diff < 1e-6, f"the baseline's network differs from ours by {diff} at width {p}"


class Replay:
    """Stands in for ``numpy`` in ``fjord/od/samplers/fixed_od.py``: ``random.choice`` answers
    with the widths our client drew, in order (a one-width sampler, the distillation teacher's,
    gets its only width without using a draw); every other name is numpy's."""

    def __init__(self, draws):
        self.draws = list(draws)
        self.random = types.SimpleNamespace(choice=self.choice)

    def choice(self, options):
        options = [float(o) for o in options]
        if len(options) == 1:
            return options[0]
        p = self.draws.pop(0)
        assert p in options, (p, options)
        return p

    def __getattr__(self, name):
        return getattr(np, name)


@contextlib.contextmanager
def replaying(fj, draws):
    replay = Replay(draws)
    fj.fixed_od.np = replay
    try:
        yield replay
    finally:
        fj.fixed_od.np = np


def ours_from(net_state, widths, prefixes=OURS_TO_OD):
    """The baseline's tensors under our keys (BN affine reshaped to (C,)), each cut to the
    leading slice our local model of ``widths`` holds; BN statistics from the width's own set."""
    out = {}
    for ours, theirs in prefixes.items():
        out[ours] = net_state[theirs].detach().clone()
        if out[ours].dim() == 3:  # ODBatchNorm2d's (C, 1, 1) affine
            out[ours] = out[ours].flatten()
    if widths is None:
        return out
    from fl_lightning.elastic.specs import WidthSpec

    regions = our_cnn().regions(WidthSpec.uniform(widths, 2))
    for key in list(out):
        out[key] = regions[key][1].gather(out[key]).clone()
    return out


def stats_of(net_state, width_channels):
    """BN statistics of one width's own set, under our keys."""
    out = {}
    for prefix, pattern in BN_STATS.items():
        n = width_channels[prefix]
        for stat in ("running_mean", "running_var"):
            out[prefix + stat] = net_state[pattern.format(n) + stat].detach().clone()
    return out


def channels_at(p):
    return {"features.block0.bn.": int(np.ceil(CHANNELS[0] * p)), "features.block1.bn.": int(np.ceil(CHANNELS[1] * p))}


def run_case(fj, case, batches):
    """The case's rounds through the baseline's ``train`` and ``aggregate``, in float64."""
    step = case["options"].get("sample") == "step"
    distill = bool(case["options"].get("distill"))
    initial = {k: v.double() if v.is_floating_point() else v for k, v in case["initial"].items()}
    net = od_cnn(fj, initial, TIERS).double()
    first = batches[0][case["cohorts"][0][0]][0]
    config = fj.client.get_agg_config(copy.deepcopy(net), [first], list(TIERS))
    train_config = types.SimpleNamespace(optimiser="sgd", lr=case["lr"], momentum=case["momentum"], nesterov=False,
                                         weight_decay=case["weight_decay"], lr_scheduler="static")
    rounds = []
    for r, cohort in enumerate(case["cohorts"]):
        original = [v.cpu().numpy().copy() for v in net.state_dict().values()]
        results, locals_, stats = [], {}, {}
        for c in cohort:
            local = copy.deepcopy(net)
            p_max = case["widths"][r][c]
            # round: the client trains its round's tier at every step; step: a width of its tiers per step
            p_s = list(TIERS) if step else [p_max]
            with replaying(fj, case["draws"][r][c] if step else []) as replay:
                fj.models.train(local, batches[r][c], distill, p_max, current_round=1, total_rounds=1, p_s=p_s,
                                epochs=1, train_config=train_config)
            assert not replay.draws, "the baseline drew fewer widths than our client"
            state = local.state_dict()
            locals_[c] = ours_from(state, p_max)
            stats[c] = stats_of(state, channels_at(p_max))  # the statistics of its own width's set
            results.append(([v.cpu().numpy() for v in state.values()], case["sizes"][c], p_max, list(TIERS), config))
        aggregated = fj.strategy.aggregate(results, original)
        net.load_state_dict(dict(zip(net.state_dict().keys(), map(torch.as_tensor, aggregated))))
        state = net.state_dict()
        rounds.append({"locals": locals_, "local_stats": stats,
                       "global": {**ours_from(state, None), **stats_of(state, channels_at(1.0))}})
    return rounds


def aggregation_only(fj, initial):
    """``aggregate`` of synthetic client states: four clients with p_max 1, 0.4, 0.2, 0.4 and
    100, 223, 57, 300 examples (so that the sample weights matter)."""
    p_maxes, examples = [1.0, 0.4, 0.2, 0.4], [100, 223, 57, 300]
    net0 = od_cnn(fj, initial, TIERS)
    x = torch.linspace(-1, 1, 2 * 64).reshape(2, 1, 8, 8)
    config = fj.client.get_agg_config(copy.deepcopy(net0), [(x, None)], list(TIERS))
    original = [v.cpu().numpy().copy() for v in net0.state_dict().values()]
    generator = torch.Generator().manual_seed(0)
    clients, results = [], []
    for p_max, n in zip(p_maxes, examples):
        state = {k: (torch.randn(v.shape, generator=generator) if v.is_floating_point() else v.clone())
                 for k, v in net0.state_dict().items()}
        clients.append(ours_from(state, p_max))
        results.append(([v.numpy() for v in state.values()], n, p_max, list(TIERS), config))
    aggregated = fj.strategy.aggregate(results, original)
    global_state = ours_from(dict(zip(net0.state_dict().keys(), map(torch.as_tensor, aggregated))), None)
    return {"p_max": p_maxes, "examples": examples, "clients": clients, "global": global_state}


def widths_grid(fj):
    """Output channels of the baseline's ODConv2d, ODLinear and ODBatchNorm2d for 1..64 channels
    at each ratio of RATIOS (rows)."""
    grid = torch.zeros(len(RATIOS), MAX_CHANNELS, dtype=torch.int16)
    for i, p in enumerate(RATIOS):
        for c in range(1, MAX_CHANNELS + 1):
            conv = fj.ODConv2d(1, c, 1, bias=False)
            conv(torch.zeros(1, 1, 1, 1), p=p)
            linear = fj.ODLinear(1, c)
            linear(torch.zeros(1, 1), p=p)
            bn = fj.ODBatchNorm2d(p_s=[p], num_features=c)
            dims = {conv.last_output_dim, linear.last_output_dim, bn.p_to_num_features[p]}
            assert len(dims) == 1, (p, c, dims)
            grid[i, c - 1] = dims.pop()
    return {"ratios": RATIOS, "channels": list(range(1, MAX_CHANNELS + 1)), "out": grid}


def main():
    args = common.repository_args("flower")
    out = common.out_dir("fjord")
    fj = baseline(args.flower)
    for form in CASES:
        case, batches = record(form)
        check_same_function(fj, case["initial"], batches[0][case["cohorts"][0][0]][0][0].float())
        with default_dtype(torch.float64):
            rounds = run_case(fj, case, batches)
        torch.save({"case": case, "rounds": rounds}, out / f"{form}.pt")
    initial = case["initial"]
    torch.save({"case": {"initial": initial, "channels": list(CHANNELS), "tiers": list(TIERS)},
                "aggregation": aggregation_only(fj, initial), "widths": widths_grid(fj)}, out / "authors.pt")
    repo = Path(args.flower).resolve()
    commit = args.commit or common.commit_of(repo)
    common.write_provenance(
        "fjord", repo, "https://github.com/adap/flower (baselines/fjord, by FjORD's authors)",
        commit=commit,
        used=["baselines/fjord/fjord/models.py: train (lines 189-262; ODSampler per batch, fjord_kd at lines 251-256)",
              "baselines/fjord/fjord/strategy.py: aggregate, fjord_average, get_p_layer_updates (lines 39-174)",
              "baselines/fjord/fjord/client.py: get_agg_config (lines 57-101)",
              "baselines/fjord/fjord/od/layers/{conv,linear,batch_norm}.py: ODConv2d, ODLinear, ODBatchNorm2d",
              "baselines/fjord/fjord/od/models/utils.py: SequentialWithSampler, create_bn_layer",
              "baselines/fjord/fjord/od/samplers/fixed_od.py: ODSampler (np.random.choice answered by our draws)"],
        notes="Dirichlet 0.5 digits, 8 clients, 3 per round for 3 rounds (cohorts 4 5 6, 1 2 5, 1 5 6; caps 0.2, "
              "1, 0.4, 0.4, 0.6, 1, 0.8, 0.2; round's tiers 0.2 0.6 0.4, 1 0.4 0.2, 0.2 0.2 0.6), tiers 0.2, 0.4, 0.6, 0.8, 1 (the baseline's p_s); the project's CNN "
              "(channels 6, 10) from the baseline's OD layers; SGD lr 0.05, momentum 0.9, weight decay 1e-4, one "
              "epoch of batch 32; both sides in float64. Forms (round.pt, step.pt, step_kd.pt): round (our default: "
              "the round's tier at every step; the baseline's client with max_p = p_s = that tier), step (sample: "
              "step, each step's width ours, fed to the baseline's ODSampler), step_kd (the same with distill, the "
              "baseline's fjord_kd); per round each client's trained parameters and its own width's statistics, "
              "and the global parameters with the full width's statistics. authors.pt: aggregate() of 4 synthetic "
              "clients (p_max 1, 0.4, 0.2, 0.4; 100, 223, 57, 300 examples) and the OD layers' output channels, "
              "1-64 channels at 17 ratios. Stand-ins: flwr (client and strategy classes, not called), coloredlogs; "
              "numpy in fixed_od.py answers random.choice with our draws. Batches stored as SHA-256 digests.")


if __name__ == "__main__":
    main()
