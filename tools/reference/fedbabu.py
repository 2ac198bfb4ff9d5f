"""Golden values for FedBABU from the authors' code (jhoon-oh/FedBABU) and from PFLlib.

    python tools/reference/fedbabu.py /path/to/FedBABU /path/to/PFLlib

Authors' case: iid digits, 6 clients of 223 examples, clients 2 per round, SGD lr 0.05,
momentum 0.9; each client runs ``models/Update.py: LocalUpdate.train(net, body_lr=lr,
head_lr=0.)`` on the batches our loop drew for it, the server averages the returned state
dicts with ``models/Fed.py: FedAvg`` (a plain mean; the shards are equal, so it is also our
sample-weighted mean).

PFLlib case: Dirichlet digits (unequal shards), plain SGD (PFLlib's client optimizer has no
momentum); ``clientBABU.train`` per client, then ``Server.aggregate_parameters`` over the
uploaded bodies with sample weights (``serverbabu.FedBABU.receive_models``' weights).
"""

from __future__ import annotations

import copy
import sys
import tempfile
from dataclasses import replace
from types import SimpleNamespace

import torch

import common
from reference_case import TRAIN, make_spec, run_one_round

from fl_lightning.algorithms.personalized.fedbabu import FedBABU


def record(partition, train):
    spec = make_spec(tempfile.mkdtemp(), FedBABU(finetune_epochs=0), num_clients=6, partition=partition, train=train)
    fed, initial, cohort, batches = run_one_round(spec)
    common.check_same_function(initial, batches[cohort[0]])
    sizes = {c: len(fed.ctx.shards[c]) for c in cohort}
    return {"initial": initial, "cohort": cohort, "batches": batches, "sizes": sizes,
            "lr": train.lr, "momentum": train.momentum, "partition": partition}


def authors(repo, case):
    common.add_repo(repo)
    from models.Fed import FedAvg
    from models.Update import LocalUpdate

    args = SimpleNamespace(local_bs=TRAIN.batch_size, momentum=case["momentum"], wd=0.0, device="cpu",
                           local_ep=1, local_ep_pretrain=0)
    locals_ = []
    for client in case["cohort"]:
        net = common.plain_model(case["initial"], head_name="linear")
        local = LocalUpdate(args=args, dataset=[(torch.zeros(1), 0)], idxs=[0])
        local.ldr_train = case["batches"][client]  # the batches our loop drew, in its order
        w_local, _ = local.train(net=net, body_lr=case["lr"], head_lr=0.0)
        locals_.append(copy.deepcopy(w_local))
    w_glob = FedAvg(locals_)
    return common.to_ours(w_glob, head_name="linear")


def pfllib(repo, case):
    common.add_repo(repo, "system")
    common.stub_modules("h5py")  # serverbase saves results with it
    from flcore.clients.clientbabu import clientBABU
    from flcore.servers.serverbase import Server

    model = common.plain_model(case["initial"], head_name="head")
    args = common.pfllib_args(model, "FedBABU", "digits", TRAIN.batch_size, case["lr"], fine_tuning_epochs=0)
    uploaded, weights = [], []
    for client in case["cohort"]:
        c = clientBABU(args, id=client, train_samples=case["sizes"][client], test_samples=0,
                       train_slow=False, send_slow=False)
        c.load_train_data = lambda batch_size=None, b=case["batches"][client]: b
        c.set_parameters(model.base)
        c.train()
        uploaded.append(c.model.base)
        weights.append(c.train_samples)
    server = SimpleNamespace(uploaded_models=uploaded, uploaded_weights=[w / sum(weights) for w in weights])
    server.add_parameters = lambda w, m: Server.add_parameters(server, w, m)
    Server.aggregate_parameters(server)
    body = {"base." + k: v for k, v in server.global_model.state_dict().items()}
    body.update({"head." + k: v for k, v in model.head.state_dict().items()})
    return common.to_ours(body, head_name="head")


def main():
    authors_repo, pfllib_repo = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    out = common.out_dir("fedbabu")
    case = record("iid", TRAIN)
    result = authors(authors_repo, case)
    torch.save({"case": case, "global": result}, out / "authors.pt")
    case2 = record("dirichlet", replace(TRAIN, momentum=0.0))
    result2 = pfllib(pfllib_repo, case2)
    torch.save({"case": case2, "global": result2}, out / "pfllib.pt")
    common.write_provenance(
        "fedbabu", common.add_repo(authors_repo), "https://github.com/jhoon-oh/FedBABU",
        used=["models/Update.py: LocalUpdate.train (body_lr=lr, head_lr=0, as main_fed.py with --local_upt_part body)",
              "models/Fed.py: FedAvg (the plain mean of the returned state dicts)"],
        notes="authors.pt: iid digits (6 clients of 223), lr 0.05, momentum 0.9, one epoch of batch 32. "
              "pfllib.pt: see pfllib_* fields.",
        pfllib_repository="https://github.com/TsingZ0/PFLlib", pfllib_commit=common.commit_of(common.add_repo(pfllib_repo)),
        pfllib_used=["system/flcore/clients/clientbabu.py: clientBABU.__init__, set_parameters, train",
                     "system/flcore/servers/serverbase.py: Server.aggregate_parameters, add_parameters"],
        pfllib_notes="Dirichlet 0.5 digits (6 clients), plain SGD lr 0.05 (PFLlib's client optimizer), sample "
                     "weights n_i / sum n as serverbabu.FedBABU.receive_models; PFLlib aggregates parameters "
                     "only (buffers are the first uploaded body's), so only parameters are compared.")


if __name__ == "__main__":
    main()
