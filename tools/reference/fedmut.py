"""Golden values for FedMut from the authors' code (HMHelloWorld/FedMut).

    python tools/reference/fedmut.py /path/to/FedMut

Case: Dirichlet digits, 8 clients, 2 per round, the project's CNN (channels 4 and 8, batch
norm), SGD lr 0.05 and momentum 0.9, one epoch of batch 32. From
``Algorithm/Training_FedMut.py``: ``LocalUpdate_FedMut.train`` per client on the batches our
loop drew (round 0: every client starts from the initial model), ``models/Fed.py:
Aggregation(w_locals, None)`` (the plain mean), ``FedSub`` (the global update ``g``) and
``mutation_spread`` (the models sent in round 1, radius 4, ``mut_acc_rate`` 0; its signs come
from Python's ``random``, seeded 0 here). The official code mutates every state-dict entry,
so ours runs with ``mutate_buffers: true``.
"""

from __future__ import annotations

import random
import sys
import tempfile
from types import SimpleNamespace

import torch

import common
from reference_case import TRAIN, make_spec, run_one_round

from fl_lightning.algorithms.fedmut import FedMut

ALPHA = 4.0


class DictOutput(common.TinyCNN):
    """The official networks return ``{'output': logits}``."""

    def forward(self, x):
        return {"output": super().forward(x)}


def record():
    spec = make_spec(tempfile.mkdtemp(), FedMut(alpha=ALPHA, mutate_buffers=True))
    fed, initial, cohort, batches = run_one_round(spec)
    common.check_same_function(initial, batches[cohort[0]])
    return {"initial": initial, "cohort": cohort, "batches": {c: batches[c] for c in cohort},
            "lr": spec.train.lr, "momentum": spec.train.momentum, "alpha": ALPHA}


def authors(repo, case):
    common.add_repo(repo)
    from Algorithm.Training_FedMut import FedSub, LocalUpdate_FedMut, mutation_spread
    from models.Fed import Aggregation

    args = SimpleNamespace(local_bs=TRAIN.batch_size, device="cpu", optimizer="sgd", lr=case["lr"],
                           momentum=case["momentum"], local_ep=1, ensemble_alpha=0.2, mut_acc_rate=0.0,
                           mut_bound=50, radius=case["alpha"])
    net = DictOutput()
    net.load_state_dict(common.to_plain(case["initial"]))
    w_old = {k: v.clone() for k, v in net.state_dict().items()}
    w_locals = []
    for client in case["cohort"]:
        net.load_state_dict(w_old)
        local = LocalUpdate_FedMut(args=args, dataset=[(torch.zeros(1), 0)], idxs=[0])
        local.ldr_train = case["batches"][client]
        w_locals.append({k: v.clone() for k, v in local.train(net=net).items()})
    w_glob = Aggregation(w_locals, None)
    w_delta = FedSub(w_glob, w_old, 1.0)
    random.seed(0)
    mutated = mutation_spread(args, 1, w_glob, w_old, w_locals, len(w_locals), w_delta, args.radius)
    return {"global": common.to_ours(w_glob), "mutated": [common.to_ours(w) for w in mutated]}


def main():
    repo = sys.argv[1]
    torch.set_num_threads(1)
    out = common.out_dir("fedmut")
    case = record()
    torch.save({"case": case, **authors(repo, case)}, out / "authors.pt")
    common.write_provenance(
        "fedmut", common.add_repo(repo), "https://github.com/HMHelloWorld/FedMut",
        used=["Algorithm/Training_FedMut.py: LocalUpdate_FedMut.train, FedSub, mutation_spread "
              "(the steps of FedMut() for one round)",
              "models/Fed.py: Aggregation(w, None)"],
        notes="Dirichlet 0.5 digits, 8 clients, 2 per round, the project's CNN (channels 4, 8), SGD lr 0.05 momentum "
              "0.9, one epoch of batch 32; radius 4, mut_acc_rate 0 (the project's default; the code's default 0.3 "
              "is acc_rate: 0.3), Python random seeded 0 for the signs. The loop of FedMut() itself is not called: it "
              "loads its data, samples clients with numpy and tests every round.")


if __name__ == "__main__":
    main()
