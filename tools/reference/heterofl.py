"""Golden values for HeteroFL from the authors' code (diaoenmao/HeteroFL-Computation-and-Communication-Efficient-Federated-Learning-for-Heterogeneous-Clients).

    python tools/reference/heterofl.py /path/to/HeteroFL

Case: Dirichlet(0.5) digits, 8 clients of unequal shards, 3 per round for 3 rounds, every round
at model rates 1, 1/2 and 1/4, the project's CNN (channels 4 and 8) against the authors' ``conv``
(``src/models/conv.py``: conv, Scaler, batch norm without tracked statistics, ReLU, max pool; the
same hidden sizes), SGD lr 0.05, momentum 0.9, gradient clipping at norm 1, one epoch of batch
32. Per round, from ``src/fed.py``: ``Federation.distribute`` (the sub-models each client
receives: ``split_model``'s leading slices at ``ceil(rate * C)`` channels) and
``Federation.combine`` (the plain mean over the clients holding each position); from
``src/train_classifier_fed.py``: ``Local.train`` (one client's local epoch with the Scaler) on
the batches our loop drew, and ``stats`` (HeteroFL's sBN pass: a copy of the global model with
tracked statistics, ``momentum=None``, run in train mode over the training data) on the
batches our sBN pass (``HeteroFL(bn="sbn", sbn_data="train")``) read after the round.

Two variants, each run for the 3 rounds: ``uniform`` (``combine`` as written; ours with
``weighting: uniform``) and ``samples`` (the project's default: ``combine`` with each client's
count replaced by its examples, a stand-in written here over the authors' ``param_idx``).

Precision: both sides run in float64 (the networks and batches converted), so the comparison's
only rounding is float64's; ``combine`` accumulates in ``torch.float32`` by construction (lines
187-188), which in this run reads ``torch.float64`` (a proxy of ``torch`` in ``fed.py``: a
precision stand-in, nothing else changes). Every client's label split is all ten classes, so
``combine``'s and the logits' label masks are the identity (the project does not mask;
``docs/heterofl_supernet.md``). The authors' convolutions have a bias that the project's have
not; it is set to zero and, a per-channel constant before batch norm with batch statistics, it
receives no gradient (checked below). Also stored: ``distribute`` of a wider CNN (channels 6 and
10) at the five rates of the paper (1, 1/2, 1/4, 1/8, 1/16).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import tempfile
from dataclasses import replace

import torch

import common
from reference_case import (TRAIN, ServedStatisticsLog, batch_digest, default_dtype, grey_levels, make_spec,
                            run_rounds)

from fl_lightning.algorithms.submodel import HeteroFL

CAPS = [0.5, 1.0, 0.25, 0.5, 1.0, 0.5, 0.25, 1.0]  # cohorts (4, 5, 6), (1, 2, 5), (1, 5, 6): rates 1, 1/2, 1/4
ROUNDS = 3
VARIANTS = {"uniform": {"weighting": "uniform"}, "samples": {}}
RATES = [1.0, 0.5, 0.25, 0.125, 0.0625]
OURS_TO_AUTHORS = {  # the authors' Sequential: conv 0, scaler 1, bn 2, relu 3, pool 4, conv 5, ..., linear 11
    "features.block0.conv.weight": "blocks.0.weight", "features.block0.bn.weight": "blocks.2.weight",
    "features.block0.bn.bias": "blocks.2.bias", "features.block1.conv.weight": "blocks.5.weight",
    "features.block1.bn.weight": "blocks.7.weight", "features.block1.bn.bias": "blocks.7.bias",
    "fc.weight": "blocks.11.weight", "fc.bias": "blocks.11.bias",
}
STATS = {f"features.block{i}.bn.{s}": f"blocks.{j}.{s}" for i, j in ((0, 2), (1, 7))
         for s in ("running_mean", "running_var")}
CONV_BIASES = ("blocks.0.bias", "blocks.5.bias")


def algorithm(variant: str, **options):
    """Ours, as the case runs it (``options``: a change to test, e.g. ``scaler=False``)."""
    return HeteroFL(caps=CAPS, bn="sbn", sbn_data="train", scaler=True, **{**VARIANTS[variant], **options})


def spec_of(out_dir, alg, train=None):
    return make_spec(out_dir, alg, clients_per_round=3, rounds=ROUNDS,
                     train=train or replace(TRAIN, grad_clip=1.0))


def record(variant: str):
    """Our 3 rounds in float64: the case the authors' code replays."""
    served = ServedStatisticsLog()
    spec = spec_of(tempfile.mkdtemp(), algorithm(variant))
    run = run_rounds(spec, ROUNDS, dtype=torch.float64, after_round=served)
    ctx = run.fed.ctx
    sbn = served.rounds[0]["batches"]
    for r in served.rounds[1:]:  # one seeded order, reused at every pass
        assert all(torch.equal(a[0], b[0]) for a, b in zip(r["batches"], sbn))
    case = {"initial": run.initial,
            "levels": grey_levels(run.fed), "caps": CAPS, "rounds": ROUNDS, "variant": variant,
            "cohorts": run.cohorts, "sizes": {c: len(ctx.shards[c]) for c in range(ctx.num_clients)},
            "lr": spec.train.lr, "momentum": spec.train.momentum, "grad_clip": spec.train.grad_clip,
            "digests": [{c: [batch_digest(x, y) for x, y in b[c]] for c in cohort}
                        for cohort, b in zip(run.cohorts, run.batches)],
            "sbn_digests": [batch_digest(x, y) for x, y in sbn]}
    return case, run, sbn


