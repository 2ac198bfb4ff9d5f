"""Golden values for FedAS from the authors' code (xiyuanyang45/FedAS) and PFLlib.

    python tools/reference/fedas.py /path/to/FedAS /path/to/PFLlib

Case: Dirichlet digits, 8 clients, the project's one-block ViT (no batch norm, no dropout, as
the originals' FedAvgCNN), plain SGD lr 0.05 (the clients' optimizer in both codes), one
epoch of batch 32; alignment with the original's hard-coded lr 0.01, batch 16, one epoch.

Per client: ``clientAS.set_parameters(global model, progress)`` (prototypes of the client's
previous model and the alignment of the received body, on the alignment batches our loop
drew), ``clientAS.train(True)`` (local training on our training batches, then the Fisher
trace on our Fisher batches: the shard in order, batches of 32), and the server's
``FedAS.aggregate_wrt_fisher``.

authors.pt: one client in the round. The authors' server hands every client the same
global model object, aligned in place (docs/fl_baselines.md, FedAS departure 1), so with
one client the round is the same whichever reading. pfllib.pt: two clients; PFLlib's
server sends each one a deep copy, as the paper and the project.
"""

from __future__ import annotations

import copy
import sys
import tempfile
from dataclasses import replace
from types import SimpleNamespace

import torch

import common
from reference_case import TRAIN, VIT, make_spec, run_one_round

from fl_lightning.algorithms.personalized.fedas import FedAS


def record(clients_per_round):
    spec = make_spec(tempfile.mkdtemp(), FedAS(), model=VIT, train=replace(TRAIN, momentum=0.0),
                     clients_per_round=clients_per_round)
    fed, initial, cohort, batches = run_one_round(spec)
    case = {"initial": initial, "cohort": cohort, "lr": spec.train.lr, "model": VIT["init_args"],
            "batches": {c: batches[c] for c in cohort},
            "align_batches": {c: batches[(c, 16)] for c in cohort},
            "sizes": {c: len(fed.ctx.shards[c]) for c in cohort}}
    fisher = {}
    for c in cohort:  # the Fisher pass: the shard in order, batches of train.batch_size
        data = fed.ctx.shards[c]
        x, y = data.dataset.data[data.indices], data.dataset.targets[data.indices]
        fisher[c] = [(x[i:i + TRAIN.batch_size], y[i:i + TRAIN.batch_size]) for i in range(0, len(y), TRAIN.batch_size)]
    case["fisher_batches"] = {c: joined(b) for c, b in fisher.items()}
    case["align_batches"] = {c: joined(b) for c, b in case["align_batches"].items()}
    return case


def joined(batches):
    """A one-row last batch joined to the one before, as the project's alignment and Fisher
    passes batch (the reference's loaders would drop it: ``drop_last=True``)."""
    if len(batches) > 1 and len(batches[-1][1]) == 1:
        (x0, y0), (x1, y1) = batches[-2], batches[-1]
        batches = batches[:-2] + [(torch.cat([x0, x1]), torch.cat([y0, y1]))]
    return batches


class ById(list):
    """The server's client list: iterated as the clients, indexed by client id."""

    def __init__(self, clients):
        super().__init__(clients.values())
        self.by_id = clients

    def __getitem__(self, client):
        return self.by_id[client]


def run(repo, case, authors):
    common.add_repo(repo, "system")
    common.stub_modules("h5py", "opacus", "torchviz", **{"opacus.PrivacyEngine": None, "torchviz.make_dot": None})
    from flcore.clients.clientas import clientAS
    from flcore.servers.serverbase import Server
    from flcore.servers.serveras import FedAS as ServerAS

    model = common.SplitViT(case["initial"], case["model"])
    args = common.pfllib_args(model, "FedAS", "digits", TRAIN.batch_size, case["lr"], privacy=False, dp_sigma=0.0,
                              yxy_hyper=20, wo_local=False)
    clients = {}
    for client in case["cohort"]:
        c = clientAS(args, id=client, train_samples=case["sizes"][client], test_samples=0,
                     train_slow=False, send_slow=False)
        answers = iter([case["batches"][client], case["fisher_batches"][client]])
        c.load_train_data = (lambda batch_size=None, a=answers, al=case["align_batches"][client]:
                             al if batch_size == 16 else next(a))
        clients[client] = c
    server = SimpleNamespace(clients=ById(clients), global_model=copy.deepcopy(model), global_rounds=1)
    server.add_parameters = lambda w, m: Server.add_parameters(server, w, m)
    ServerAS.send_selected_models(server, list(case["cohort"]), 0)
    aligned = {i: common.model_state(c.model) for i, c in clients.items()}
    for c in clients.values():
        c.train(True)
    server.uploaded_ids = list(case["cohort"])
    server.uploaded_models = [clients[i].model for i in case["cohort"]]
    ServerAS.aggregate_wrt_fisher(server)
    return {"global": common.model_state(server.global_model),
            "locals": {i: common.model_state(c.model) for i, c in clients.items()},
            "aligned": aligned,
            "fisher": {i: c.fim_trace_history[-1] for i, c in clients.items()}}


def main():
    authors_repo, pfllib_repo = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    out = common.out_dir("fedas")
    case = record(1)
    torch.save({"case": case, **run(authors_repo, case, authors=True)}, out / "authors.pt")
    case2 = record(2)
    torch.save({"case": case2, **run(pfllib_repo, case2, authors=False)}, out / "pfllib.pt")
    used = ["system/flcore/clients/clientas.py: clientAS.__init__ (clientbase.Client.__init__), set_parameters "
            "(prototypes and alignment), train(is_selected=True) (local training and Fisher trace)",
            "system/flcore/servers/serveras.py: FedAS.send_selected_models, FedAS.aggregate_wrt_fisher "
            "(serverbase.Server.add_parameters)"]
    common.write_provenance(
        "fedas", common.add_repo(authors_repo), "https://github.com/xiyuanyang45/FedAS", used=used,
        notes="authors.pt: Dirichlet 0.5 digits, 8 clients, 1 per round; the project's ViT (patch 4, width 8, "
              "depth 1, 2 heads); client SGD lr 0.05 without momentum, one epoch of batch 32. Stubbed imports: h5py "
              "(results files), opacus (differential privacy, off), torchviz (graph drawing). The server object is "
              "built by the adapter (clients, global_model, global_rounds) instead of FedAS.__init__, which reads "
              "datasets from disk; uploaded_ids/uploaded_models are the round's clients in cohort order.",
        pfllib_repository="https://github.com/TsingZ0/PFLlib",
        pfllib_commit=common.commit_of(common.add_repo(pfllib_repo)), pfllib_used=used,
        pfllib_notes="pfllib.pt: the same with 2 clients per round (PFLlib aligns a deep copy of the global model "
                     "per client).")


if __name__ == "__main__":
    main()
