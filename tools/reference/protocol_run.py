"""Multi-round runs of a reference implementation under the project's offline protocol.

    python tools/reference/protocol_run.py METHOD REPO --seed S --rounds R --out FILE.json \
        [--config CONFIG] [--every 5] [METHOD OPTIONS]

METHOD: fedgh (REPO: PFLlib), fedmut (HMHelloWorld/FedMut), fedas (xiyuanyang45/FedAS or PFLlib),
multisfl (CodeFree-xzk/MultiSFL). The protocol comes from the
project's config (default ``configs/split/offline/mnist_subset/resnet18_narrow/METHOD.yaml``)
through the project's own parser, data and partition code: the same 20 Dirichlet(0.1) shards,
the same initial ResNet-18 (width 0.125, seed stream of the global model), and, per client and
round, exactly the mini-batches our loop draws (``ClientData.epoch`` with the round's client
generator). The reference's own client update and server aggregation run on them (the
golden adapters, ``tools/reference/<method>.py``, show the single-round equivalence).
Every ``--every`` rounds the quantity our code reports is scored on the test and validation
splits: FedGH the mean over clients of (own body + global header), FedAS the mean of the clients'
models (and its Fisher-weighted global), FedMut the global model, MultiSFL the master.
The curve and its provenance are written as JSON.

Variants, each switching one choice of the reference to the project's: fedgh
``--batch-stat-protos``, fedas ``--batch-stat-fedas`` (batch-norm batch statistics in those
passes), fedmut ``--keep-buffers`` (statistics not mutated); multisfl ``--replay`` turns on the
code's knowledge replay (``MR`` 1), which the project's MultiSFL runs by default.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

import common

from fl_lightning.cli import load_fit_config
from fl_lightning.data.federated import build_federated_data
from fl_lightning.elastic.bn import batch_statistics
from fl_lightning.elastic.models import build_model
from fl_lightning.federation.builder import MODEL_INIT
from fl_lightning.runtime.client_data import ClientData, eval_batches
from fl_lightning.runtime.seeding import client_generator, derive_seed, seed_client


# -- our protocol -------------------------------------------------------------------------------
class Protocol:
    def __init__(self, config: str, seed: int):
        cfg = load_fit_config(config)
        self.cfg, self.seed, self.train = cfg, seed, cfg.train
        self.fed = build_federated_data(cfg.data, cfg.partition, seed)
        b = self.fed.bundle
        self.make = lambda: build_model(cfg.model, b.num_classes, b.input_shape)
        torch.manual_seed(derive_seed(seed, MODEL_INIT))  # as build_global_model
        self.initial = self.make().state_dict()
        self.shards = [ClientData(b.train, idx, cfg.train.batch_size, None) for idx in self.fed.clients]
        self.num_clients = len(self.shards)

    def batches(self, round_idx: int, client: int):
        """The mini-batches our loop feeds ``client`` in ``round_idx`` (seeded as our loop seeds)."""
        seed_client(self.seed, round_idx, client)
        g = client_generator(self.seed, round_idx, client)
        return [b for _ in range(self.train.epochs) for b in self.shards[client].epoch(g)]

    def in_order(self, client: int):
        d = self.shards[client]
        x, y = d.dataset.data[d.indices], d.dataset.targets[d.indices]
        n = self.train.batch_size
        return [(x[i:i + n], y[i:i + n]) for i in range(0, len(y), n)]

    def accuracy(self, model: nn.Module, split: str) -> float:
        dataset, idx = self.fed.split(split)
        model.eval()
        correct, n = 0, 0
        with torch.no_grad():
            for x, y in eval_batches(dataset, idx, 500):
                out = model(x)
                out = out["output"] if isinstance(out, dict) else out
                correct, n = correct + int((out.argmax(1) == y).sum()), n + len(y)
        model.train()
        return 100.0 * correct / n


class BaseHead(nn.Module):
    """PFLlib's ``base``/``head`` view of the project's network (``fc`` is the head)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.head = net.fc
        net.fc = nn.Identity()
        self.base = net

    def forward(self, x):
        return self.head(self.base(x))


