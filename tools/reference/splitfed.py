"""Golden values for SplitFed V1 from the authors' code
(chandra2thapa/SplitFed-When-Federated-Learning-Meets-Split-Learning).

    python tools/reference/splitfed.py /path/to/SplitFed-When-Federated-Learning-Meets-Split-Learning

The authors' script ``SFLV1_ResNet_HAM10000.py`` runs its data loading and training at module
level, so it cannot be imported; the adapter parses it and executes only its function and class
definitions (``FedAvg``, ``calculate_accuracy``, ``prRed``, ``prGreen``, ``train_server``,
``DatasetSplit``, ``Client``) in a namespace that holds the globals they read: the case's two
halves as ``net_glob_client`` / ``net_glob_server``, ``net_model_server`` (one entry per cohort
client), the script's bookkeeping lists and counters, ``criterion`` and ``lr``. Then, as the
script's round loop: for each cohort client ``Client(...).train(copy of the global front)``
(its front/back steps through ``train_server``), and ``FedAvg`` of the fronts; ``train_server``
itself averages the server copies once every client has trained.

Case: Dirichlet digits, 8 clients, 2 per round, the project's CNN (channels 4 and 8) cut after
its first block (as tools/reference/multisfl.py), one epoch of batch 32, lr 0.05. The script's
optimizers are Adam (the server's rebuilt at every batch); for this case ``torch.optim.Adam``
is replaced by plain SGD at the same rate (momentum 0, weight decay 0), the project's optimizer
with its state-free setting, so the comparison is of the split step and the aggregation, not of
the optimizer. ``DataLoader`` yields the batches our loop drew for the client.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

import common
from multisfl import halves, to_ours
from reference_case import TRAIN, make_spec, run_one_round

from fl_lightning.algorithms.splitfed import SplitFed

SCRIPT = "SFLV1_ResNet_HAM10000.py"
DEFINITIONS = ("FedAvg", "calculate_accuracy", "prRed", "prGreen", "train_server", "DatasetSplit", "Client")


def record():
    spec = make_spec(tempfile.mkdtemp(), SplitFed(cut="block0", version="v1"), train=replace(TRAIN, momentum=0.0))
    fed, initial, cohort, batches = run_one_round(spec)
    sizes = {c: len(fed.ctx.shards[c].indices) for c in cohort}
    return {"initial": initial, "cohort": cohort, "batches": {c: batches[c] for c in cohort}, "sizes": sizes,
            "lr": spec.train.lr, "momentum": 0.0, "cut": "block0"}


def definitions(repo: Path):
    tree = ast.parse((repo / SCRIPT).read_text())
    keep = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in DEFINITIONS]
    assert sorted(n.name for n in keep) == sorted(DEFINITIONS), [n.name for n in keep]
    return compile(ast.Module(body=keep, type_ignores=[]), str(repo / SCRIPT), "exec")


@contextlib.contextmanager
def sgd_for_adam():
    original = torch.optim.Adam
    torch.optim.Adam = lambda params, lr: torch.optim.SGD(params, lr=lr)
    try:
        yield
    finally:
        torch.optim.Adam = original


def authors(repo, case):
    repo = Path(repo)
    client_net, server_net = halves(case["initial"])
    cohort = case["cohort"]
    ns = {"torch": torch, "nn": nn, "copy": copy, "Dataset": torch.utils.data.Dataset,
          "DataLoader": lambda dataset, batch_size, shuffle: case["batches"][dataset.idxs[0]],
          "criterion": nn.CrossEntropyLoss(), "device": torch.device("cpu"), "lr": case["lr"],
          "num_users": len(cohort), "count1": 0, "count2": 0,
          "batch_acc_train": [], "batch_loss_train": [], "batch_acc_test": [], "batch_loss_test": [],
          "loss_train_collect": [], "acc_train_collect": [], "loss_test_collect": [], "acc_test_collect": [],
          "acc_avg_all_user_train": 0, "loss_avg_all_user_train": 0,
          "loss_train_collect_user": [], "acc_train_collect_user": [],
          "loss_test_collect_user": [], "acc_test_collect_user": [],
          "w_locals_server": [], "idx_collect": [], "l_epoch_check": False, "fed_check": False,
          "net_glob_client": client_net, "net_glob_server": server_net}
    ns["w_glob_server"] = server_net.state_dict()
    ns["net_model_server"] = [server_net for _ in cohort]
    ns["net_server"] = copy.deepcopy(server_net)
    exec(definitions(repo), ns)
    averaged = []  # every FedAvg call's inputs: the server copies first (inside train_server), then the fronts
    fedavg = ns["FedAvg"]

    def logged(w):
        averaged.append([{k: v.clone() for k, v in s.items()} for s in w])
        return fedavg(w)

    ns["FedAvg"] = logged
    fronts = []
    with sgd_for_adam():
        for idx, client in enumerate(cohort):  # the script's round loop (its print-only evaluate left out)
            local = ns["Client"](client_net, idx, case["lr"], ns["device"], dataset_train=None, dataset_test=None,
                                 idxs=[client], idxs_test=[client])
            fronts.append(copy.deepcopy(local.train(net=copy.deepcopy(client_net))))
        w_glob_client = ns["FedAvg"](fronts)
    assert len(averaged) == 2 and ns["fed_check"], "train_server did not average the server copies"
    backs, _ = averaged
    locals_ = {client: to_ours(f, b) for client, f, b in zip(cohort, fronts, backs)}
    return {"locals": locals_, "global": to_ours(w_glob_client, ns["w_glob_server"])}


def main():
    repo = sys.argv[1]
    torch.set_num_threads(1)
    out = common.out_dir("splitfed")
    case = record()
    torch.save({"case": case, **authors(repo, case)}, out / "authors.pt")
    common.write_provenance(
        "splitfed", common.add_repo(repo), "https://github.com/chandra2thapa/SplitFed-When-Federated-Learning-Meets-Split-Learning",
        used=[f"{SCRIPT}: FedAvg, train_server, DatasetSplit, Client.train, the round loop's FedAvg of the fronts "
              "(definitions executed from the parsed script; its module-level data loading and loop are not run)"],
        notes="Dirichlet 0.5 digits, 8 clients, 2 per round, the project's CNN (channels 4, 8) cut after block0, "
              "one epoch of batch 32, lr 0.05. Stand-ins: torch.optim.Adam -> torch.optim.SGD(lr) (momentum 0, "
              "weight decay 0) during the round, DataLoader (yields the project's batches), the script's globals "
              "(networks, bookkeeping lists, criterion CrossEntropyLoss, lr, num_users = cohort size). "
              "Stored: each client's trained front and server copy, and the plain-mean aggregate of both.")


if __name__ == "__main__":
    main()
