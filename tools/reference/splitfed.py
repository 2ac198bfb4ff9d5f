"""Golden values for SplitFed V1 from the authors' code
(chandra2thapa/SplitFed-When-Federated-Learning-Meets-Split-Learning).

    python tools/reference/splitfed.py /path/to/SplitFed-When-Federated-Learning-Meets-Split-Learning [--commit SHA]

The authors' script ``SFLV1_ResNet_HAM10000.py`` runs its data loading and training at module
level, so it cannot be imported; the adapter parses it and executes only its function and class
definitions (``FedAvg``, ``calculate_accuracy``, ``prRed``, ``prGreen``, ``train_server``,
``DatasetSplit``, ``Client``) in a namespace that holds the globals they read: the case's two
halves as ``net_glob_client`` / ``net_glob_server``, ``net_model_server`` (one entry per cohort
client), the script's bookkeeping lists and counters, ``criterion`` and ``lr``. Then, round after
round as the script's loop: for each cohort client ``Client(...).train(copy of the global
front)`` (its front/back steps through ``train_server``), and ``FedAvg`` of the fronts, loaded
into the global front; ``train_server`` itself averages the server copies into the global
server half once every client of the round has trained.

Case: Dirichlet digits, 8 clients of unequal shards, 2 per round for 3 rounds, the project's CNN
(channels 4 and 8) cut after its first block (as tools/reference/multisfl.py), BN tracking
running statistics (momentum 0.1, averaged with everything else: ours with ``bn: aggregated``),
one epoch of batch 32, lr 0.05, momentum 0.9. Variants: ``uniform`` (the script's ``FedAvg``, a
plain mean; ours with ``weighting: uniform``) and ``samples`` (``FedAvg`` replaced by the
example-weighted mean; ours by default).

Stand-ins (``OptimizerStandIn``): the script's optimizers are Adam, the client's built once per
``Client.train``, the server's rebuilt at every batch on a fresh deep copy of the client's server
model; the project's is SGD with momentum. Every ``torch.optim.Adam`` becomes ``SGD(lr,
momentum)``: the client's lives through the client's local epoch (as the authors' Adam state
does); the server's momentum buffers are kept across the per-batch rebuilds for the client's
server copy (the project's server optimizer lives through the client's update; a script's Adam
rebuilt per batch has no state to carry). ``DataLoader`` yields the batches our loop drew for
the client. Both sides run in float64 (networks and batches converted).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

import common
from multisfl import halves, to_ours
from reference_case import TRAIN, batch_digest, default_dtype, grey_levels, make_spec, run_rounds

from fl_lightning.algorithms.split.splitfed import SplitFed

SCRIPT = "SFLV1_ResNet_HAM10000.py"
DEFINITIONS = ("FedAvg", "calculate_accuracy", "prRed", "prGreen", "train_server", "DatasetSplit", "Client")
ROUNDS = 3
MOMENTUM = 0.9
VARIANTS = {"uniform": {"weighting": "uniform"}, "samples": {}}


def algorithm(variant: str, version: str = "v1"):
    return SplitFed(cut="block0", version=version, bn="aggregated", **VARIANTS[variant])


def record(variant: str, version: str = "v1", clients_per_round: int = 2):
    """Our rounds in float64: the case the authors' code replays."""
    spec = make_spec(tempfile.mkdtemp(), algorithm(variant, version), clients_per_round=clients_per_round,
                     rounds=ROUNDS, train=replace(TRAIN, momentum=MOMENTUM))
    run = run_rounds(spec, ROUNDS, dtype=torch.float64)
    ctx = run.fed.ctx
    case = {"initial": run.initial,
            "levels": grey_levels(run.fed), "variant": variant, "version": version, "rounds": ROUNDS,
            "clients_per_round": clients_per_round, "cohorts": run.cohorts,
            "sizes": {c: len(ctx.shards[c]) for c in range(ctx.num_clients)},
            "lr": spec.train.lr, "momentum": MOMENTUM, "cut": "block0",
            "digests": [{c: [batch_digest(x, y) for x, y in b[c]] for c in cohort}
                        for cohort, b in zip(run.cohorts, run.batches)]}
    return case, run.batches