class DictOutput(nn.Module):
    """The FedMut code's networks return ``{'output': logits}``."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        return {"output": self.net(x)}


def pfllib_args(p: "Protocol", algorithm: str, **extra):
    """The protocol's initial model wrapped as PFLlib's body/head pair, and the ``args`` its
    clients and servers read (our training settings; PFLlib's names)."""
    net = p.make()
    net.load_state_dict(p.initial)
    model = BaseHead(net)
    t = p.train
    return model, common.pfllib_args(model, algorithm, "mnist_subset", t.batch_size, t.lr, t.epochs, **extra)


# -- FedGH (PFLlib) -----------------------------------------------------------------------------
def run_fedgh(repo, p: Protocol, rounds, every, opts, log):
    common.add_repo(repo, "system")
    common.stub_modules("h5py")
    from flcore.clients.clientgh import clientGH
    from flcore.servers.servergh import FedGH as ServerGH

    model, args = pfllib_args(p, "FedGH")
    t = p.train
    clients = []
    for c in range(p.num_clients):
        cl = clientGH(args, id=c, train_samples=len(p.shards[c]), test_samples=0, train_slow=False, send_slow=False)
        # PFLlib builds the client's SGD once (no momentum); the protocol's momentum, same lifetime
        cl.optimizer = torch.optim.SGD(cl.model.parameters(), lr=t.lr, momentum=t.momentum)
        clients.append(cl)
    head = copy.deepcopy(model.head)
    server = SimpleNamespace(head=head, opt_h=torch.optim.SGD(head.parameters(), lr=opts.server_lr or t.lr),
                             CEloss=nn.CrossEntropyLoss(), batch_size=opts.server_batch, device="cpu",
                             clients=clients, selected_clients=clients)
    curve = []
    for r in range(rounds):
        torch.manual_seed(derive_seed(p.seed, 77, r))  # the server's prototype shuffle
        ServerGH.send_models(server)
        for cl in clients:
            answers = iter([p.batches(r, cl.id), p.in_order(cl.id)])  # train(), then collect_protos()
            cl.load_train_data = lambda batch_size=None, a=answers: next(a)
            cl.train()
            if opts.batch_stat_protos:  # variant: the project's choice, batch statistics, running ones untouched
                saved = {k: v.clone() for k, v in cl.model.named_buffers()}
                cl.model.eval = cl.model.train
                cl.collect_protos()
                del cl.model.eval
                for k, v in cl.model.named_buffers():
                    v.copy_(saved[k])
            else:
                cl.collect_protos()
        ServerGH.receive_protos(server)
        ServerGH.train_head(server)
        norms = [float(v.norm()) for cl in clients for v in cl.protos.values()]
        log({"round": r, "header_norm": float(head.weight.detach().norm()),
             "proto_norm_min_max": [min(norms), max(norms)]})
        if (r + 1) % every == 0 or r + 1 == rounds:
            ServerGH.send_models(server)  # evaluated: each body with the current header
            row = {"round": r}
            for split in ("val", "test"):
                row[f"{split}_acc"] = float(np.mean([p.accuracy(cl.model, split) for cl in clients]))
            curve.append(row)
            log(row)
    used = ["system/flcore/clients/clientgh.py: clientGH.__init__, train, collect_protos",
            "system/flcore/servers/servergh.py: FedGH.send_models, receive_protos, train_head"]
    notes = ("server object built here (head = a copy of the initial header, opt_h = SGD at --server-lr, batch_size "
             "--server-batch; FedGH.__init__ reads data from disk and shares client 0's head object); client SGD "
             "given the protocol's momentum, kept across rounds as PFLlib keeps the client optimizer; protos "
             "collected over the shard in order (PFLlib: a reshuffled loader; the mean does not depend on order)"
             + ("; VARIANT --batch-stat-protos: collect_protos run with batch norm on batch statistics (model.eval "
                "replaced by model.train for that call, running statistics restored after), the project's choice"
                if opts.batch_stat_protos else ""))
    return curve, used, notes


# -- FedMut (authors) ---------------------------------------------------------------------------
def run_fedmut(repo, p: Protocol, rounds, every, opts, log):
    common.add_repo(repo)
    from Algorithm.Training_FedMut import FedSub, LocalUpdate_FedMut, mutation_spread
    from models.Fed import Aggregation

    t = p.train
    args = SimpleNamespace(local_bs=t.batch_size, device="cpu", optimizer="sgd", lr=t.lr, momentum=t.momentum,
                           local_ep=t.epochs, ensemble_alpha=0.2, mut_acc_rate=opts.acc_rate, mut_bound=50,
                           radius=opts.radius)
    net = p.make()
    net.load_state_dict(p.initial)
    net_glob = DictOutput(net)
    m = p.num_clients
    w_locals = [copy.deepcopy(net_glob.state_dict()) for _ in range(m)]
    rng_seed = p.seed if opts.rng_seed is None else opts.rng_seed
    random.seed(rng_seed)
    np.random.seed(rng_seed)
    curve = []
    for r in range(rounds):  # the body of FedMut()'s loop
        w_old = copy.deepcopy(net_glob.state_dict())
        idxs_users = np.random.choice(range(m), m, replace=False)
        for i, idx in enumerate(idxs_users):
            net_glob.load_state_dict(w_locals[i])
            local = LocalUpdate_FedMut(args=args, dataset=[(torch.zeros(1), 0)], idxs=[0])
            local.ldr_train = p.batches(r, int(idx))
            w_locals[i] = copy.deepcopy(local.train(net=net_glob))
        w_glob = Aggregation(w_locals, None)
        net_glob.load_state_dict(w_glob)
        w_delta = FedSub(w_glob, w_old, 1.0)
        w_locals = mutation_spread(args, r, w_glob, w_old, w_locals, m, w_delta, args.radius)
        if opts.keep_buffers:  # the project's default: statistics not mutated
            bufs = [k for k, _ in net_glob.named_buffers()]
            for w in w_locals:
                for k in bufs:
                    w[k] = w_glob[k].clone()
        if (r + 1) % every == 0 or r + 1 == rounds:
            row = {"round": r, **{f"{s}_acc": p.accuracy(net_glob, s) for s in ("val", "test")},
                   "delta_norm": float(torch.cat([v.float().flatten() for v in w_delta.values()]).norm())}
            curve.append(row)
            log(row)
    used = ["Algorithm/Training_FedMut.py: LocalUpdate_FedMut.train, FedSub, mutation_spread (the loop of FedMut())",
            "models/Fed.py: Aggregation(w, None)"]
    notes = (f"radius {opts.radius}, mut_acc_rate {opts.acc_rate}, mut_bound 50; "
             + ("BN buffers restored to the aggregate's after mutation_spread (--keep-buffers); " if opts.keep_buffers
                else "every state-dict entry mutated, as the code does; ")
             + f"client order from np.random.choice and mutation signs from random, both seeded {rng_seed}; "
             "the loop is re-driven here because FedMut() loads data, and tests every round")
    return curve, used, notes


# -- FedAS (authors' repository, or PFLlib: the same file layout) ---------------------------------
def histogram(p: Protocol, model: nn.Module) -> list:
    """The model's predicted classes on the test split, counted (evaluation mode; the mode restored)."""
    mode = model.training
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(x).argmax(1) for x, _ in eval_batches(*p.fed.split("test"), 500)])
    model.train(mode)
    return torch.bincount(pred, minlength=p.fed.bundle.num_classes).tolist()


