"""Golden values for FjORD from the Flower baseline (adap/flower, ``baselines/fjord``, written by
FjORD's authors S. Laskaridis and S. Horvath; the authors' own SamsungLabs/fjord could not be fetched).

    python tools/reference/fjord.py /path/to/flower [--commit SHA]

``/path/to/flower``: a checkout of adap/flower, or a folder holding its ``baselines/fjord`` as
``git archive`` extracts it (then ``--commit`` names the commit it was extracted from).

Case: iid digits, 6 clients of 223, 3 per round (clients 1, 4, 5 with caps 0.6, 1, 0.8), the
baseline's tiers (0.2, 0.4, 0.6, 0.8, 1), the project's CNN with channels 6 and 10 (so that
``ceil`` differs from other roundings at these tiers) built from the baseline's own ordered
dropout layers (``fjord/od/layers``: ``ODConv2d``, ``ODBatchNorm2d`` with one set of
statistics per width, ``ODLinear`` with fixed classes) in its ``SequentialWithSampler``, SGD
lr 0.05, momentum 0.9, weight decay 1e-4, one epoch of batch 32. For each of three forms of our
``FjORD``, one round of the baseline's ``fjord/models.py: train`` (one client's local update) on
the batches our loop drew and ``fjord/strategy.py: aggregate`` (the server step, with the
layer map of ``fjord/client.py: get_agg_config``):

- ``round`` (our default, the HAS-FL paper's FjORD): each client at the tier we drew for the
  round, for every step (the baseline's client with ``max_p`` = that tier and ``p_s`` = [it]).
- ``step`` (FjORD's Algorithm 1): each client at its cap, a width drawn at every step; the
  baseline's ``ODSampler`` draws through ``np.random.choice``, which the adapter answers with the
  widths our client drew (a stand-in for the random source only: every answer is checked to be
  one of the widths the sampler offers).
- ``step_kd``: the same with self-distillation (the baseline's ``fjord_kd`` mode).

Also stored: the output width of the baseline's layers for 1 to 64 channels at 17 ratios, and
``aggregate`` of synthetic client states with unequal example counts (our iid case has equal
ones).

Stand-ins (sys.modules, this adapter only): ``flwr`` (``flwr.client``, ``flwr.common``,
``flwr.server``: imported by ``client.py`` and ``strategy.py`` for the Flower client and
strategy classes, which are not called) and ``coloredlogs`` (the logger's colours).
"""

from __future__ import annotations

import argparse
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
from reference_case import TRAIN, make_spec, run_one_round


from fl_lightning.algorithms.submodel import FjORD
from fl_lightning.elastic.models import CNN

CAPS = [0.2, 0.6, 0.2, 0.4, 1.0, 0.8]  # the round's cohort: clients 1, 4, 5 at 0.6, 1, 0.8
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
def record():
    """Our loop's round 0 in each form: the batches (the same in all three), the tiers, and the
    widths each client drew at its steps."""
    case, draws = None, {}
    for name, kwargs in CASES.items():
        alg = FjORD(caps=CAPS, tiers=TIERS, **kwargs)
        spec = make_spec(tempfile.mkdtemp(), alg, num_clients=6, clients_per_round=3, partition="iid",
                         train=train_config(), model={"class_path": "fl_lightning.elastic.models.CNN", "init_args": {"channels": list(CHANNELS)}})
        modules, client_module = {}, alg.client_module

        def keep(routed, task, plan, _modules=modules, _make=client_module):
            _modules[task.client] = _make(routed, task, plan)
            return _modules[task.client]

        alg.client_module = keep
        fed, initial, cohort, batches = run_one_round(spec)
        plan = alg.plan(0)
        widths = {t.client: t.choice.p for t in plan.tasks}
        draws[name] = {"widths": widths,
                       "draws": {c: list(getattr(modules[c], "drawn", [])) for c in cohort}}
        if case is None:
            case = {"initial": initial, "cohort": cohort, "batches": {c: batches[c] for c in cohort},
                    "examples": {c: len(fed.ctx.shards[c]) for c in cohort}}
        else:  # every form trains on the same batches from the same model
            assert cohort == case["cohort"]
            assert all(torch.equal(initial[k], v) for k, v in case["initial"].items())
            for c in cohort:
                assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                           for a, b in zip(batches[c], case["batches"][c]))
    case.update({"caps": CAPS, "tiers": list(TIERS), "channels": list(CHANNELS), "cases": CASES, "lr": TRAIN.lr,
                 "momentum": TRAIN.momentum, "weight_decay": WEIGHT_DECAY})
    return case, draws


