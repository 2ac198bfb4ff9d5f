"""Golden values for SplitFed V2 from the authors' code
(chandra2thapa/SplitFed-When-Federated-Learning-Meets-Split-Learning).

    python tools/reference/splitfed_v2.py /path/to/SplitFed-When-Federated-Learning-Meets-Split-Learning

What V2 is in ``SFLV2_ResNet_HAM10000.py``: there is one server half, the global
``net_glob_server``; ``train_server`` steps it on every batch any client sends, so it is trained
sequentially, client after client in the order ``np.random.choice(range(num_users), m,
replace=False)`` draws (a random order each round); it is never copied per client and never
averaged. Every client starts from a copy of the round's global front (``net_glob_client``), and
at the end of the round the fronts alone are averaged (``FedAvg``, a plain mean).

The script runs its data loading and training at module level, so it cannot be imported; the
adapter parses it and executes only its function and class definitions (``prRed``,
``prGreen``, ``FedAvg``, ``calculate_accuracy``, ``train_server``, ``evaluate_server``,
``DatasetSplit``, ``Client``) and then its round loop itself (the module-level ``for iter in
range(epochs)`` statement, unchanged, for ``epochs = 1``) in a namespace that holds the
globals they read: the case's two halves as ``net_glob_client`` / ``net_glob_server``, the
script's bookkeeping lists and counters, ``criterion``, ``lr``, ``num_users`` (the cohort
size) and ``frac = 1`` (the script's own value: every user takes part, in a random order).

Stand-ins: ``np.random.choice`` returns the positions of our cohort in our (shuffled) training
order; ``dict_users`` / ``dict_users_test`` map a position to its client, and ``DataLoader``
yields the batches our loop drew for that client (for the script's per-client ``evaluate``
too, which runs ``net_glob_server`` in eval mode under ``no_grad`` and changes nothing);
``torch.optim.Adam`` is replaced by plain SGD at the same rate (momentum 0, weight decay 0), the
project's optimizer with its state-free setting, so that the comparison is of the split step,
the order and the aggregation, not of the optimizer (the script rebuilds the server's Adam at
every batch, line 256, so no optimizer state carries across batches there).

Case: Dirichlet digits, 8 clients, **3** per round (with 2 the project's seeded order for seed 0
is the sampled order itself; with 3 it is 6, 5, 4, so the case also fixes that the server
visits the clients in the shuffled order), the project's CNN (channels 4 and 8) cut after its
first block (as tools/reference/multisfl.py), one epoch of batch 32, lr 0.05. The authors' code
runs twice: in float64 (the networks and batches converted; the golden values) and in float32
(the script as it is; its distance to the float64 run is the float32 rounding of this case).
Stored: the case (initial model, cohort in training order, shard sizes, a SHA-256 digest of
every batch instead of the batches, to keep the file small), and for each precision every
client's trained front, the server half after the round and the script's plain-mean global.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import io
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

import common
from multisfl import halves, to_ours
from reference_case import TRAIN, batch_digest, make_spec, run_one_round
from splitfed import sgd_for_adam

from fl_lightning.algorithms.splitfed import SplitFed

SCRIPT = "SFLV2_ResNet_HAM10000.py"
DEFINITIONS = ("prRed", "prGreen", "FedAvg", "calculate_accuracy", "train_server", "evaluate_server",
               "DatasetSplit", "Client")
CLIENTS_PER_ROUND = 3


def record():
    """Our side's round 0 (momentum 0): the initial model, the cohort in training order and the
    batches every client drew."""
    spec = make_spec(tempfile.mkdtemp(), SplitFed(cut="block0", version="v2"), train=replace(TRAIN, momentum=0.0),
                     clients_per_round=CLIENTS_PER_ROUND)
    fed, initial, cohort, batches = run_one_round(spec)
    sizes = {c: len(fed.ctx.shards[c].indices) for c in cohort}
    case = {"initial": initial, "order": list(cohort), "sizes": sizes, "lr": spec.train.lr, "momentum": 0.0,
            "cut": "block0", "clients_per_round": CLIENTS_PER_ROUND,
            "digests": {c: [batch_digest(x, y) for x, y in batches[c]] for c in cohort}}
    return case, {c: batches[c] for c in cohort}


def script_parts(repo: Path):
    """The script's definitions and its round loop, compiled from the parsed file."""
    tree = ast.parse((repo / SCRIPT).read_text())
    keep = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in DEFINITIONS]
    assert sorted(n.name for n in keep) == sorted(DEFINITIONS), [n.name for n in keep]
    loops = [n for n in tree.body if isinstance(n, ast.For) and isinstance(n.target, ast.Name)
             and n.target.id == "iter" and ast.unparse(n.iter) == "range(epochs)"]
    assert len(loops) == 1, "the script's round loop was not found"
    compiled = [compile(ast.Module(body=body, type_ignores=[]), str(repo / SCRIPT), "exec") for body in (keep, loops)]
    return compiled[0], compiled[1], loops[0].lineno


