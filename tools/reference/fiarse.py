"""Golden values for FIARSE from the authors' code (HarliWu/FIARSE, its ``fiarse/`` folder).

    python tools/reference/fiarse.py /path/to/FIARSE [--commit SHA]

Case: Dirichlet digits, 8 clients of unequal shards, 2 per round for 3 rounds, kept fractions 1
(clients 0-2), 1/2 (3-5) and 1/4 (6-7); the project's CNN (channels 4 and 8) built from the
authors' masked layers (``fiarse/model/model_utils.py``: ``MaskedConv2d``, ``MaskedBatchNorm``,
``MaskedLinear``), plain SGD lr 0.05 (no momentum, no weight decay, as their worker), one epoch
of batch 32. Rounds of ``fiarse/server.py: Server.simulation_exp`` (global step 1): each
participant's mask by ``BetaResNet.generate_mask`` (``topk``: one threshold over every
convolution and linear parameter, ``|w| >= tau`` re-evaluated at every step),
``fiarse/worker.py: Worker.local_training`` on the batches our loop drew, and the server's
update. The participants are ours (``np.random.choice`` answers them, round by round);
evaluation is switched off. The model class is the adapter's: the authors' ``BetaResNet`` is a
ResNet, so the CNN here borrows its ``generate_mask`` and gives it the ``to_vector`` /
``set_threshold`` it calls, as ``BetaResNet`` does over its layers.

Two variants, 3 rounds each: ``authors_rule`` (``simulation_exp`` as written: the mean over the
clients that changed each position, ``grad != 0``; ours with ``weighting: uniform, support:
changed``) and ``defaults`` (our defaults ``weighting: samples, support: mask``: the same loop
with its update replaced by the example-weighted mean over the clients whose round-start mask
``|w| >= tau`` kept each position, written here as ``server_round``). Both run ours with
``threshold: global`` (the authors' ``fiarse/`` code; our default ``stage`` is their
``fiarse_layerwise/``, whose mask hard-codes a ResNet's six groups). Both sides run in float64
(networks and batches converted). Stored per variant: the case (batches as SHA-256 digests, the
digits' grey levels), and per round each participant's threshold and mask size, its trained
model and the global model.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import tempfile
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import common
from reference_case import TRAIN, batch_digest, default_dtype, grey_levels, make_spec, run_rounds

from fl_lightning.algorithms.supernet.fiarse import FIARSE

FRACTIONS = [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25]
NAMES = {"conv0.": "features.block0.conv.", "bn0.": "features.block0.bn.", "conv1.": "features.block1.conv.",
         "bn1.": "features.block1.bn.", "linear.": "fc."}


ROUNDS = 3
VARIANTS = {"authors_rule": {"gradient": "masked", "weighting": "uniform", "support": "changed", "server_lr": 1.0,
                        "weight_decay": 0.0},
            "defaults": {}}
MASK_KEYS = ["features.block0.conv.weight", "features.block1.conv.weight", "fc.weight", "fc.bias"]


def algorithm(variant: str):
    return FIARSE(fractions=FRACTIONS, threshold="global", recalibrate_bn=False, **VARIANTS[variant])


def train_config():
    return TRAIN.__class__(**{**TRAIN.__dict__, "momentum": 0.0})


def record(variant: str):
    spec = make_spec(tempfile.mkdtemp(), algorithm(variant), train=train_config(), rounds=ROUNDS)
    run = run_rounds(spec, ROUNDS, dtype=torch.float64)
    ctx = run.fed.ctx
    case = {"initial": run.initial,
            "levels": grey_levels(run.fed), "variant": variant, "options": VARIANTS[variant], "rounds": ROUNDS,
            "cohorts": run.cohorts, "sizes": {c: len(ctx.shards[c]) for c in range(ctx.num_clients)},
            "fractions": FRACTIONS, "lr": spec.train.lr,
            "digests": [{c: [batch_digest(x, y) for x, y in b[c]] for c in cohort}
                        for cohort, b in zip(run.cohorts, run.batches)]}
    return case, run.batches


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
def participants(cohorts, current):
    """``np.random.choice`` answers round ``t``'s call with our cohort of round ``t``."""
    old = np.random.choice

    def choice(*args, **kwargs):
        current["round"] = current.get("round", -1) + 1
        return np.array(cohorts[current["round"]])

    np.random.choice = choice
    try:
        yield
    finally:
        np.random.choice = old


def round_start_support(client_model):
    """Per key of the masked layers (the authors' names), the positions the round-start mask
    keeps (``|w| >= tau``, the threshold ``generate_mask`` set)."""
    out = {}
    for name, layer in (("conv0", client_model.conv0), ("conv1", client_model.conv1), ("linear", client_model.linear)):
        for attr in ("weight", "bias"):
            param = getattr(layer, attr, None)
            if param is not None:
                out[f"{name}.{attr}"] = (param.detach().abs() >= layer.threshold)
    return out