def pack_batches(batches):
    """Batches as codes into the 17 grey levels of digits (lossless, a tenth of the bytes)."""
    levels = torch.unique(torch.cat([x.flatten() for bs in batches.values() for x, _ in bs]))
    assert len(levels) < 256
    packed = {c: [(torch.searchsorted(levels, x).to(torch.uint8), y.to(torch.uint8)) for x, y in bs]
              for c, bs in batches.items()}
    for c, bs in batches.items():
        for (x, y), (code, label) in zip(bs, packed[c]):
            assert torch.equal(levels[code.long()], x) and torch.equal(label.long(), y)
    return levels, packed


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


def run_case(fj, case, name, recorded):
    kwargs = case["cases"][name]
    step = kwargs.get("sample") == "step"
    distill = bool(kwargs.get("distill"))
    cohort, widths = case["cohort"], recorded["widths"]
    net0 = od_cnn(fj, case["initial"], TIERS)
    config = fj.client.get_agg_config(copy.deepcopy(net0), [case["batches"][cohort[0]][0]], list(TIERS))
    train_config = types.SimpleNamespace(optimiser="sgd", lr=case["lr"], momentum=case["momentum"], nesterov=False,
                                         weight_decay=case["weight_decay"], lr_scheduler="static")
    original = [v.cpu().numpy().copy() for v in net0.state_dict().values()]
    results, locals_, stats = [], {}, {}
    for c in cohort:
        net = copy.deepcopy(net0)
        p_max = widths[c]
        # round: the client trains its round's tier at every step; step: a width of its tiers per step
        p_s = list(TIERS) if step else [p_max]
        with replaying(fj, recorded["draws"][c] if step else []) as replay:
            fj.models.train(net, case["batches"][c], distill, p_max, current_round=1, total_rounds=1, p_s=p_s,
                            epochs=1, train_config=train_config)
        assert not replay.draws, "the baseline drew fewer widths than our client"
        state = net.state_dict()
        locals_[c] = ours_from(state, p_max)
        if not step:  # one width trained: its own statistics are the ones our local model tracks
            stats[c] = stats_of(state, channels_at(p_max))
        results.append(([v.cpu().numpy() for v in state.values()], case["examples"][c], p_max, list(TIERS), config))
    aggregated = fj.strategy.aggregate(results, original)
    global_state = ours_from(dict(zip(net0.state_dict().keys(), map(torch.as_tensor, aggregated))), None)
    return {"widths": widths, "draws": recorded["draws"], "locals": locals_, "local_stats": stats,
            "global": global_state}


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
    parser = argparse.ArgumentParser()
    parser.add_argument("flower")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = common.out_dir("fjord")
    case, draws = record()
    fj = baseline(args.flower)
    check_same_function(fj, case["initial"], case["batches"][case["cohort"][0]][0][0])
    golden = {name: run_case(fj, case, name, draws[name]) for name in CASES}
    golden["aggregation"] = aggregation_only(fj, case["initial"])
    golden["widths"] = widths_grid(fj)
    levels, packed = pack_batches(case.pop("batches"))
    case.update({"levels": levels, "batches": packed})
    torch.save({"case": case, **golden}, out / "authors.pt")
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
        notes="iid digits, 6 clients of 223, 3 per round (clients 1, 4, 5; caps 0.6, 1, 0.8), tiers 0.2, 0.4, "
              "0.6, 0.8, 1 (the baseline's p_s); the project's CNN (channels 6, 10) from the baseline's OD layers; "
              "SGD lr 0.05, momentum 0.9, weight decay 1e-4, one epoch of batch 32. Cases: round (our default: "
              "the round's tier at every step; the baseline's client with max_p = p_s = that tier), step (sample: "
              "step, each step's width ours, fed to the baseline's ODSampler), step_kd (the same with distill, the "
              "baseline's fjord_kd). aggregation: aggregate() of 4 synthetic clients (p_max 1, 0.4, 0.2, 0.4; 100, "
              "223, 57, 300 examples). widths: the OD layers' output channels, 1-64 channels at 17 ratios. "
              "Stand-ins: flwr (client and strategy classes, not called), coloredlogs; numpy in fixed_od.py "
              "answers random.choice with our draws. Batches stored as uint8 codes into case['levels'].")


if __name__ == "__main__":
    main()
