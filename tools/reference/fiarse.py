"""Golden values for FIARSE from the authors' code (HarliWu/FIARSE, its ``fiarse/`` folder).

    python tools/reference/fiarse.py /path/to/FIARSE

Case: Dirichlet digits, 8 clients, 2 per round, kept fractions 1 (clients 0-2), 1/2 (3-5) and
1/4 (6-7), the round's cohort (clients 5 and 6) at 1/2 and 1/4; the project's CNN (channels 4
and 8) built from the authors' masked layers (``fiarse/model/model_utils.py``: ``MaskedConv2d``,
``MaskedBatchNorm``, ``MaskedLinear``), plain SGD lr 0.05 (no momentum, no weight decay, as
their worker), one epoch of batch 32. One round of ``fiarse/server.py: Server.simulation_exp``
(T = 1, global step 1): each participant's mask by ``BetaResNet.generate_mask`` (``topk``:
one threshold over every convolution and linear parameter, ``|w| >= tau`` re-evaluated at every
step), ``fiarse/worker.py: Worker.local_training`` on the batches our loop drew, and the
server's update (the mean over the clients that changed each position). The participants are
ours (``np.random.choice`` answers them); evaluation is switched off. The model class is the
adapter's: the authors' ``BetaResNet`` is a ResNet, so the CNN here borrows its
``generate_mask`` and gives it the ``to_vector``/``set_threshold`` it calls, as ``BetaResNet``
does over its layers. Stored as well: each participant's threshold and mask of the initial
model.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import tempfile
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import common
from reference_case import TRAIN, make_spec, run_one_round

from fl_lightning.algorithms.fiarse import FIARSE

FRACTIONS = [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25]
NAMES = {"conv0.": "features.block0.conv.", "bn0.": "features.block0.bn.", "conv1.": "features.block1.conv.",
         "bn1.": "features.block1.bn.", "linear.": "fc."}


def algorithm():
    return FIARSE(fractions=FRACTIONS, threshold="global", gradient="masked", weighting="uniform",
                  support="changed", server_lr=1.0, weight_decay=0.0, recalibrate_bn=False)


def train_config():
    return TRAIN.__class__(**{**TRAIN.__dict__, "momentum": 0.0})


def record():
    spec = make_spec(tempfile.mkdtemp(), algorithm(), train=train_config())
    fed, initial, cohort, batches = run_one_round(spec)
    return {"initial": initial, "cohort": cohort, "batches": {c: batches[c] for c in cohort},
            "fractions": FRACTIONS, "lr": spec.train.lr}


def to_ours(state):
    out = {}
    for k, v in state.items():
        for a, b in NAMES.items():
            if k.startswith(a):
                out[b + k[len(a):]] = v.detach().clone()
    return out


def masked_cnn(model_utils, resnet_masked, initial):
    class MaskedCNN(nn.Module):
        generate_mask = resnet_masked.BetaResNet.generate_mask

        def __init__(self):
            super().__init__()
            self.conv0 = model_utils.MaskedConv2d(1, 4, 3, padding=1, bias=False)
            self.bn0 = model_utils.MaskedBatchNorm(4)
            self.conv1 = model_utils.MaskedConv2d(4, 8, 3, padding=1, bias=False)
            self.bn1 = model_utils.MaskedBatchNorm(8)
            self.linear = model_utils.MaskedLinear(8, 10)

        def masked(self):
            return [self.conv0, self.conv1, self.linear]

        def to_vector(self, attr, layerwise=False):
            vectors = [v for layer in self.masked() for v in layer.to_vector(attr)]
            return vectors if layerwise else torch.concat(vectors)

        def set_threshold(self, value, bern=False):
            for layer in self.masked():
                layer.set_threshold(value, bern)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.bn0(self.conv0(x))), 2)
            x = F.relu(self.bn1(self.conv1(x)))
            return self.linear(F.adaptive_avg_pool2d(x, 1).flatten(1))

    model = MaskedCNN()
    back = {b: a for a, b in NAMES.items()}
    model.load_state_dict({back[p] + k[len(p):]: v.clone() for k, v in initial.items()
                           for p in back if k.startswith(p)})
    return model


@contextlib.contextmanager
def participants(cohort):
    old = np.random.choice
    np.random.choice = lambda *a, **k: np.array(cohort)
    try:
        yield
    finally:
        np.random.choice = old


def authors(repo, case):
    common.add_repo(repo, "fiarse")
    sys.path.insert(0, str(repo / "fiarse" / "model"))
    import model_utils
    import resnet_masked
    from server import Server
    from worker import Worker

    model = masked_cnn(model_utils, resnet_masked, case["initial"])
    masks = {}
    for client in case["cohort"]:
        probe = masked_cnn(model_utils, resnet_masked, case["initial"])
        probe.generate_mask(model_size=case["fractions"][client], topk=True, bern=True)
        masks[client] = {"threshold": probe.threshold.detach().clone(), "mask": probe.mask.detach().clone()}

    trained = {}

    def worker(client):
        def batches(**kwargs):
            return iter(case["batches"][client])

        me = SimpleNamespace(lr=case["lr"], local_updates_args={"iterations": -1}, get_next_K_batch=batches,
                             gpu="cpu", rank=client)
        train = functools.partial(Worker.local_training, me)

        def local_training(client_model, size):
            out = train(client_model, size)
            trained[client] = to_ours(client_model.state_dict())
            return out

        return SimpleNamespace(local_training=local_training, test=lambda m: (0.0, 0.0, 0, 0))

    sizes, counts = np.unique(case["fractions"], return_counts=True)
    order = np.argsort(-sizes)
    args = SimpleNamespace(model_size=[repr(float(sizes[i])) for i in order], model_dist=[repr(int(counts[i])) for i in order],
                           T=1, num_part=len(case["cohort"]), lr_global=1.0, save_freq=1)
    server = Server.__new__(Server)
    server.args, server.model = args, model
    server.eval = lambda sizes: None
    server.test = lambda m: (0.0, 0.0, 0, 0)
    with participants(case["cohort"]):
        server.simulation_exp([worker(c) for c in range(len(case["fractions"]))])
    return {"global": to_ours(model.state_dict()), "locals": trained, "masks": masks,
            "mask_keys": ["features.block0.conv.weight", "features.block1.conv.weight", "fc.weight", "fc.bias"]}


def main():
    repo = common.add_repo(sys.argv[1])
    torch.set_num_threads(1)
    out = common.out_dir("fiarse")
    case = record()
    torch.save({"case": case, **authors(repo, case)}, out / "authors.pt")
    common.write_provenance(
        "fiarse", repo, "https://github.com/HarliWu/FIARSE",
        used=["fiarse/server.py: Server.simulation_exp (T 1: participants, masks, local training, the update)",
              "fiarse/worker.py: Worker.local_training", "fiarse/model/resnet_masked.py: BetaResNet.generate_mask "
              "(topk, bern)", "fiarse/model/model_utils.py: MaskedConv2d, MaskedLinear, MaskedBatchNorm, Bern"],
        notes="Dirichlet 0.5 digits, 8 clients, 2 per round (clients 5, 6 at kept fractions 1/2, 1/4), the project's "
              "CNN (channels 4, 8) from the authors' masked layers, SGD lr 0.05 (the worker's lr set directly; the "
              "code's 10 ** --lr), one epoch of batch 32, lr_global 1; the project's FIARSE with threshold global, "
              "gradient masked, weighting uniform, support changed, server_lr 1. Stand-ins: np.random.choice "
              "(returns the project's cohort), the workers' batches (the project's), Server.eval and the tests "
              "(evaluation only).")


if __name__ == "__main__":
    main()
