"""Golden values for SCAFFOLD from PFLlib (TsingZ0/PFLlib).

    python tools/reference/scaffold.py /path/to/PFLlib [--commit SHA]

Case (``pfllib_rounds``): Dirichlet digits, 8 clients of unequal shards, 3 per round for 3
rounds, the project's one-block ViT, plain SGD lr 0.05 (SCAFFOLD's local steps), one epoch of
batch 32, server rate 1. Per round, as ``system/flcore/servers/serverscaffold.py:
SCAFFOLD.train``: every cohort client's ``clientSCAFFOLD.set_parameters`` (the round's global
model and server control variate ``c``), ``clientSCAFFOLD.train`` (``SCAFFOLDOptimizer``: ``w -=
lr (g + c - c_i)``, then option II ``c_i <- c_i - c + (x - y_i) / (K lr)``) on the batches our loop
drew, then ``SCAFFOLD.aggregate_parameters`` (``x += eta_g / |S| sum dy_i``, ``c += 1/N sum dc_i``,
with each client's ``delta_yc``). Each client object, and its ``c_i``, is kept across rounds.

Variants: ``uniform`` (``aggregate_parameters`` as written: the paper's ``1/|S|``; ours with
``weighting: uniform``) and ``samples`` (our default: the same step with ``dy_i`` weighted by
``n_i / sum n``, the weights PFLlib's ``receive_models`` computes; ``weighted_aggregate`` here).
Both sides in float64. Stored per variant: the case (batches as SHA-256 digests, the digits' grey
levels) and per round every cohort client's control variate ``c_i``, the global model and the
server control variate (each state packed into one tensor, ``reference_case.pack``).
"""

from __future__ import annotations

import copy

import torch

import common
import pfllib_rounds as rounds_
from reference_case import default_dtype, pack

from fl_lightning.algorithms.scaffold import Scaffold

VARIANTS = {"uniform": {"weighting": "uniform"}, "samples": {}}


def weighted_aggregate(server, weights):
    """``SCAFFOLD.aggregate_parameters`` with ``1 / num_join_clients`` replaced by each
    client's sample weight (the ``samples`` variant)."""
    global_model = copy.deepcopy(server.global_model)
    global_c = copy.deepcopy(server.global_c)
    for cid, w in zip(server.uploaded_ids, weights):
        dy, dc = server.clients[cid].delta_yc()
        for server_param, client_param in zip(global_model.parameters(), dy):
            server_param.data += client_param.data.clone() * w * server.server_learning_rate
        for server_param, client_param in zip(global_c, dc):
            server_param.data += client_param.data.clone() / server.num_clients
    server.global_model = global_model
    server.global_c = global_c


def named(model, tensors):
    """Per-parameter tensors (PFLlib's lists, in ``parameters()`` order) under our names."""
    names = [name for name, _ in model.named_parameters()]
    return common.vit_to_ours(dict(zip(names, [t.detach().clone() for t in tensors])))


def authors(repo, case, batches):
    rounds_.pfllib(repo)
    from flcore.clients.clientscaffold import clientSCAFFOLD
    from flcore.servers.serverscaffold import SCAFFOLD

    model = rounds_.global_model(case)
    args = common.pfllib_args(model, "SCAFFOLD", "digits", 32, case["lr"])
    client, made = rounds_.clients_for(clientSCAFFOLD, args, case)
    server = SCAFFOLD.__new__(SCAFFOLD)
    server.global_model, server.server_learning_rate = model, 1.0
    server.global_c = [torch.zeros_like(p) for p in model.parameters()]
    server.num_clients, server.clients = case["num_clients"], made
    out = []
    for r, cohort in enumerate(case["cohorts"]):
        for c in cohort:
            me = client(c)
            me.set_parameters(server.global_model, server.global_c)
            rounds_.feed(me, batches[r][c])
            me.train()
        server.uploaded_ids, server.num_join_clients = list(cohort), len(cohort)
        if case["variant"] == "uniform":
            SCAFFOLD.aggregate_parameters(server)
        else:
            weighted_aggregate(server, rounds_.sample_weights(case, cohort))
        out.append({"client_c": {c: pack(named(model, made[c].client_c)) for c in cohort},
                    "global": pack(rounds_.as_ours(server.global_model)), "c": pack(named(model, server.global_c))})
    return out


def main():
    args = common.repository_args()
    out = common.out_dir("scaffold")
    for variant, options in VARIANTS.items():
        case, batches = rounds_.record(Scaffold(**options))
        case.update({"variant": variant, "options": options})
        with default_dtype(torch.float64):
            result = authors(args.repo, case, batches)
        torch.save({"case": case, "rounds": result}, out / f"{variant}.pt")
    common.write_provenance(
        "scaffold", common.add_repo(args.repo), "https://github.com/TsingZ0/PFLlib", commit=args.commit,
        used=["system/flcore/clients/clientscaffold.py: clientSCAFFOLD.__init__, set_parameters, train, update_yc, "
              "delta_yc", "system/flcore/optimizers/fedoptimizer.py: SCAFFOLDOptimizer",
              "system/flcore/servers/serverscaffold.py: SCAFFOLD.aggregate_parameters"],
        notes="Dirichlet 0.5 digits, 8 clients, 3 per round for 3 rounds, the project's one-block ViT (width 8, 4x4 "
              "patches; no batch norm) as PFLlib's base/head pair, plain SGD lr 0.05, one epoch of batch 32, server "
              "rate 1; clients (and their c_i) kept across rounds; the server object built with SCAFFOLD.__new__ "
              "(its constructor reads datasets from disk) holding the global model, c, the clients, N = 8. Variants: "
              "uniform (aggregate_parameters as written; ours weighting uniform), samples (dy_i weighted by n_i / "
              "sum n, weighted_aggregate here; ours default). Both sides in float64. Stand-ins: h5py (result files), "
              "each client's load_train_data (yields the project's batches). Batches stored as SHA-256 digests.")


if __name__ == "__main__":
    main()