def eval_enters_batch_statistics(model: nn.Module, stack: ExitStack) -> None:
    """The model's next ``eval()`` (``clientAS.train``'s, before its Fisher pass) enters
    ``batch_statistics`` on ``stack`` instead: batch norm on batch statistics, running
    statistics untouched, every other module in evaluation mode; the stack's close restores
    the modes and ``track_running_stats``."""

    def enter():
        del model.eval  # the class's method again (batch_statistics calls it)
        stack.enter_context(batch_statistics(model))

    model.eval = enter


def run_fedas(repo, p: Protocol, rounds, every, opts, log):
    import fedas as golden  # tools/reference/fedas.py: ById

    common.add_repo(repo, "system")
    common.stub_modules("h5py", "opacus", "torchviz", **{"opacus.PrivacyEngine": None, "torchviz.make_dot": None})
    from flcore.clients.clientas import clientAS
    from flcore.servers.serverbase import Server
    from flcore.servers.serveras import FedAS as ServerAS

    model, args = pfllib_args(p, "FedAS", privacy=False, dp_sigma=0.0, yxy_hyper=20, wo_local=False)
    t = p.train
    clients = {}
    for c in range(p.num_clients):
        cl = clientAS(args, id=c, train_samples=len(p.shards[c]), test_samples=0, train_slow=False, send_slow=False)
        cl.optimizer = torch.optim.SGD(cl.model.parameters(), lr=t.lr, momentum=t.momentum)
        clients[c] = cl
    server = SimpleNamespace(clients=golden.ById(clients), global_model=copy.deepcopy(model), global_rounds=rounds)
    server.add_parameters = lambda w, m: Server.add_parameters(server, w, m)
    ids = list(range(p.num_clients))
    curve = []
    for r in range(rounds):
        for c, cl in clients.items():
            g = torch.Generator().manual_seed(derive_seed(p.seed, 78, r, c))
            align = [b for b in ClientData(p.shards[c].dataset, p.shards[c].indices, 16, None).epoch(g)]
            answers = iter([p.batches(r, c), p.in_order(c)])  # train(True): local steps, then the Fisher pass
            cl.load_train_data = (lambda batch_size=None, a=answers, al=align: al if batch_size == 16 else next(a))
        if opts.batch_stat_fedas:  # variant: prototypes (client's model), alignment (global body): batch statistics
            for c in ids:  # the same client order as one call with every id
                with batch_statistics(clients[c].model), batch_statistics(server.global_model):
                    ServerAS.send_selected_models(server, [c], r)
        else:
            ServerAS.send_selected_models(server, ids, r)
        for c in ids:
            if opts.fresh_optimizer:  # diagnostic: momentum starts from zero every round, as our local training
                clients[c].optimizer = torch.optim.SGD(clients[c].model.parameters(), lr=t.lr, momentum=t.momentum)
            if opts.batch_stat_fedas:  # variant: the Fisher pass on batch statistics (local steps unchanged)
                with ExitStack() as stack:
                    eval_enters_batch_statistics(clients[c].model, stack)
                    clients[c].train(True)
                clients[c].model.eval()  # the mode the reference leaves the model in
            else:
                clients[c].train(True)
        fim = [clients[c].fim_trace_history[-1] for c in ids]
        log({"round": r, "fisher_min_max": [min(fim), max(fim)],
             "fisher_non_finite": sum(not np.isfinite(f) for f in fim),
             "global_param_norm": float(torch.cat([q.detach().flatten()
                                                   for q in server.global_model.parameters()]).norm())})
        server.uploaded_ids = ids
        server.uploaded_models = [clients[c].model for c in ids]
        ServerAS.aggregate_wrt_fisher(server)
        if (r + 1) % every == 0 or r + 1 == rounds:
            row = {"round": r}
            for split in ("val", "test"):
                row[f"{split}_acc"] = float(np.mean([p.accuracy(clients[c].model, split) for c in ids]))
                row[f"global_{split}_acc"] = p.accuracy(server.global_model, split)
            fim = [clients[c].fim_trace_history[-1] for c in ids]
            row["fisher_min_max"] = [min(fim), max(fim)]
            if all(np.isfinite(fim)):  # diagnostics of the global model, scoring only
                row["global_test_prediction_histogram"] = histogram(p, server.global_model)
                # the code's global buffers are client 0's (aggregate_wrt_fisher averages parameters only);
                # ours Fisher-weights them with the parameters: the same global parameters, scored with those
                fw = copy.deepcopy(server.global_model)
                w = [f / sum(fim) for f in fim]
                with torch.no_grad():
                    for name, buf in fw.named_buffers():
                        if buf.is_floating_point():
                            buf.copy_(sum(wi * clients[c].model.get_buffer(name) for wi, c in zip(w, ids)))
                row["global_fisher_buffers_test_acc"] = p.accuracy(fw, "test")
            curve.append(row)
            log(row)
    used = ["system/flcore/clients/clientas.py: clientAS.__init__, set_parameters (prototypes, alignment), "
            "train(True) (local steps, Fisher trace)",
            "system/flcore/servers/serveras.py: FedAS.send_selected_models, aggregate_wrt_fisher (Server.add_parameters)"]
    notes = ("server object built here (clients, global_model, global_rounds); all 20 clients selected every round; "
             "client SGD given the protocol's momentum, kept across rounds; alignment batches of 16 = the shard "
             "shuffled by a per-round generator; Fisher pass = the shard in order, batches of 32; trace: per round, "
             "the clients' Fisher traces (before aggregation) and the norm of the global model's parameters after "
             "the alignments; diagnostics when every trace is finite: the global model's test prediction histogram, "
             "and global_fisher_buffers_test_acc, its test accuracy with BN buffers Fisher-weighted over the clients "
             "(ours) instead of client 0's (the code's)"
             + ("; VARIANT --batch-stat-fedas: set_parameters (prototypes of the client's model, alignment of the "
                "global body) and the Fisher pass of train(True) run with batch norm on batch statistics and the "
                "running statistics untouched (fl_lightning.elastic.bn.batch_statistics, the project's choice: "
                "set_parameters called client by client inside it, model.eval() before the Fisher pass replaced by "
                "it); local steps unchanged (train mode); the model left in eval() after train(True), as the code "
                "leaves it" if opts.batch_stat_fedas else "")
             + ("; DIAGNOSTIC --fresh-optimizer: a new client SGD (lr, momentum) every round, momentum from zero "
                "as in our local training, instead of PFLlib's optimizer kept for the run"
                if opts.fresh_optimizer else ""))
    return curve, used, notes


