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
``torch.optim.Adam`` becomes ``SGD(lr, momentum 0.9)`` (``splitfed.OptimizerStandIn``): the
client's, built once per ``Client.train``, lives through its local epoch (as the authors' Adam
state); the server's, which the script rebuilds at every batch (line 256, so no Adam state
carries there), keeps one set of momentum buffers across batches, clients and rounds, as the
project's server half does.

Case: Dirichlet digits, 8 clients of unequal shards, **3** per round for 3 rounds (with 2 the
project's seeded order for seed 0 is the sampled order itself; with 3 the orders are 6 5 4, 5 1
2 and 6 5 1, so the case also fixes that the server visits the clients in the shuffled order),
the project's CNN (channels 4 and 8) cut after its first block (as tools/reference/multisfl.py),
BN tracking running statistics (ours with ``bn: aggregated``), one epoch of batch 32, lr 0.05,
momentum 0.9. The script's round loop runs once per round. Variants: ``uniform`` (the script's
``FedAvg`` of the fronts, a plain mean; ours with ``weighting: uniform``) and ``samples`` (the
example-weighted mean; ours by default). Both sides run in float64 (networks and batches
converted). Stored per variant (``uniform.pt``, ``samples.pt``): the case (initial model,
cohorts in training order, shard sizes, a SHA-256 digest of every batch instead of the batches,
the digits' grey levels), and per round every client's trained front, the server half after the
round and the script's global.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import io
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

import common
from multisfl import halves, to_ours
from reference_case import default_dtype
from splitfed import OptimizerStandIn, VARIANTS, adam_replaced, definitions, record, weighted_fedavg

SCRIPT = "SFLV2_ResNet_HAM10000.py"
DEFINITIONS = ("prRed", "prGreen", "FedAvg", "calculate_accuracy", "train_server", "evaluate_server",
               "DatasetSplit", "Client")
CLIENTS_PER_ROUND = 3


def script_parts(repo: Path):
    """The script's definitions and its round loop, compiled from the parsed file."""
    tree = ast.parse((repo / SCRIPT).read_text())
    loops = [n for n in tree.body if isinstance(n, ast.For) and isinstance(n.target, ast.Name)
             and n.target.id == "iter" and ast.unparse(n.iter) == "range(epochs)"]
    assert len(loops) == 1, "the script's round loop was not found"
    loop = compile(ast.Module(body=loops, type_ignores=[]), str(repo / SCRIPT), "exec")
    return definitions(repo, DEFINITIONS, SCRIPT), loop, loops[0].lineno


def authors(repo, case, batches):
    """The case's rounds through the script's loop, in float64."""
    repo = Path(repo)
    definitions_, loop, _ = script_parts(repo)
    client_net, server_net = (m.double() for m in halves({k: v.double() if v.is_floating_point() else v
                                                          for k, v in case["initial"].items()}))
    ns = {"torch": torch, "nn": nn, "copy": copy, "Dataset": torch.utils.data.Dataset,
          "criterion": nn.CrossEntropyLoss(), "device": torch.device("cpu"), "lr": case["lr"],
          "num_users": case["clients_per_round"], "frac": 1, "epochs": 1,
          "dataset_train": None, "dataset_test": None,
          "count1": 0, "count2": 0,
          "batch_acc_train": [], "batch_loss_train": [], "batch_acc_test": [], "batch_loss_test": [],
          "loss_train_collect": [], "acc_train_collect": [], "loss_test_collect": [], "acc_test_collect": [],
          "acc_avg_all_user_train": 0, "loss_avg_all_user_train": 0,
          "loss_train_collect_user": [], "acc_train_collect_user": [],
          "loss_test_collect_user": [], "acc_test_collect_user": [],
          "idx_collect": [], "l_epoch_check": False, "fed_check": False,
          "net_glob_client": client_net, "net_glob_server": server_net}
    exec(definitions_, ns)
    script_fedavg = ns["FedAvg"]
    trained = []  # the clients in the order the script trained them
    train = ns["Client"].train
    users = []

    def logged(self, net):
        trained.append(users[self.idx])
        return train(self, net)

    ns["Client"].train = logged
    stand_in = OptimizerStandIn(case["momentum"], lambda params: params[0] is next(server_net.parameters()),
                                lambda: "server")
    rounds = []
    for r, order in enumerate(case["cohorts"]):
        users[:] = sorted(order)  # the script's users 0..n-1 are the round's clients in increasing order
        drawn = [users.index(c) for c in order]

        def choice(population, m, replace, drawn=drawn):
            assert list(population) == list(range(len(users))) and m == len(users) and replace is False
            return list(drawn)

        ns["np"] = SimpleNamespace(random=SimpleNamespace(choice=choice))
        ns["DataLoader"] = lambda dataset, batch_size, shuffle, r=r: batches[r][dataset.idxs[0]]
        ns["dict_users"] = ns["dict_users_test"] = {i: [c] for i, c in enumerate(users)}
        ns["FedAvg"] = script_fedavg if case["variant"] == "uniform" else weighted_fedavg(
            [case["sizes"][c] for c in order])
        trained.clear()
        with adam_replaced(stand_in), contextlib.redirect_stdout(io.StringIO()):
            exec(loop, ns)
        assert trained == order, (trained, order)
        assert len(ns["loss_train_collect"]) == r + 1 and len(ns["loss_test_collect"]) == r + 1, "round incomplete"
        assert ns["net_glob_server"] is server_net, "the script replaced its server half"
        rounds.append({"locals": {c: to_ours(f, {}) for c, f in zip(order, ns["w_locals_client"])},
                       "server": to_ours({}, server_net.state_dict()),
                       "global": to_ours(client_net.state_dict(), server_net.state_dict())})
    return rounds


def main():
    args = common.repository_args()
    out = common.out_dir("splitfed_v2")
    for variant in VARIANTS:
        case, batches = record(variant, "v2", CLIENTS_PER_ROUND)
        with default_dtype(torch.float64):
            rounds = authors(args.repo, case, batches)
        torch.save({"case": case, "rounds": rounds}, out / f"{variant}.pt")
    (out / "authors.pt").unlink(missing_ok=True)
    _, _, line = script_parts(Path(args.repo))
    common.write_provenance(
        "splitfed_v2", common.add_repo(args.repo),
        "https://github.com/chandra2thapa/SplitFed-When-Federated-Learning-Meets-Split-Learning", commit=args.commit,
        used=[f"{SCRIPT}: prRed, prGreen, FedAvg, calculate_accuracy, train_server, evaluate_server, DatasetSplit, "
              f"Client (train, evaluate) as definitions executed from the parsed script, and its round loop "
              f"(the module-level `for iter in range(epochs)` at line {line}) executed unchanged once per round; "
              "its module-level data loading, model building and result file are not run"],
        notes="Dirichlet 0.5 digits, 8 clients, 3 per round for 3 rounds (trained in the project's seeded orders "
              "6 5 4, 5 1 2, 6 5 1; shards 111 to 273), the project's CNN (channels 4, 8) cut after block0, BN "
              "tracking (ours bn aggregated), one epoch of batch 32, lr 0.05, momentum 0.9. Stand-ins: "
              "torch.optim.Adam -> torch.optim.SGD(lr, momentum 0.9), the server's momentum kept across the "
              "script's per-batch rebuilds, clients and rounds (splitfed.OptimizerStandIn); np.random.choice (the "
              "positions of the project's cohort in its training order); dict_users and dict_users_test (position "
              "-> client) and DataLoader (yields the batches the project's loop drew for that client, for evaluate "
              "too); the script's globals (networks, bookkeeping lists, criterion CrossEntropyLoss, lr, num_users "
              "= 3, frac = 1, epochs = 1); print output discarded. Variants: uniform (the script's FedAvg; ours "
              "weighting uniform), samples (FedAvg replaced by the example-weighted mean; ours default). Both sides "
              "in float64. Stored per variant: the case with a SHA-256 digest of every batch (not the batches) and "
              "the digits' grey levels, per round each client's trained front, the server half and the global.")


if __name__ == "__main__":
    main()