def to_authors(state):
    out = {OURS_TO_AUTHORS[k]: v.clone() for k, v in state.items() if k in OURS_TO_AUTHORS}
    for key in CONV_BIASES:
        out[key] = torch.zeros(out[key.replace("bias", "weight")].shape[0])
    return out


def from_authors(state):
    back = {a: o for o, a in OURS_TO_AUTHORS.items()}
    return {back[k]: v.detach().clone() for k, v in state.items() if k in back}


class Float64Torch:
    """``torch`` as ``fed.py`` sees it in the float64 run: ``torch.float32`` (``combine``'s
    accumulators) reads ``torch.float64``; every other name is torch's."""

    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def authors_code(repo):
    """The authors' modules import ``config`` (which reads ``config.yml`` from the working
    folder) and parse the command line at import; ``anytree`` serves only their dataset
    classes' label trees."""
    common.add_repo(repo, "src")
    common.stub_modules("anytree")
    cwd, argv = os.getcwd(), sys.argv
    os.chdir(repo / "src")
    sys.argv = [argv[0]]
    try:
        import train_classifier_fed
        from config import cfg
        import fed
        import models
        yield cfg, fed, train_classifier_fed, models
    finally:
        os.chdir(cwd)
        sys.argv = argv


def configure(cfg, case, hidden=(4, 8)):
    cfg.update({"model_name": "conv", "conv": {"hidden_size": list(hidden)}, "data_shape": [1, 8, 8],
                "classes_size": 10, "norm": "bn", "scale": True, "mask": False, "global_model_rate": 1.0,
                "model_split_mode": "fix", "device": "cpu", "optimizer_name": "SGD",
                "momentum": case.get("momentum", 0.0), "weight_decay": 0.0, "num_epochs": {"local": 1},
                "metric_name": {"train": {"Local": []}}})


class NoLogger:
    def append(self, *args, **kwargs):
        pass


def weighted_combine(federation, local_parameters, param_idx, weights):
    """The ``samples`` variant's server step: ``combine`` with each client's count replaced by
    its examples: every position the example-weighted mean over the clients holding it (their
    ``param_idx``: leading slices, and all ten classifier rows), the others unchanged."""
    for key, value in federation.global_parameters.items():
        total = torch.zeros(value.shape, dtype=torch.float64)
        weight = torch.zeros(value.shape, dtype=torch.float64)
        for m, w in enumerate(weights):
            idx = param_idx[m][key]
            where = torch.meshgrid(*idx, indexing="ij") if value.dim() > 1 else idx
            total[where] += w * local_parameters[m][key].double()
            weight[where] += w
        covered = weight > 0
        value[covered] = (total[covered] / weight[covered]).to(value.dtype)


def as_loader(batches):
    return [{"img": list(x), "label": list(y)} for x, y in batches]