def definitions(repo: Path, names=DEFINITIONS, script=SCRIPT):
    tree = ast.parse((repo / script).read_text())
    keep = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    assert sorted(n.name for n in keep) == sorted(names), [n.name for n in keep]
    return compile(ast.Module(body=keep, type_ignores=[]), str(repo / script), "exec")


class OptimizerStandIn:
    """``torch.optim.Adam`` as the scripts call it, ``Adam(params, lr=lr)``, becomes
    ``SGD(params, lr, momentum)``. A server optimizer (``is_server(params)``) starts from and
    keeps the momentum buffers stored under ``server_key()`` (by parameter position), so they
    carry across the scripts' per-batch rebuilds; a client optimizer is a plain SGD with
    momentum (built once per ``Client.train``, it lives through the client's local epoch)."""

    def __init__(self, momentum, is_server, server_key):
        self.momentum, self.is_server, self.server_key = momentum, is_server, server_key
        self.buffers = {}

    def __call__(self, params, lr):
        params = list(params)
        optimizer = torch.optim.SGD(params, lr=lr, momentum=self.momentum)
        if not self.is_server(params):
            return optimizer
        kept = self.buffers.setdefault(self.server_key(), {})
        for i, p in enumerate(params):
            if i in kept:
                optimizer.state[p]["momentum_buffer"] = kept[i].clone()
        step = optimizer.step

        def step_and_keep(*args, **kwargs):
            out = step(*args, **kwargs)
            for i, p in enumerate(params):
                if "momentum_buffer" in optimizer.state[p]:
                    kept[i] = optimizer.state[p]["momentum_buffer"].clone()
            return out

        optimizer.step = step_and_keep
        return optimizer


@contextlib.contextmanager
def adam_replaced(stand_in):
    original = torch.optim.Adam
    torch.optim.Adam = stand_in
    try:
        yield
    finally:
        torch.optim.Adam = original


def weighted_fedavg(weights):
    """The ``samples`` variant's ``FedAvg``: the mean of the state dicts weighted by ``weights``
    (in the order the script passes them); integer buffers as the script's plain mean."""
    def fedavg(w):
        assert len(w) == len(weights)
        out = copy.deepcopy(w[0])
        for k in out:
            if out[k].is_floating_point():
                out[k] = sum(float(n) * s[k] for n, s in zip(weights, w)) / float(sum(weights))
            else:
                out[k] = torch.div(sum(s[k] for s in w), len(w))
        return out
    return fedavg


