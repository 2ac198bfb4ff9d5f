"""Golden values for FedGH from PFLlib's implementation (TsingZ0/PFLlib).

    python tools/reference/fedgh.py /path/to/PFLlib

Case: Dirichlet digits, 8 clients, 2 per round, the project's one-block ViT (no batch norm,
no dropout: the train/eval mode of the prototype pass does not matter), plain SGD lr 0.05 (PFLlib's
client optimizer), the server header's SGD at lr 0.1 on one batch holding every prototype
of the round (PFLlib batches them; with one batch its shuffle does not matter).

Called: ``clientGH.__init__``, ``set_parameters`` (the header down), ``train`` (on the batches
our loop drew), ``collect_protos`` (on the same batches: the class means of the shard), then
``FedGH.receive_protos`` and ``FedGH.train_head`` on a server holding the initial header and
its SGD optimizer. The authors' repository (LipingYi/FedGH) keeps its whole round inside one
``train()`` function with its data loading, and its header step calls the clients' optimizer
(docs/results/reference_checks.md), so PFLlib is the reference run here.
"""

from __future__ import annotations

import copy
import sys
import tempfile
from dataclasses import replace
from types import SimpleNamespace

import torch
from torch import nn

import common
from reference_case import TRAIN, VIT, make_spec, run_one_round

from fl_lightning.algorithms.personalized.fedgh import FedGH

SERVER_LR = 0.1
SERVER_BATCH = 1000


def record():
    spec = make_spec(tempfile.mkdtemp(), FedGH(server_lr=SERVER_LR, server_batch_size=SERVER_BATCH), model=VIT,
                     train=replace(TRAIN, momentum=0.0))
    fed, initial, cohort, batches = run_one_round(spec)
    return {"initial": initial, "cohort": cohort, "batches": {c: batches[c] for c in cohort},
            "sizes": {c: len(fed.ctx.shards[c]) for c in cohort}, "lr": spec.train.lr,
            "server_lr": SERVER_LR, "server_batch_size": SERVER_BATCH, "model": VIT["init_args"]}


def pfllib(repo, case):
    common.add_repo(repo, "system")
    common.stub_modules("h5py")  # serverbase saves results with it
    from flcore.clients.clientgh import clientGH
    from flcore.servers.servergh import FedGH as ServerGH

    model = common.SplitViT(case["initial"], case["model"])
    args = common.pfllib_args(model, "FedGH", "digits", TRAIN.batch_size, case["lr"])
    head = copy.deepcopy(model.head)
    server = SimpleNamespace(head=head, opt_h=torch.optim.SGD(head.parameters(), lr=case["server_lr"]),
                             CEloss=nn.CrossEntropyLoss(), batch_size=case["server_batch_size"], device="cpu")
    clients, protos = [], {}
    for client in case["cohort"]:
        c = clientGH(args, id=client, train_samples=case["sizes"][client], test_samples=0,
                     train_slow=False, send_slow=False)
        c.load_train_data = lambda batch_size=None, b=case["batches"][client]: b
        c.set_parameters(server.head)
        c.train()
        c.collect_protos()
        clients.append(c)
        protos[client] = {int(k): v.clone() for k, v in c.protos.items()}
    server.selected_clients = clients
    ServerGH.receive_protos(server)
    ServerGH.train_head(server)
    bodies = {c.id: {k: v for k, v in common.model_state(c.model).items() if not k.startswith("vit.head.")}
              for c in clients}
    header = {"vit.head." + k: v.detach().clone() for k, v in server.head.state_dict().items()}
    return {"header": header, "bodies": bodies, "prototypes": protos}


def main():
    repo = sys.argv[1]
    torch.set_num_threads(1)
    out = common.out_dir("fedgh")
    case = record()
    torch.save({"case": case, **pfllib(repo, case)}, out / "pfllib.pt")
    common.write_provenance(
        "fedgh", common.add_repo(repo), "https://github.com/TsingZ0/PFLlib",
        used=["system/flcore/clients/clientgh.py: clientGH.__init__ (clientbase.Client.__init__), set_parameters, "
              "train, collect_protos (agg_func)",
              "system/flcore/servers/servergh.py: FedGH.receive_protos, FedGH.train_head"],
        notes="Dirichlet 0.5 digits, 8 clients, 2 per round, the project's ViT (patch 4, width 8, depth 1, 2 heads), "
              "client SGD lr 0.05 without momentum, one epoch of batch 32; server header SGD lr 0.1 on one batch of all "
              "prototypes. The server object is built by the adapter (head = a copy of the initial head, opt_h = SGD on "
              "it) instead of FedGH.__init__, which reads datasets from disk and takes client 0's head object itself "
              "as the server's header.")


if __name__ == "__main__":
    main()
