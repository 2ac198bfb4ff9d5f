"""Golden values for FedDyn from PFLlib (TsingZ0/PFLlib).

    python tools/reference/feddyn.py /path/to/PFLlib [--commit SHA]

Case (``pfllib_rounds``): Dirichlet digits, 8 clients of unequal shards, 3 per round for 3
rounds, the project's one-block ViT, plain SGD lr 0.05, one epoch of batch 32, ``alpha = 0.1``.
Per round, as ``system/flcore/servers/serverdyn.py: FedDyn.train``: every cohort client's
``clientDyn.set_parameters`` (the round's global model, its anchor) and ``clientDyn.train``
(``loss + alpha / 2 ||theta - theta_global|| - <theta, old_grad>``, then ``old_grad <- old_grad -
alpha (theta - theta_global)``) on the batches our loop drew, then ``FedDyn.update_server_state``
(``h <- h - alpha / N sum (theta_k - theta)``) and ``FedDyn.aggregate_parameters`` (the plain mean
of the uploaded models minus ``h / alpha``). PFLlib's pull is the norm without the square: ours
with ``penalty: norm``, ``weighting: uniform`` (the paper's square is checked by hand in
``tests/test_feddyn.py``). Each client object, and its ``old_grad``, is kept across rounds. Both
sides in float64. Stored: the case (batches as SHA-256 digests, the digits' grey levels) and per
round every cohort client's trained model and ``old_grad``, the global model and ``h``.
"""

from __future__ import annotations

import torch

import common
import pfllib_rounds as rounds_
from reference_case import default_dtype, pack

from fl_lightning.algorithms.feddyn import FedDyn

ALPHA = 0.1
OPTIONS = {"alpha": ALPHA, "penalty": "norm", "weighting": "uniform"}


def named(model, vector):
    """A flat parameter vector (PFLlib's ``model_parameter_vector`` order) under our names."""
    out, start = {}, 0
    for name, p in model.named_parameters():
        out[name] = vector[start:start + p.numel()].reshape(p.shape).detach().clone()
        start += p.numel()
    return common.vit_to_ours(out)


def authors(repo, case, batches):
    rounds_.pfllib(repo)
    from flcore.clients.clientdyn import clientDyn
    from flcore.servers.serverdyn import FedDyn as ServerDyn

    model = rounds_.global_model(case)
    args = common.pfllib_args(model, "FedDyn", "digits", 32, case["lr"], alpha=case["alpha"])
    client, made = rounds_.clients_for(clientDyn, args, case)
    server = ServerDyn.__new__(ServerDyn)
    server.global_model, server.alpha, server.num_clients = model, case["alpha"], case["num_clients"]
    server.server_state = rounds_.global_model(case)
    for p in server.server_state.parameters():
        p.data = torch.zeros_like(p.data)
    out = []
    for r, cohort in enumerate(case["cohorts"]):
        for c in cohort:
            me = client(c)
            me.set_parameters(server.global_model)
            rounds_.feed(me, batches[r][c])
            me.train()
        server.uploaded_models = [made[c].model for c in cohort]
        server.num_join_clients = len(cohort)
        ServerDyn.update_server_state(server)
        ServerDyn.aggregate_parameters(server)
        out.append({"locals": {c: pack(rounds_.as_ours(made[c].model)) for c in cohort},
                    "grads": {c: pack(named(made[c].model, made[c].old_grad)) for c in cohort},
                    "global": pack(rounds_.as_ours(server.global_model)),
                    "h": pack({k: v for k, v in rounds_.as_ours(server.server_state).items()})})
    return out


def main():
    args = common.repository_args()
    out = common.out_dir("feddyn")
    case, batches = rounds_.record(FedDyn(**OPTIONS))
    case.update({"alpha": ALPHA, "options": OPTIONS})
    with default_dtype(torch.float64):
        result = authors(args.repo, case, batches)
    torch.save({"case": case, "rounds": result}, out / "pfllib.pt")
    common.write_provenance(
        "feddyn", common.add_repo(args.repo), "https://github.com/TsingZ0/PFLlib", commit=args.commit,
        used=["system/flcore/clients/clientdyn.py: clientDyn.__init__, set_parameters, train, model_parameter_vector",
              "system/flcore/servers/serverdyn.py: FedDyn.update_server_state, aggregate_parameters, add_parameters"],
        notes="Dirichlet 0.5 digits, 8 clients, 3 per round for 3 rounds, the project's one-block ViT (width 8, 4x4 "
              "patches; no batch norm) as PFLlib's base/head pair, plain SGD lr 0.05, one epoch of batch 32, alpha "
              "0.1; clients (and their old_grad) kept across rounds; the server object built with FedDyn.__new__ (its "
              "constructor reads datasets from disk) holding the global model, alpha, h (zeros) and N = 8. PFLlib's "
              "pull alpha/2 ||theta - theta_global|| is the norm without the square: ours penalty norm, weighting "
              "uniform. Both sides in float64. Stand-ins: h5py (result files), each client's load_train_data (yields "
              "the project's batches). Batches stored as SHA-256 digests.")


if __name__ == "__main__":
    main()
