"""Golden values for HeteroFL from the authors' code (diaoenmao/HeteroFL-Computation-and-Communication-Efficient-Federated-Learning-for-Heterogeneous-Clients).

    python tools/reference/heterofl.py /path/to/HeteroFL

Case: iid digits, 6 clients of 223 examples, 3 per round at model rates 1, 1/2 and 1/4, the
project's CNN (channels 4 and 8) against the authors' ``conv`` (``src/models/conv.py``: conv,
Scaler, batch norm without tracked statistics, ReLU, max pool; the same hidden sizes), SGD lr
0.05, momentum 0.9, gradient clipping at norm 1, one epoch of batch 32. From ``src/fed.py``:
``Federation.distribute`` (the sub-models each client receives: ``split_model``'s leading
slices at ``ceil(rate * C)`` channels) and ``Federation.combine`` (the plain mean over the
clients holding each position); from ``src/train_classifier_fed.py``: ``Local.train`` (one
client's local epoch with the Scaler) on the batches our loop drew. Every client's label split
is all ten classes, so ``combine``'s and the logits' label masks are the identity (the
project does not mask; ``docs/heterofl_supernet.md``). The authors' convolutions have a bias
that the project's have not; it is set to zero and, a per-channel constant before batch norm
with batch statistics, it receives no gradient (checked below). Also stored: ``distribute`` of
a wider CNN (channels 6 and 10) at the five rates of the paper (1, 1/2, 1/4, 1/8, 1/16).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import tempfile
from dataclasses import replace

import numpy as np
import torch

import common
from reference_case import TRAIN, make_spec, run_one_round

from fl_lightning.algorithms.submodel import HeteroFL

CAPS = [0.25, 1.0, 0.75, 0.5, 0.5, 0.25]  # the round's cohort (clients 1, 4, 5) at 1, 1/2, 1/4
RATES = [1.0, 0.5, 0.25, 0.125, 0.0625]
OURS_TO_AUTHORS = {  # the authors' Sequential: conv 0, scaler 1, bn 2, relu 3, pool 4, conv 5, ..., linear 11
    "features.block0.conv.weight": "blocks.0.weight", "features.block0.bn.weight": "blocks.2.weight",
    "features.block0.bn.bias": "blocks.2.bias", "features.block1.conv.weight": "blocks.5.weight",
    "features.block1.bn.weight": "blocks.7.weight", "features.block1.bn.bias": "blocks.7.bias",
    "fc.weight": "blocks.11.weight", "fc.bias": "blocks.11.bias",
}
CONV_BIASES = ("blocks.0.bias", "blocks.5.bias")


def spec_and_algorithm(out_dir):
    alg = HeteroFL(caps=CAPS, bn="sbn", scaler=True)
    return make_spec(out_dir, alg, num_clients=6, clients_per_round=3, partition="iid",
                     train=replace(TRAIN, grad_clip=1.0))


def record():
    spec = spec_and_algorithm(tempfile.mkdtemp())
    fed, initial, cohort, batches = run_one_round(spec)
    rates = {c: float(fed.algorithm.caps[c]) for c in cohort}
    return {"initial": initial, "cohort": cohort, "batches": {c: batches[c] for c in cohort}, "rates": rates,
            "lr": spec.train.lr, "momentum": spec.train.momentum, "grad_clip": spec.train.grad_clip}


def to_authors(state):
    out = {OURS_TO_AUTHORS[k]: v.clone() for k, v in state.items() if k in OURS_TO_AUTHORS}
    for key in CONV_BIASES:
        out[key] = torch.zeros(out[key.replace("bias", "weight")].shape[0])
    return out


def from_authors(state):
    back = {a: o for o, a in OURS_TO_AUTHORS.items()}
    return {back[k]: v.detach().clone() for k, v in state.items() if k in back}


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
        from fed import Federation
        import models
        yield cfg, Federation, train_classifier_fed.Local, models
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


def authors(repo, case):
    with authors_code(repo) as (cfg, Federation, Local, models):
        configure(cfg, case)
        global_model = models.conv(model_rate=1.0)
        global_model.load_state_dict(to_authors(case["initial"]))
        global_parameters = global_model.state_dict()
        cohort = case["cohort"]
        label_split = {c: list(range(10)) for c in cohort}
        rate = np.ones(6)
        for c in cohort:
            rate[c] = case["rates"][c]
        federation = Federation(global_parameters, list(rate), label_split)
        local_parameters, param_idx = federation.distribute(cohort)
        sent = {c: from_authors(p) for c, p in zip(cohort, local_parameters)}
        trained = []
        for c, params in zip(cohort, local_parameters):
            loader = [{"img": list(x), "label": list(y)} for x, y in case["batches"][c]]
            local = Local(case["rates"][c], loader, label_split[c])
            out = local.train(copy.deepcopy(params), case["lr"], NoLogger())
            assert all(float(out[k].abs().max()) < 1e-6 for k in CONV_BIASES), "conv bias moved"
            trained.append(out)
        locals_ = {c: from_authors(p) for c, p in zip(cohort, trained)}
        federation.combine(trained, param_idx, cohort)
        global_after = from_authors(federation.global_parameters)

        # distribute() of a wider CNN at the paper's five rates
        configure(cfg, {}, hidden=(6, 10))
        torch.manual_seed(0)
        wide = models.conv(model_rate=1.0).state_dict()
        federation = Federation(wide, RATES, {m: list(range(10)) for m in range(len(RATES))})
        wide_sent, _ = federation.distribute(list(range(len(RATES))))
        extraction = {"global": from_authors(wide), "rates": RATES,
                      "sent": [from_authors(p) for p in wide_sent]}
    return {"sent": sent, "locals": locals_, "global": global_after, "extraction": extraction}


def main():
    repo = common.add_repo(sys.argv[1])
    torch.set_num_threads(1)
    out = common.out_dir("heterofl")
    case = record()
    torch.save({"case": case, **authors(repo, case)}, out / "authors.pt")
    common.write_provenance(
        "heterofl", repo,
        "https://github.com/diaoenmao/HeteroFL-Computation-and-Communication-Efficient-Federated-Learning-for-Heterogeneous-Clients",
        used=["src/fed.py: Federation.__init__, Federation.distribute (split_model, model_name conv), "
              "Federation.combine", "src/train_classifier_fed.py: Local.train",
              "src/models/conv.py: conv (norm bn, scale true, mask false)", "src/config.py: cfg"],
        notes="iid digits, 6 clients of 223, 3 per round (clients 1, 4, 5 at rates 1, 1/2, 1/4), the project's CNN "
              "(channels 4, 8; the authors' conv with zero conv biases), SGD lr 0.05 momentum 0.9 weight decay 0, "
              "clipping at 1, one epoch of batch 32; the project's HeteroFL with bn sbn and scaler true. Label "
              "splits of all ten classes (no masking). extraction: distribute() of the authors' conv with hidden "
              "sizes (6, 10), torch.manual_seed(0), at rates 1, 1/2, 1/4, 1/8, 1/16; ``anytree`` stubbed (dataset "
              "label trees only).")


if __name__ == "__main__":
    main()