def authors(repo, case, run, sbn):
    """The case's rounds through the authors' code, in float64."""
    variant, cohorts = case["variant"], case["cohorts"]
    with authors_code(repo) as (cfg, fed, train_classifier_fed, models), default_dtype(torch.float64):
        configure(cfg, case)
        fed.torch = Float64Torch()
        train_classifier_fed.make_data_loader = lambda dataset: {"train": as_loader(sbn)}
        global_model = models.conv(model_rate=1.0)
        global_model.load_state_dict({k: v.double() for k, v in to_authors(case["initial"]).items()})
        global_parameters = global_model.state_dict()
        label_split = {c: list(range(10)) for c in range(len(CAPS))}
        federation = fed.Federation(global_parameters, list(CAPS), label_split)
        rounds = []
        for r, cohort in enumerate(cohorts):
            local_parameters, param_idx = federation.distribute(cohort)
            sent = {c: from_authors(p) for c, p in zip(cohort, local_parameters)}
            trained = []
            for c, params in zip(cohort, local_parameters):
                local = train_classifier_fed.Local(CAPS[c], as_loader(run.batches[r][c]), label_split[c])
                out = local.train(copy.deepcopy(params), case["lr"], NoLogger())
                assert all(float(out[k].abs().max()) < 1e-12 for k in CONV_BIASES), "conv bias moved"
                trained.append(out)
            locals_ = {c: from_authors(p) for c, p in zip(cohort, trained)}
            if variant == "uniform":
                federation.combine(trained, param_idx, cohort)
            else:
                weighted_combine(federation, trained, param_idx, [case["sizes"][c] for c in cohort])
            served = train_classifier_fed.stats(None, global_model).state_dict()
            rounds.append({"sent": sent, "locals": locals_, "global": from_authors(federation.global_parameters),
                           "stats": {o: served[a].detach().clone() for o, a in STATS.items()}})
    return rounds


def extraction(repo):
    """``distribute`` of a wider CNN (6 and 10 channels) at the paper's five rates."""
    with authors_code(repo) as (cfg, fed, _, models):
        configure(cfg, {}, hidden=(6, 10))
        torch.manual_seed(0)
        wide = models.conv(model_rate=1.0).state_dict()
        federation = fed.Federation(wide, RATES, {m: list(range(10)) for m in range(len(RATES))})
        wide_sent, _ = federation.distribute(list(range(len(RATES))))
    return {"global": from_authors(wide), "rates": RATES, "sent": [from_authors(p) for p in wide_sent]}


def main():
    args = common.repository_args()
    repo = common.add_repo(args.repo)
    out = common.out_dir("heterofl")
    for variant in VARIANTS:
        case, run, sbn = record(variant)
        torch.save({"case": case, "rounds": authors(repo, case, run, sbn)}, out / f"{variant}.pt")
    torch.save(extraction(repo), out / "extraction.pt")
    (out / "authors.pt").unlink(missing_ok=True)
    common.write_provenance(
        "heterofl", repo, commit=args.commit, repository=
        "https://github.com/diaoenmao/HeteroFL-Computation-and-Communication-Efficient-Federated-Learning-for-Heterogeneous-Clients",
        used=["src/fed.py: Federation.__init__, Federation.distribute (split_model, model_name conv), "
              "Federation.combine", "src/train_classifier_fed.py: Local.train, stats",
              "src/models/conv.py: conv (norm bn, scale true, mask false)", "src/config.py: cfg"],
        notes="Dirichlet 0.5 digits, 8 clients, 3 per round for 3 rounds (cohorts 4 5 6, 1 2 5, 1 5 6, each at "
              "rates 1, 1/2, 1/4), the project's CNN (channels 4, 8; the authors' conv with zero conv biases), SGD lr "
              "0.05 momentum 0.9 weight decay 0, clipping at 1, one epoch of batch 32; the project's HeteroFL with bn "
              "sbn (sbn_data train) and scaler true. Both sides in float64 (combine's float32 accumulators read "
              "float64 through a proxy of torch in fed.py). Variants: uniform (combine as written; ours weighting "
              "uniform) and samples (combine's counts replaced by examples, weighted_combine here; ours default). "
              "After every round: stats() (HeteroFL's sBN pass) of the global model on the batches our sBN pass read "
              "(make_data_loader answers them). Label splits of all ten classes (no masking). Batches stored as "
              "SHA-256 digests; case['levels'] holds the digits' grey levels. Files: uniform.pt, samples.pt (case, "
              "per round: sent, locals, global, stats), extraction.pt. extraction: distribute() of the "
              "authors' conv with hidden sizes (6, 10), torch.manual_seed(0), at rates 1, 1/2, 1/4, 1/8, 1/16; "
              "``anytree`` stubbed (dataset label trees only).")


if __name__ == "__main__":
    main()
