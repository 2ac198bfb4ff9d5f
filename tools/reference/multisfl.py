"""Golden values for MultiSFL from the authors' code (CodeFree-xzk/MultiSFL).

    python tools/reference/multisfl.py /path/to/MultiSFL [--commit SHA]

Case: Dirichlet digits, 8 clients of unequal shards, 2 per round (two branches) for 2 rounds,
the project's CNN (channels 4 and 8) cut after its first block (client: conv, BN, ReLU, max
pool; server: the rest), BN statistics tracked and averaged (ours ``bn: aggregated``), SGD lr
0.05, momentum 0.9, weight decay 0, one epoch of batch 32. Rounds of
``Algorithm/Training_MultiSFL.py: MultiSFL.main`` itself: each branch's label statistic,
``splitTrain`` (``selectHelpers`` and ``sampleData`` with replay on, then ``models/Update.py:
LocalUpdate_MultiSFL.union_train``, the split step on the batches our loop drew), ``Agg`` (the
master: the plain mean of the branches), ``weakAgg`` (each branch pulled to the master with
weights 1 and 10). Two variants: ``replay`` (``--MR 1``, knowledge replay, our default) and
``no_replay`` (``--MR 0``, the code's default; ours ``replay: false``).

Stand-ins: the cohort and the branch each client trains are ours (``np.random.choice`` answers
them, and ends ``main`` after the case's rounds); the client loader yields our batches; the
helper loader (``ldr_train_helper``, which ``union_train`` iterates anew at every step and
reads at the step's position, reshuffled each time) is the list of our replay chunks for the
client's epoch, so step j reads our chunk j (our replayed examples: the authors' choice of
assistants and examples comes from Python's ``random``, ours from seeded generators; what they
provide per class is compared by ``selectHelpers`` below); evaluation and the result file are
switched off; ``loguru`` and ``wandb`` (logging) are stubbed. Both sides run in float64. Also
stored: ``selectHelpers`` on fixed label counts and a fixed branch statistic (the replay
requirement per class and what the assistants provide).
"""

from __future__ import annotations

import contextlib
import random
import sys
import tempfile
import types
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

import common
from reference_case import TRAIN, batch_digest, default_dtype, grey_levels, make_spec, run_rounds, shard

from fl_lightning.algorithms.split.multisfl import MultiSFL

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


ROUNDS = 2
VARIANTS = {"replay": {}, "no_replay": {"replay": False}}


def merged(chunks):
    """Our replay chunks as a step reads them: a one-row last chunk joins the one before
    (``modules/split_variants.Replay``)."""
    chunks = list(chunks)
    if len(chunks) > 1 and len(chunks[-1][1]) == 1:
        (ax, ay), (bx, by) = chunks[-2], chunks[-1]
        chunks[-2:] = [(torch.cat([ax, bx]), torch.cat([ay, by]))]
    return chunks


def record(variant: str):
    spec = make_spec(tempfile.mkdtemp(), MultiSFL(bn="aggregated", **VARIANTS[variant]), rounds=ROUNDS)
    run = run_rounds(spec, ROUNDS, dtype=torch.float64)
    alg, ctx = run.fed.algorithm, run.fed.ctx
    branches = [{t.client: t.choice.branch for t in alg.plan(r).tasks} for r in range(ROUNDS)]  # (seed, round)
    replayed = [{c: merged(b.get(("replay", c), [])) for c in cohort} for cohort, b in zip(run.cohorts, run.batches)]
    case = {"initial": run.initial,
            "levels": grey_levels(run.fed), "variant": variant, "options": VARIANTS[variant], "rounds": ROUNDS,
            "cohorts": run.cohorts, "branches": branches,
            "sizes": {c: len(ctx.shards[c]) for c in range(ctx.num_clients)},
            "labels": {c: shard(ctx, c)[1] for c in range(ctx.num_clients)}, "lr": spec.train.lr,
            "momentum": spec.train.momentum, "num_clients": ctx.num_clients,
            "digests": [{c: [batch_digest(x, y) for x, y in b[c]] for c in cohort}
                        for cohort, b in zip(run.cohorts, run.batches)],
            "replay_digests": [{c: [batch_digest(x, y) for x, y in chunks] for c, chunks in rnd.items()}
                               for rnd in replayed]}
    return case, run.batches, replayed


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


class Done(Exception):
    """Raised by the cohort stand-in when ``main`` asks for a round past the case's."""


