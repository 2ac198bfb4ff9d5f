"""Rounds of a PFLlib method (TsingZ0/PFLlib) on our case, shared by the FedProx and SCAFFOLD
adapters (``tools/reference/fedprox.py``, ``tools/reference/scaffold.py``).

The case: Dirichlet(0.5) digits, 8 clients of unequal shards, 3 per round for 3 rounds, the
project's one-block ViT (``reference_case.VIT``: no batch norm, so nothing of the model escapes
PFLlib's parameter-only aggregation), plain SGD lr 0.05 (PFLlib's clients have no momentum and no
weight decay), one epoch of batch 32. Our run (float64) records the cohorts and every client's
batches; PFLlib's clients (one object per client, kept across rounds, as PFLlib's server keeps
them) train on those batches from the server's model of the round (``set_parameters``), and the
server step is PFLlib's own method on a server object built here (its constructor reads datasets
from disk). Both sides run in float64 (models and batches converted).
"""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import torch

import common
from reference_case import TRAIN, VIT, batch_digest, grey_levels, make_spec, pack, run_rounds, unpack

ROUNDS = 3
CLIENTS_PER_ROUND = 3


def record(algorithm):
    """Our rounds in float64: the case PFLlib replays."""
    spec = make_spec(tempfile.mkdtemp(), algorithm, clients_per_round=CLIENTS_PER_ROUND, rounds=ROUNDS, model=VIT,
                     train=TRAIN.__class__(**{**TRAIN.__dict__, "momentum": 0.0}))
    run = run_rounds(spec, ROUNDS, dtype=torch.float64)
    ctx = run.fed.ctx
    case = {"initial": pack(run.initial), "levels": grey_levels(run.fed), "rounds": ROUNDS,
            "clients_per_round": CLIENTS_PER_ROUND, "num_clients": ctx.num_clients, "cohorts": run.cohorts,
            "sizes": {c: len(ctx.shards[c]) for c in range(ctx.num_clients)}, "lr": spec.train.lr,
            "digests": [{c: [batch_digest(x, y) for x, y in b[c]] for c in cohort}
                        for cohort, b in zip(run.cohorts, run.batches)]}
    return case, run.batches


def pfllib(repo):
    common.add_repo(repo, "system")
    common.stub_modules("h5py")  # serverbase saves results with it


def global_model(case):
    """The server's model: the project's ViT as PFLlib's base/head pair (call it under
    ``default_dtype(torch.float64)``: built in float64, it holds the stored model exactly)."""
    return common.SplitViT(unpack(case["initial"]), VIT["init_args"])


def clients_for(client_class, args, case):
    """One PFLlib client per id, created on first use and kept (PFLlib's server keeps its clients)."""
    made = {}

    def get(c):
        if c not in made:
            made[c] = client_class(args, id=c, train_samples=case["sizes"][c], test_samples=0, train_slow=False,
                                   send_slow=False)
        return made[c]
    return get, made


def feed(client, batches):
    """The client's loader yields the batches our loop drew for it this round."""
    client.load_train_data = lambda batch_size=None, b=batches: b


def sample_weights(case, cohort):
    total = sum(case["sizes"][c] for c in cohort)
    return [case["sizes"][c] / total for c in cohort]


def as_ours(model) -> dict:
    return {k: v.detach().clone() for k, v in common.model_state(model).items()}


def server(**fields):
    return SimpleNamespace(**fields)
