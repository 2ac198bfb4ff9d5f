"""Golden values for FedProx from PFLlib (TsingZ0/PFLlib).

    python tools/reference/fedprox.py /path/to/PFLlib [--commit SHA]

Case (``pfllib_rounds``): Dirichlet digits, 8 clients of unequal shards, 3 per round for 3
rounds, the project's one-block ViT, plain SGD lr 0.05, one epoch of batch 32, ``mu = 0.01`` (our
default). Per round, as ``system/flcore/servers/serverprox.py: FedProx.train``: every cohort
client's ``clientProx.set_parameters`` (the round's global model, also the proximal anchor) and
``clientProx.train`` (``PerturbedGradientDescent``: ``w -= lr (g + mu (w - w_global))``) on the
batches our loop drew, then ``Server.aggregate_parameters`` over the trained models with the
sample weights ``receive_models`` computes (``n_i / sum n``). Both sides in float64. Stored: the
case (batches as SHA-256 digests, the digits' grey levels) and per round every client's trained
model and the global model (each state packed into one tensor, ``reference_case.pack``).
"""

from __future__ import annotations


import torch

import common
import pfllib_rounds as rounds_
from reference_case import default_dtype, pack

from fl_lightning.algorithms.fedprox import FedProx

MU = 0.01  # FedProx's default here


def authors(repo, case, batches):
    rounds_.pfllib(repo)
    from flcore.clients.clientprox import clientProx
    from flcore.servers.serverbase import Server

    model = rounds_.global_model(case)
    args = common.pfllib_args(model, "FedProx", "digits", 32, case["lr"], mu=case["mu"])
    client, _ = rounds_.clients_for(clientProx, args, case)
    out = []
    for r, cohort in enumerate(case["cohorts"]):
        trained = {}
        for c in cohort:
            me = client(c)
            me.set_parameters(model)
            rounds_.feed(me, batches[r][c])
            me.train()
            trained[c] = me.model
        server = rounds_.server(uploaded_models=[trained[c] for c in cohort],
                                uploaded_weights=rounds_.sample_weights(case, cohort))
        server.add_parameters = lambda w, m, s=server: Server.add_parameters(s, w, m)
        Server.aggregate_parameters(server)
        model = server.global_model
        out.append({"locals": {c: pack(rounds_.as_ours(trained[c])) for c in cohort},
                    "global": pack(rounds_.as_ours(model))})
    return out


def main():
    args = common.repository_args()
    out = common.out_dir("fedprox")
    case, batches = rounds_.record(FedProx(mu=MU))
    case["mu"] = MU
    with default_dtype(torch.float64):
        result = authors(args.repo, case, batches)
    torch.save({"case": case, "rounds": result}, out / "pfllib.pt")
    common.write_provenance(
        "fedprox", common.add_repo(args.repo), "https://github.com/TsingZ0/PFLlib", commit=args.commit,
        used=["system/flcore/clients/clientprox.py: clientProx.__init__, set_parameters, train",
              "system/flcore/optimizers/fedoptimizer.py: PerturbedGradientDescent",
              "system/flcore/servers/serverbase.py: Server.aggregate_parameters, add_parameters"],
        notes="Dirichlet 0.5 digits, 8 clients, 3 per round for 3 rounds, the project's one-block ViT (width 8, 4x4 "
              "patches; no batch norm) as PFLlib's base/head pair, plain SGD lr 0.05, one epoch of batch 32, mu 0.01 "
              "(the project's default); clients kept across rounds; the server step on a server object built here "
              "(its constructor reads datasets from disk) with receive_models' sample weights n_i / sum n. Both sides "
              "in float64. Stand-ins: h5py (result files), each client's load_train_data (yields the project's "
              "batches). Batches stored as SHA-256 digests.")


if __name__ == "__main__":
    main()