def authors(repo, case, batches, replayed):
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
    replay = case["variant"] == "replay"
    args = SimpleNamespace(num_users=n, frac=len(case["cohorts"][0]) / n, num_classes=10, lr=case["lr"],
                           momentum=case["momentum"], weight_decay=0.0, local_ep=1, local_bs=TRAIN.batch_size,
                           device="cpu", MR=int(replay), DB=0, BS=0, AW=0, comm_limit=1e12, model="cnn",
                           dataset="digits", wandb=False, data_beta=0.5, algorithm="MultiSFL")
    initial = {k: v.double() if v.is_floating_point() else v for k, v in case["initial"].items()}
    client, server = (m.double() for m in halves(initial))
    run = Authors(args, nn.Sequential(), Labels(labels), None, dict_users, client, server)
    run.model_size = run.feature_size = 1  # set for resnet/vgg only; they count traffic
    rounds = []
    run.test = lambda: rounds.append({"master": to_ours(run.net_glob_client.state_dict(),
                                                        run.net_glob_server.state_dict())})
    run.saveResult = lambda: None
    current = {"round": -1}

    def branches_now():
        return {"branches": [to_ours(c.state_dict(), s.state_dict()) for c, s in zip(run.modelClient, run.modelServer)],
                "distributions": [torch.tensor(d, dtype=torch.float64) for d in run.cumulative_label_distributions],
                "weights": list(run.cumulative_label_distribution_weight)}

    def choice(*args, **kwargs):
        if current["round"] >= 0:
            rounds[current["round"]].update(branches_now())
        current["round"] += 1
        r = current["round"]
        if r == case["rounds"]:
            raise Done
        return np.array(sorted(case["cohorts"][r], key=lambda c: case["branches"][r][c]))  # [k] trains branch k

    def loader(dataset, batch_size, shuffle):
        r = current["round"]
        for c in case["cohorts"][r]:
            if dict_users[c] == dataset.idxs:
                current["client"] = c
                return [(x, y, list(range(len(y)))) for x, y in batches[r][c]]
        chunks = replayed[r][current["client"]]  # the helper loader of the client being set up
        assert replay and chunks and len(dataset.idxs) == sum(len(y) for _, y in chunks)
        return [(x, y, list(range(len(y)))) for x, y in chunks]

    with patched(update, "DataLoader", loader), patched(np.random, "choice", choice):
        try:
            run.main()
        except Done:
            pass
    assert run.round == case["rounds"] and len(rounds) == case["rounds"]
    return rounds


def select_helpers(repo):
    """The replay requirement and the assistants' provision for a fixed branch statistic."""
    from Algorithm.Training_MultiSFL import MultiSFL as Authors

    case, _, _ = record("no_replay")
    n = case["num_clients"]
    labels, dict_users, start = [], {}, 0
    for c in range(n):
        y = case["labels"][c].tolist()
        dict_users[c] = list(range(start, start + len(y)))
        labels.extend(y)
        start += len(y)
    args = SimpleNamespace(num_users=n, frac=2 / n, num_classes=10, lr=0.05, momentum=0.9, weight_decay=0.0,
                           local_ep=1, local_bs=TRAIN.batch_size, device="cpu", MR=0, DB=0, BS=0, AW=0,
                           comm_limit=1e-12, model="cnn", dataset="digits", wandb=False, data_beta=0.5,
                           algorithm="MultiSFL")
    client, server = halves(case["initial"])
    run = Authors(args, nn.Sequential(), Labels(labels), None, dict_users, client, server)
    run.model_size = run.feature_size = 1
    run.cumulative_label_distributions[0] = np.array([40.0, 3.0, 0.0, 25.0, 10.0, 7.0, 0.0, 1.0, 30.0, 12.0])
    curr = case["cohorts"][0][0]
    run.dict_users = {c: (dict_users[c] * 20 if c == curr else dict_users[c]) for c in dict_users}  # R > C
    random.seed(0)
    helpers, provide = run.selectHelpers(curr, 0)
    return {"client": curr, "distribution": torch.tensor(run.cumulative_label_distributions[0]),
            "client_examples": len(run.dict_users[curr]), "budget": 0.01,
            "counts": torch.tensor(np.stack(run.true_labels)), "helpers": helpers,
            "provided": torch.tensor(np.array(provide).sum(axis=0) if provide else np.zeros(10))}


def main():
    args = common.repository_args()
    out = common.out_dir("multisfl")
    for variant in VARIANTS:
        case, batches, replayed = record(variant)
        with default_dtype(torch.float64):
            rounds = authors(args.repo, case, batches, replayed)
        torch.save({"case": case, "rounds": rounds}, out / f"{variant}.pt")
    torch.save({"replay": select_helpers(args.repo)}, out / "authors.pt")
    common.write_provenance(
        "multisfl", common.add_repo(args.repo), "https://github.com/CodeFree-xzk/MultiSFL", commit=args.commit,
        used=["Algorithm/Training_MultiSFL.py: MultiSFL.__init__, main (rounds: the branch statistics, splitTrain, "
              "selectHelpers, sampleData, Agg, weakAgg)", "models/Update.py: LocalUpdate_MultiSFL.union_train",
              "models/Fed.py: Aggregation"],
        notes="Dirichlet 0.5 digits, 8 clients, 2 per round for 2 rounds, the project's CNN (channels 4, 8) cut after "
              "block0, BN tracked (ours bn aggregated), SGD lr 0.05 momentum 0.9 weight decay 0, one epoch of batch "
              "32; both sides in float64. Variants: replay (MR 1, ours by default) and no_replay (MR 0, the code's "
              "default; ours replay false). Stand-ins: loguru and wandb (logging), models.Update.DataLoader (the "
              "client loader yields the project's batches; the helper loader is the list of the project's replay "
              "chunks for the client's epoch), np.random.choice during main (returns the project's cohort in branch "
              "order; ends main after 2 rounds), test and saveResult (the master is recorded where test is called). "
              "Batches stored as SHA-256 digests. authors.pt: selectHelpers with branch statistic "
              "[40, 3, 0, 25, 10, 7, 0, 1, 30, 12], the client's shard repeated 20 times so that floor(0.01 n) "
              "exceeds 10.")


if __name__ == "__main__":
    main()