def server_round(server, workers, cohort, sizes):
    """One round of ``simulation_exp`` with our default rule in its update: the example-weighted
    mean of the participants' changes over the positions each one's round-start mask kept (every
    position of an unmasked tensor)."""
    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in server.model.state_dict().items()}
    weight = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in server.model.state_dict().items()}
    model_sizes = FRACTIONS
    for w_idx in cohort:
        client_model = copy.deepcopy(server.model)
        client_model.generate_mask(model_size=model_sizes[w_idx], topk=True, bern=True)
        support = round_start_support(client_model)
        gradient, _, _ = workers[w_idx].local_training(client_model, model_sizes[w_idx])
        for name, grad in gradient.items():
            kept = support.get(name, torch.ones_like(grad, dtype=torch.bool)).double()
            total[name] += sizes[w_idx] * kept * grad.double()
            weight[name] += sizes[w_idx] * kept
    params = server.model.state_dict()
    for name in params:
        avg = torch.nan_to_num(total[name] / weight[name], nan=0.0, posinf=0.0, neginf=0.0)
        params[name] = params[name] - (avg if "running" in name or "num_batches" in name
                                       else server.args.lr_global * avg).to(params[name].dtype)
    server.model.load_state_dict(params)


def authors(repo, case, batches):
    common.add_repo(repo, "fiarse")
    sys.path.insert(0, str(repo / "fiarse" / "model"))
    import model_utils
    import resnet_masked
    from server import Server
    from worker import Worker

    initial = {k: v.double() if v.is_floating_point() else v for k, v in case["initial"].items()}
    model = masked_cnn(model_utils, resnet_masked, initial)
    current = {}
    rounds = [{"masks": {}, "locals": {}} for _ in case["cohorts"]]
    generate_mask = model.generate_mask

    def worker(client):
        def next_batches(**kwargs):
            return iter(batches[current["round"]][client])

        me = SimpleNamespace(lr=case["lr"], local_updates_args={"iterations": -1}, get_next_K_batch=next_batches,
                             gpu="cpu", rank=client)
        train = functools.partial(Worker.local_training, me)

        def local_training(client_model, size):
            r = current["round"]
            rounds[r]["masks"][client] = {"threshold": client_model.threshold.detach().clone(),
                                          "kept": int(client_model.mask.sum())}
            out = train(client_model, size)
            rounds[r]["locals"][client] = to_ours(client_model.state_dict())
            return out

        return SimpleNamespace(local_training=local_training, test=lambda m: (0.0, 0.0, 0, 0))

    workers = [worker(c) for c in range(len(case["fractions"]))]
    sizes, counts = np.unique(case["fractions"], return_counts=True)
    order = np.argsort(-sizes)
    args = SimpleNamespace(model_size=[repr(float(sizes[i])) for i in order], model_dist=[repr(int(counts[i])) for i in order],
                           T=1, num_part=len(case["cohorts"][0]), lr_global=1.0, save_freq=1)
    server = Server.__new__(Server)
    server.args, server.model = args, model
    server.eval = lambda sizes: None
    server.test = lambda m: (0.0, 0.0, 0, 0)
    with participants(case["cohorts"], current):
        for r, cohort in enumerate(case["cohorts"]):
            if case["variant"] == "authors_rule":
                server.args = SimpleNamespace(**{**args.__dict__, "model_size": list(args.model_size),
                                                 "model_dist": list(args.model_dist)})
                server.simulation_exp(workers)
            else:
                current["round"] = r
                server_round(server, workers, cohort, case["sizes"])
            rounds[r]["global"] = to_ours(model.state_dict())
    assert model.generate_mask == generate_mask
    return rounds


def main():
    args = common.repository_args()
    repo = common.add_repo(args.repo)
    out = common.out_dir("fiarse")
    for variant in VARIANTS:
        case, batches = record(variant)
        with default_dtype(torch.float64):
            rounds = authors(repo, case, batches)
        torch.save({"case": case, "rounds": rounds, "mask_keys": MASK_KEYS}, out / f"{variant}.pt")
    (out / "authors.pt").unlink(missing_ok=True)
    common.write_provenance(
        "fiarse", repo, "https://github.com/HarliWu/FIARSE", commit=args.commit,
        used=["fiarse/server.py: Server.simulation_exp (T 1 per call: participants, masks, local training, the "
              "update)", "fiarse/worker.py: Worker.local_training", "fiarse/model/resnet_masked.py: "
              "BetaResNet.generate_mask (topk, bern)", "fiarse/model/model_utils.py: MaskedConv2d, MaskedLinear, "
              "MaskedBatchNorm, Bern"],
        notes="Dirichlet 0.5 digits, 8 clients, 2 per round for 3 rounds (cohorts 5 6, 1 5, 1 6; kept fractions "
              "1, 1, 1, 1/2, 1/2, 1/2, 1/4, 1/4), the project's CNN (channels 4, 8) from the authors' masked layers, "
              "SGD lr 0.05 (the worker's lr set directly; the code's 10 ** --lr), one epoch of batch 32, lr_global "
              "1; both sides in float64. Variants: authors_rule (simulation_exp as written; ours threshold global, "
              "gradient masked, weighting uniform, support changed, server_lr 1) and defaults (the update replaced "
              "by the example-weighted mean over each participant's round-start mask, server_round here; ours "
              "threshold global and its defaults weighting samples, support mask). Stand-ins: np.random.choice "
              "(returns the project's cohort of the round), the workers' batches (the project's), Server.eval and "
              "the tests (evaluation only). Batches stored as SHA-256 digests.")


if __name__ == "__main__":
    main()
