"""Golden values for MultiSFL from the authors' code (CodeFree-xzk/MultiSFL).

    python tools/reference/multisfl.py /path/to/MultiSFL

Case: Dirichlet digits, 8 clients, 2 per round (two branches), the project's CNN (channels 4
and 8) cut after its first block (client: conv, BN, ReLU, max pool; server: the rest), SGD lr
0.05, momentum 0.9, weight decay 0, one epoch of batch 32, knowledge replay off (the code's
default ``--MR 0``). One round of ``Algorithm/Training_MultiSFL.py: MultiSFL.main`` itself:
each branch's label statistic, ``splitTrain`` (``models/Update.py:
LocalUpdate_MultiSFL.union_train``, the split step on the batches our loop drew), ``Agg`` (the
master: the plain mean of the branches), ``weakAgg`` (each branch pulled to the master with
weights 1 and 10). The cohort and the branch each client trains are ours (``np.random.choice``
answers them), the loaders yield our batches, and evaluation and the result file are switched
off. Also stored: ``selectHelpers`` on fixed label counts and a fixed branch statistic (the
replay requirement per class and what the assistants provide).
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
import tempfile
import types
from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

import common
from reference_case import TRAIN, make_spec, run_one_round, shard

from fl_lightning.algorithms.multisfl import MultiSFL

FRONT = {"features.block0.conv.": "0.", "features.block0.bn.": "1."}
BACK = {"features.block1.conv.": "0.", "features.block1.bn.": "1.", "fc.": "5."}


def halves(initial):
    client = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2))
    server = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                           nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    for module, names in ((client, FRONT), (server, BACK)):
        module.load_state_dict({b + k[len(a):]: v.clone() for k, v in initial.items()
                                for a, b in names.items() if k.startswith(a)})
    return client, server


def to_ours(client_state, server_state):
    out = {}
    for state, names in ((client_state, FRONT), (server_state, BACK)):
        for k, v in state.items():
            for a, b in names.items():
                if k.startswith(b):
                    out[a + k[len(b):]] = v.detach().clone()
    return out


def record():
    spec = make_spec(tempfile.mkdtemp(), MultiSFL(replay=False))
    fed, initial, cohort, batches = run_one_round(spec)
    alg, ctx = fed.algorithm, fed.ctx
    plan = alg.plan(0)
    branch_of = {t.client: t.choice.branch for t in plan.tasks}
    shards = {c: shard(ctx, c)[1] for c in range(ctx.num_clients)}  # labels of every client's shard
    return {"initial": initial, "cohort": cohort, "batches": {c: batches[c] for c in cohort}, "branch": branch_of,
            "labels": shards, "lr": spec.train.lr, "momentum": spec.train.momentum,
            "num_clients": ctx.num_clients}


def stubs():
    """``loguru`` (logging; its ``catch`` decorates the class) and ``wandb`` (off)."""
    loguru = types.ModuleType("loguru")

    class Logger:
        def catch(self, f=None, *args, **kwargs):
            return f if callable(f) else (lambda g: g)

        def info(self, *args, **kwargs):
            pass

        critical = info

    loguru.logger = Logger()
    common.stub_modules("wandb")
    sys.modules.setdefault("loguru", loguru)


class Labels:
    """The training set as the authors' code indexes it: ``dataset[i] -> (image, label)``;
    only labels are read outside the (replaced) loaders."""

    def __init__(self, labels):
        self.labels = labels

    def __getitem__(self, i):
        return None, int(self.labels[i])


@contextlib.contextmanager
def patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def authors(repo, case):
    stubs()
    common.add_repo(repo)
    import models.Update as update
    from Algorithm.Training_MultiSFL import MultiSFL as Authors

    n = case["num_clients"]
    labels, dict_users, start = [], {}, 0
    for c in range(n):  # client c's examples are positions start..start+len-1 of one label list
        y = case["labels"][c].tolist()
        dict_users[c] = list(range(start, start + len(y)))
        labels.extend(y)
        start += len(y)
    args = SimpleNamespace(num_users=n, frac=len(case["cohort"]) / n, num_classes=10, lr=case["lr"],
                           momentum=case["momentum"], weight_decay=0.0, local_ep=1, local_bs=TRAIN.batch_size,
                           device="cpu", MR=0, DB=0, BS=0, AW=0, comm_limit=1e-12, model="cnn",
                           dataset="digits", wandb=False, data_beta=0.5, algorithm="MultiSFL")
    client, server = halves(case["initial"])
    run = Authors(args, nn.Sequential(), Labels(labels), None, dict_users, client, server)
    run.model_size = run.feature_size = 1  # set for resnet/vgg only; they count traffic
    masters = []
    run.test = lambda: masters.append(to_ours(run.net_glob_client.state_dict(), run.net_glob_server.state_dict()))
    run.saveResult = lambda: None
    order = sorted(case["cohort"], key=lambda c: case["branch"][c])  # order[k] trains branch k

    def loader(dataset, batch_size, shuffle):
        client = next(c for c in case["cohort"] if dict_users[c] == dataset.idxs)
        return [(x, y, list(range(len(y)))) for x, y in case["batches"][client]]

    with patched(update, "DataLoader", loader), patched(np.random, "choice", lambda *a, **k: np.array(order)):
        run.main()
    assert run.round == 1 and len(masters) == 1
    branches = [to_ours(c.state_dict(), s.state_dict()) for c, s in zip(run.modelClient, run.modelServer)]
    distributions = [torch.tensor(d, dtype=torch.float64) for d in run.cumulative_label_distributions]
    weights = list(run.cumulative_label_distribution_weight)

    # the replay requirement and the assistants' provision for a fixed branch statistic
    run.cumulative_label_distributions[0] = np.array([40.0, 3.0, 0.0, 25.0, 10.0, 7.0, 0.0, 1.0, 30.0, 12.0])
    curr = order[0]
    run.dict_users = {c: (dict_users[c] * 20 if c == curr else dict_users[c]) for c in dict_users}  # R > C
    random.seed(0)
    helpers, provide = run.selectHelpers(curr, 0)
    replay = {"client": curr, "distribution": torch.tensor(run.cumulative_label_distributions[0]),
              "client_examples": len(run.dict_users[curr]), "budget": 0.01,
              "counts": torch.tensor(np.stack(run.true_labels)), "helpers": helpers,
              "provided": torch.tensor(np.array(provide).sum(axis=0) if provide else np.zeros(10))}
    return {"master": masters[0], "branches": branches, "distributions": distributions, "weights": weights,
            "replay": replay}


def main():
    repo = sys.argv[1]
    torch.set_num_threads(1)
    out = common.out_dir("multisfl")
    case = record()
    torch.save({"case": case, **authors(repo, case)}, out / "authors.pt")
    common.write_provenance(
        "multisfl", common.add_repo(repo), "https://github.com/CodeFree-xzk/MultiSFL",
        used=["Algorithm/Training_MultiSFL.py: MultiSFL.__init__, main (one round: the branch statistics, "
              "splitTrain, Agg, weakAgg), selectHelpers", "models/Update.py: LocalUpdate_MultiSFL.union_train",
              "models/Fed.py: Aggregation"],
        notes="Dirichlet 0.5 digits, 8 clients, 2 per round, the project's CNN (channels 4, 8) cut after block0, SGD "
              "lr 0.05 momentum 0.9 weight decay 0, one epoch of batch 32, MR 0 (no replay; the code's default). "
              "Stand-ins: loguru and wandb (logging), models.Update.DataLoader (yields the project's batches), "
              "np.random.choice during main (returns the project's cohort in branch order), test and saveResult "
              "(the master is recorded where test is called). selectHelpers: branch statistic "
              "[40, 3, 0, 25, 10, 7, 0, 1, 30, 12], the client's shard repeated 20 times so that "
              "floor(0.01 n) exceeds 10.")


if __name__ == "__main__":
    main()