# -- MultiSFL (authors) -------------------------------------------------------------------------
class Reshuffled:
    """MultiSFL's replay loader (``DataLoader(..., shuffle=True)``): the code's sample indices
    ``idx`` (``where`` maps them to the dataset's), batches of ``batch_size`` yielded as
    ``(x, y, indices)``, a fresh order at every pass (the code starts a pass for every batch)."""

    def __init__(self, idx, batch_size, generator, data, where):
        self.idx, self.batch_size, self.generator, self.data, self.where = idx, batch_size, generator, data, where

    def __len__(self):
        return -(-len(self.idx) // self.batch_size)

    def __iter__(self):
        order = self.idx[torch.randperm(len(self.idx), generator=self.generator)]
        for i in range(0, len(order), self.batch_size):
            part = order[i:i + self.batch_size]
            rows = self.where[part]
            yield self.data.data[rows], self.data.targets[rows], part.tolist()


def run_multisfl(repo, p: Protocol, rounds, every, opts, log):
    import multisfl as golden  # tools/reference/multisfl.py: stubs, Labels, patched

    golden.stubs()
    common.add_repo(repo)
    import models.Update as update
    from Algorithm.Training_MultiSFL import MultiSFL as Authors

    cut = p.cfg.algorithm.cut
    net = p.make()
    net.load_state_dict(p.initial)
    front, back = net.split(cut)
    labels, dict_users, start = [], {}, 0
    for c in range(p.num_clients):
        y = p.shards[c].dataset.targets[p.shards[c].indices].tolist()
        dict_users[c] = list(range(start, start + len(y)))
        labels.extend(y)
        start += len(y)
    t = p.train
    args = SimpleNamespace(num_users=p.num_clients, frac=1.0, num_classes=10, lr=t.lr, momentum=t.momentum,
                           weight_decay=t.weight_decay, local_ep=t.epochs, local_bs=t.batch_size, device="cpu",
                           MR=int(opts.replay), DB=0, BS=0, AW=0, comm_limit=1e30, model="resnet18",
                           dataset="mnist_subset", wandb=False, data_beta=0.1, algorithm="MultiSFL")
    np.random.seed(p.seed)
    random.seed(p.seed)
    run = Authors(args, nn.Sequential(), golden.Labels(labels), None, dict_users, front, back)
    run.model_size = run.feature_size = 0
    curve, replayed = [], {}

    def test():
        r = run.round
        if opts.replay:
            log({"round": r, "replay_examples": replayed.get(r, 0)})
        if (r + 1) % every == 0 or r + 1 == rounds:
            master = nn.Sequential(run.net_glob_client, run.net_glob_server)
            row = {"round": r, **{f"{s}_acc": p.accuracy(master, s) for s in ("val", "test")}}
            master.eval()
            with torch.no_grad():
                pred = torch.cat([master(x).argmax(1) for x, _ in eval_batches(*p.fed.split("test"), 500)])
            row["test_prediction_histogram"] = torch.bincount(pred, minlength=10).tolist()
            branches = [nn.Sequential(cf, sv) for cf, sv in zip(run.modelClient, run.modelServer)]
            row["branch_test_acc_mean"] = float(np.mean([p.accuracy(b, "test") for b in branches]))
            curve.append(row)
            log(row)
        if r + 1 == rounds:
            run.traffic = float("inf")  # ends main()'s while loop after this round

    run.test = test
    run.saveResult = lambda: None
    where = torch.cat([p.shards[c].indices for c in range(p.num_clients)])  # the code's sample index -> ours
    data = p.shards[0].dataset
    assert all(s.dataset is data for s in p.shards) and len(where) <= 50000  # the code's DATASET_SIZE
    current = {}

    def loader(dataset, batch_size, shuffle):
        client = next((c for c in dict_users if dict_users[c] == dataset.idxs), None)
        if client is not None:  # the client's own loader: our batches
            current["client"] = client
            return [(x, y, list(range(len(y)))) for x, y in p.batches(run.round, client)]
        # the replay loader (--replay): the assistants' samples, reshuffled at every pass as DataLoader(shuffle=True)
        replayed[run.round] = replayed.get(run.round, 0) + len(dataset.idxs)
        g = torch.Generator().manual_seed(derive_seed(p.seed, 79, run.round, current["client"]))
        return Reshuffled(torch.tensor(dataset.idxs), batch_size, g, data, where)

    with golden.patched(update, "DataLoader", loader):
        run.main()
    used = ["Algorithm/Training_MultiSFL.py: MultiSFL.__init__, main (label statistics, splitTrain, Agg, weakAgg)",
            "models/Update.py: LocalUpdate_MultiSFL.union_train", "models/Fed.py: Aggregation"]
    notes = (f"the project's ResNet-18 halves at {cut} (model.split); "
             + ("VARIANT --replay: MR 1 (knowledge replay on, as ours; the code only tests MR != 0), DB 0 (fixed "
                "budget 0.01), BS 0 (random sampling), AW 0; the assistants' samples drawn by the code (random, "
                "seeded with the seed), their loader (batch ceil(n / client batches), as the code) reshuffled at "
                "every pass by a generator seeded per round and client, sample indices the code's; trace: replayed "
                "examples per round; " if opts.replay else "MR 0 (the code's default; no replay), DB 0; ")
             + "branch assignment by the code's np.random.choice seeded with the seed; the loaders yield our batches "
             "(sample indices 0..b-1, used only by the classify_count bookkeeping); main() ends after --rounds "
             "through the traffic counter (model_size = feature_size = 0); master = mean of the branches "
             "(Agg) scored where the code calls test()")
    return curve, used, notes


RUNNERS = {"fedgh": run_fedgh, "fedmut": run_fedmut, "fedas": run_fedas, "multisfl": run_multisfl}
REPOS = {"fedgh": "https://github.com/TsingZ0/PFLlib", "fedmut": "https://github.com/HMHelloWorld/FedMut",
         "fedas": "https://github.com/xiyuanyang45/FedAS", "multisfl": "https://github.com/CodeFree-xzk/MultiSFL"}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("method", choices=sorted(RUNNERS))
    ap.add_argument("repo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=None)
    ap.add_argument("--server-lr", type=float, default=None, help="fedgh: header SGD lr (default: client lr)")
    ap.add_argument("--server-batch", type=int, default=1, help="fedgh: prototypes per header step (ours: 1)")
    ap.add_argument("--batch-stat-protos", action="store_true",
                    help="fedgh variant: prototypes with batch-norm batch statistics (ours) instead of eval mode")
    ap.add_argument("--batch-stat-fedas", action="store_true",
                    help="fedas variant: prototypes, alignment and Fisher pass with batch-norm batch statistics "
                         "(running statistics untouched, ours) instead of the modes the code leaves")
    ap.add_argument("--fresh-optimizer", action="store_true",
                    help="fedas diagnostic: a new client optimizer every round (momentum from zero, as ours)")
    ap.add_argument("--replay", action="store_true",
                    help="multisfl: knowledge replay on (--MR 1; budget 0.01, random sampling: DB 0, BS 0), as ours")
    ap.add_argument("--radius", type=float, default=4.0, help="fedmut")
    ap.add_argument("--acc-rate", type=float, default=0.0, help="fedmut: mut_acc_rate (ours 0; code default 0.3)")
    ap.add_argument("--rng-seed", type=int, default=None,
                    help="fedmut: seed of the code's own random draws (order, signs); default --seed")
    ap.add_argument("--keep-buffers", action="store_true", help="fedmut: do not mutate BN statistics")
    opts = ap.parse_args(argv)
    torch.set_num_threads(1)
    config = opts.config or f"configs/split/offline/mnist_subset/resnet18_narrow/{opts.method}.yaml"
    p = Protocol(str(common.ROOT / config) if not Path(config).is_absolute() else config, opts.seed)
    rounds = opts.rounds or p.cfg.federation.rounds
    started = time.time()
    trace = []

    def log(row):
        trace.append(row)
        print(json.dumps(row), flush=True)

    curve, used, notes = RUNNERS[opts.method](opts.repo, p, rounds, opts.every, opts, log)
    record = {"method": opts.method, "seed": opts.seed, "rounds": rounds, "curve": curve,
              "repository": REPOS[opts.method], "commit": common.commit_of(Path(opts.repo)), "used": used,
              "notes": notes, "config": config, "seconds": round(time.time() - started, 1),
              "repo_dir": Path(opts.repo).name,
              "command": " ".join(["python", "tools/reference/protocol_run.py", opts.method,
                                   f"<{Path(opts.repo).name}>"] + list(sys.argv[3:] if argv is None else argv[2:])),
              "torch": torch.__version__, "trace": [r for r in trace if r not in curve]}
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