def authors(repo, case, batches):
    """The case's rounds through the script's V1 definitions, in float64."""
    repo = Path(repo)
    client_net, server_net = (m.double() for m in halves({k: v.double() if v.is_floating_point() else v
                                                          for k, v in case["initial"].items()}))
    m = case["clients_per_round"]
    current = {}
    ns = {"torch": torch, "nn": nn, "copy": copy, "Dataset": torch.utils.data.Dataset,
          "criterion": nn.CrossEntropyLoss(), "device": torch.device("cpu"), "lr": case["lr"],
          "num_users": m, "count1": 0, "count2": 0,
          "batch_acc_train": [], "batch_loss_train": [], "batch_acc_test": [], "batch_loss_test": [],
          "loss_train_collect": [], "acc_train_collect": [], "loss_test_collect": [], "acc_test_collect": [],
          "acc_avg_all_user_train": 0, "loss_avg_all_user_train": 0,
          "loss_train_collect_user": [], "acc_train_collect_user": [],
          "loss_test_collect_user": [], "acc_test_collect_user": [],
          "w_locals_server": [], "idx_collect": [], "l_epoch_check": False, "fed_check": False,
          "net_glob_client": client_net, "net_glob_server": server_net}
    ns["w_glob_server"] = server_net.state_dict()
    ns["net_model_server"] = [server_net for _ in range(m)]
    ns["net_server"] = copy.deepcopy(server_net)
    exec(definitions(repo), ns)
    script_fedavg = ns["FedAvg"]
    stand_in = OptimizerStandIn(case["momentum"], lambda params: params[0] is next(ns["net_server"].parameters()),
                                lambda: (current["round"], current["idx"]))
    rounds = []
    for r, cohort in enumerate(case["cohorts"]):
        averaged = []  # every FedAvg call's inputs: the server copies (inside train_server), then the fronts
        fedavg = script_fedavg if case["variant"] == "uniform" else weighted_fedavg(
            [case["sizes"][c] for c in cohort])

        def logged(w, fedavg=fedavg):
            averaged.append([{k: v.clone() for k, v in s.items()} for s in w])
            return fedavg(w)

        ns["FedAvg"] = logged
        ns["DataLoader"] = lambda dataset, batch_size, shuffle, r=r: batches[r][dataset.idxs[0]]
        fronts = []
        with adam_replaced(stand_in):
            for idx, client in enumerate(cohort):  # the script's round loop (its print-only evaluate left out)
                current.update(round=r, idx=idx)
                local = ns["Client"](client_net, idx, case["lr"], ns["device"], dataset_train=None,
                                     dataset_test=None, idxs=[client], idxs_test=[client])
                fronts.append(copy.deepcopy(local.train(net=copy.deepcopy(client_net))))
            client_net.load_state_dict(ns["FedAvg"](fronts))
        assert len(averaged) == 2 and ns["fed_check"], "train_server did not average the server copies"
        ns["fed_check"] = False
        backs, _ = averaged
        rounds.append({"locals": {c: to_ours(f, b) for c, f, b in zip(cohort, fronts, backs)},
                       "global": to_ours(client_net.state_dict(), ns["net_glob_server"].state_dict())})
    return rounds


def main():
    args = common.repository_args()
    out = common.out_dir("splitfed")
    for variant in VARIANTS:
        case, batches = record(variant)
        with default_dtype(torch.float64):
            rounds = authors(args.repo, case, batches)
        torch.save({"case": case, "rounds": rounds}, out / f"{variant}.pt")
    (out / "authors.pt").unlink(missing_ok=True)
    common.write_provenance(
        "splitfed", common.add_repo(args.repo),
        "https://github.com/chandra2thapa/SplitFed-When-Federated-Learning-Meets-Split-Learning", commit=args.commit,
        used=[f"{SCRIPT}: FedAvg, train_server, DatasetSplit, Client.train, the round loop's FedAvg of the fronts "
              "(definitions executed from the parsed script; its module-level data loading and loop are not run)"],
        notes="Dirichlet 0.5 digits, 8 clients, 2 per round for 3 rounds (cohorts 5 6, 1 5, 1 6; shards 111 to "
              "273), the project's CNN (channels 4, 8) cut after block0, BN tracking (momentum 0.1; ours bn "
              "aggregated), one epoch of batch 32, lr 0.05, momentum 0.9. Stand-ins: torch.optim.Adam -> "
              "torch.optim.SGD(lr, momentum 0.9), the server's momentum kept across the script's per-batch "
              "rebuilds for the client's server copy (OptimizerStandIn); DataLoader (yields the project's batches); "
              "the script's globals (networks, bookkeeping lists, criterion CrossEntropyLoss, lr, num_users = "
              "cohort size). Variants: uniform (the script's FedAvg; ours weighting uniform), samples (FedAvg "
              "replaced by the example-weighted mean; ours default). Both sides in float64. Stored per variant "
              "(uniform.pt, samples.pt): the case (batches as SHA-256 digests, case['levels'] the digits' grey "
              "levels) and per round each client's trained front and server copy and the global model.")


if __name__ == "__main__":
    main()