def authors(repo, case, batches, dtype=torch.float64):
    """One round of the script's loop on the case, in ``dtype``."""
    repo = Path(repo)
    definitions, loop, _ = script_parts(repo)
    client_net, server_net = (m.to(dtype) for m in halves(case["initial"]))
    order = case["order"]
    users = sorted(order)  # the script's users 0..n-1 are our cohort's clients in increasing order
    drawn = [users.index(c) for c in order]

    def choice(population, m, replace):
        assert list(population) == list(range(len(users))) and m == len(users) and replace is False
        return list(drawn)

    typed = {c: [(x.to(dtype), y) for x, y in batches[c]] for c in order}
    ns = {"torch": torch, "nn": nn, "copy": copy, "Dataset": torch.utils.data.Dataset,
          "np": SimpleNamespace(random=SimpleNamespace(choice=choice)),
          "DataLoader": lambda dataset, batch_size, shuffle: typed[dataset.idxs[0]],
          "criterion": nn.CrossEntropyLoss(), "device": torch.device("cpu"), "lr": case["lr"],
          "num_users": len(users), "frac": 1, "epochs": 1,
          "dict_users": {i: [c] for i, c in enumerate(users)}, "dict_users_test": {i: [c] for i, c in enumerate(users)},
          "dataset_train": None, "dataset_test": None,
          "count1": 0, "count2": 0,
          "batch_acc_train": [], "batch_loss_train": [], "batch_acc_test": [], "batch_loss_test": [],
          "loss_train_collect": [], "acc_train_collect": [], "loss_test_collect": [], "acc_test_collect": [],
          "acc_avg_all_user_train": 0, "loss_avg_all_user_train": 0,
          "loss_train_collect_user": [], "acc_train_collect_user": [],
          "loss_test_collect_user": [], "acc_test_collect_user": [],
          "idx_collect": [], "l_epoch_check": False, "fed_check": False,
          "net_glob_client": client_net, "net_glob_server": server_net}
    exec(definitions, ns)
    trained = []  # the clients in the order the script trained them
    train = ns["Client"].train

    def logged(self, net):
        trained.append(users[self.idx])
        return train(self, net)

    ns["Client"].train = logged
    with sgd_for_adam(), contextlib.redirect_stdout(io.StringIO()):
        exec(loop, ns)
    assert trained == order, (trained, order)
    assert len(ns["loss_train_collect"]) == 1 and len(ns["loss_test_collect"]) == 1, "the round did not complete"
    server = ns["net_glob_server"]
    assert server is server_net, "the script replaced its server half"
    fronts = ns["w_locals_client"]
    return {"locals": {c: to_ours(f, {}) for c, f in zip(order, fronts)},
            "server": to_ours({}, server.state_dict()),
            "global": to_ours(ns["w_glob_client"], server.state_dict())}


def main():
    repo = sys.argv[1]
    torch.set_num_threads(1)
    out = common.out_dir("splitfed_v2")
    case, batches = record()
    results = {"float64": authors(repo, case, batches, torch.float64),
               "float32": authors(repo, case, batches, torch.float32)}
    torch.save({"case": case, **results}, out / "authors.pt")
    _, _, line = script_parts(Path(repo))
    common.write_provenance(
        "splitfed_v2", common.add_repo(repo),
        "https://github.com/chandra2thapa/SplitFed-When-Federated-Learning-Meets-Split-Learning",
        used=[f"{SCRIPT}: prRed, prGreen, FedAvg, calculate_accuracy, train_server, evaluate_server, DatasetSplit, "
              f"Client (train, evaluate) as definitions executed from the parsed script, and its round loop "
              f"(the module-level `for iter in range(epochs)` at line {line}) executed unchanged for one round; "
              "its module-level data loading, model building and result file are not run"],
        notes="Dirichlet 0.5 digits, 8 clients, 3 per round (trained in the project's seeded order 6, 5, 4), the "
              "project's CNN (channels 4, 8) cut after block0, one epoch of batch 32, lr 0.05. Stand-ins: "
              "torch.optim.Adam -> torch.optim.SGD(lr) (momentum 0, weight decay 0) during the round; "
              "np.random.choice (the positions of the project's cohort in its training order); dict_users and "
              "dict_users_test (position -> client) and DataLoader (yields the batches the project's loop drew for "
              "that client, for evaluate too); the script's globals (networks, bookkeeping lists, criterion "
              "CrossEntropyLoss, lr, num_users = 3, frac = 1, epochs = 1); print output discarded. Run in float64 "
              "(networks and batches converted; the golden values) and in float32. Stored: the case with a SHA-256 "
              "digest of every batch (not the batches), each client's trained front, the server half after the "
              "round, and the script's global (plain mean of the fronts, the server half).")


if __name__ == "__main__":
    main()
