"""Golden values for FedRolex from the authors' code (AIoT-MLSys-Lab/FedRolex).

    python tools/reference/fedrolex.py /path/to/FedRolex [--commit SHA]

``--commit`` names the commit a folder extracted with ``git archive`` came from.

Case (``tests/reference_fedrolex_case.py``): three rounds of our ``FedRolex`` on digits, 6
clients with unequal shards, 3 per round at rates 1/4 to 1, the project's CNN (channels 4, 8),
against the authors' ``models/conv.py`` ``conv`` (conv, Scaler, batch norm without tracked
statistics, ReLU, max pool; the same hidden sizes; its conv biases set to zero, which receive no
gradient before batch statistics: they stay below 1e-12, rounding of batch norm's backward sums,
checked below).

From ``resnet_server.py``: ``ResnetServerRoll`` (the rolling server, ``--algo roll``, overlap
None, weighting avg): ``distribute`` (``split_model``'s rolled index sets, round counter
``rounds``) and ``step`` (``combine``, then ``rounds += 1``); from ``resnet_client.py``:
``ResnetClient.step`` (one client's local epoch: their ``make_optimizer`` SGD, masked cross
entropy, clipping at 1) on the batches our loop drew, in our cohort order.

The rolling server reads each tensor's role from its state-dict name ('conv1'/'conv2': a rolled
convolution, 'linear': the classifier, other vectors: the preceding convolution's output), names
of their ResNet; the conv model's tensors are held for it under those names (``ServerView``).
Their client builds ``resnet18``; it builds their ``conv`` here (``resnet18`` replaced in the
client's module), on the CPU (their ``.to('cuda')`` and ``to_device(..., 'cuda')`` are no-ops).
``ray`` is stubbed (remote actors become plain objects; ``get``/``put`` are the identity) and
``anytree`` (dataset label trees). Both sides run in float64 (networks and batches), so the
comparison's only rounding is float64's; ``combine``'s accumulators are ``torch.float32`` by
construction (``resnet_server.py:163-164``), which read ``torch.float64`` here through the proxy of
``torch`` the HeteroFL adapter uses (a precision stand-in, nothing else changes). Every client's label split is all ten classes, so the masks
of the logits and of ``combine``'s classifier rows are the identity (the project does not mask).

``combine`` weights the classifier, batch-norm parameters and biases by the stored update counts
``tmp_counts`` (1 plus the updates each position has had, counting the round's earlier clients:
after the first key ``tmp_counts`` aliases the round's copy), and convolution weights by one
per client (weighting ``avg``). The paper's rule is one weight per client for every position
(``docs/fedrolex.md``); the golden trajectory follows it: after each ``step`` the count-weighted
tensors are replaced by the plain mean over the clients holding each position, computed here
from their returned tensors and ``split_model``'s index sets (the same helper reproduces their
convolution weights, checked below). Their unmodified ``combine`` output is stored beside it.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from types import ModuleType

import torch
from torch import nn

import common
from heterofl import Float64Torch
from reference_case import default_dtype
from reference_fedrolex_case import PARAMS, ROUNDS, case_record, run_case

OURS_TO_SERVER = {
    "features.block0.conv.weight": "conv1.weight", "features.block0.bn.weight": "n1.weight",
    "features.block0.bn.bias": "n1.bias", "features.block1.conv.weight": "conv2.weight",
    "features.block1.bn.weight": "n2.weight", "features.block1.bn.bias": "n2.bias",
    "fc.weight": "linear.weight", "fc.bias": "linear.bias",
}
SERVER_TO_CLIENT = {"conv1.": "blocks.0.", "n1.": "blocks.2.", "conv2.": "blocks.5.", "n2.": "blocks.7.",
                    "linear.": "blocks.11."}
CONV_BIASES = ("conv1.bias", "conv2.bias")
PLAIN_MEAN_KEYS = ("conv1.weight", "conv2.weight")  # combine's weighting avg: one per client


class ServerView(nn.Module):
    """Their conv model's tensors under the names their rolling server reads (shared, not copied)."""

    def __init__(self, conv_model: nn.Module):
        super().__init__()
        blocks = conv_model.blocks
        self.conv1, self.n1, self.conv2, self.n2, self.linear = blocks[0], blocks[2], blocks[5], blocks[7], blocks[11]


def rename(state, table):
    out = {}
    for key, value in state.items():
        prefix = next(p for p in table if key.startswith(p))
        out[table[prefix] + key[len(prefix):]] = value
    return out


def to_client(state):
    return rename(state, SERVER_TO_CLIENT)


def to_server(state):
    return rename(state, {v: k for k, v in SERVER_TO_CLIENT.items()})


def from_server(state):
    back = {v: k for k, v in OURS_TO_SERVER.items()}
    return {back[k]: v.detach().clone() for k, v in state.items() if k in back}


def to_server_initial(initial, conv_biases):
    out = {OURS_TO_SERVER[k]: v.double() for k, v in initial.items() if k in OURS_TO_SERVER}
    out.update(conv_biases)
    return out


@contextlib.contextmanager
def authors_code(repo):
    """Their modules read ``config.yml`` from the working folder at import; ``ray`` and
    ``anytree`` are stubbed (above)."""
    common.add_repo(repo)
    ray = ModuleType("ray")
    ray.remote = lambda *args, **kwargs: (lambda cls: cls)
    ray.get = lambda ref: ref
    ray.put = lambda value: value
    sys.modules["ray"] = ray
    common.stub_modules("anytree")
    cwd, argv = os.getcwd(), sys.argv
    os.chdir(repo)
    sys.argv = [argv[0]]
    try:
        from config import cfg
        import resnet_client
        import resnet_server
        from models import conv
        yield cfg, resnet_server.ResnetServerRoll, resnet_client, conv
    finally:
        os.chdir(cwd)
        sys.argv = argv


def configure(cfg, case):
    cfg.update({"model_name": "conv", "conv": {"hidden_size": [4, 8]}, "data_shape": [1, 8, 8],
                "classes_size": 10, "norm": "bn", "scale": True, "mask": True, "global_model_rate": 1.0,
                "model_split_mode": "fix", "overlap": None, "weighting": "avg", "device": "cpu",
                "optimizer_name": "SGD", "momentum": case["momentum"], "weight_decay": case["weight_decay"],
                "num_epochs": {"global": ROUNDS, "local": 1}, "log_interval": 0.25, "model_tag": "golden",
                "metric_name": {"train": {"Local": ["Local-Loss", "Local-Accuracy"]}}})


def cpu_conv(conv_module):
    """Their ``conv`` whose ``.to('cuda')`` (in their client's ``step``) stays on the CPU."""

    class CpuConv(conv_module.Conv):
        def to(self, *args, **kwargs):
            return self if args and args[0] == "cuda" else super().to(*args, **kwargs)

    def build(model_rate=1, track=False, cfg=None):
        model = conv_module.conv(model_rate=model_rate, track=track)
        model.__class__ = CpuConv
        return model

    return build


def indices_of(param_idx):
    """``split_model``'s index sets under our keys: (out, in) for weights, (positions,) for vectors."""
    out = {}
    for ours, key in OURS_TO_SERVER.items():
        idx = param_idx[key]
        out[ours] = tuple(i.clone() for i in idx) if isinstance(idx, (tuple, list)) else (idx.clone(),)
    return out


def plain_mean(global_parameters, trained, param_idx, keys):
    """Per position, the plain mean over the clients whose index sets hold it (else unchanged)."""
    out = {}
    for key in keys:
        old = global_parameters[key]
        total = torch.zeros(old.shape, dtype=torch.float64)
        count = torch.zeros(old.shape, dtype=torch.float64)
        for state, idx in zip(trained, param_idx):
            where = torch.meshgrid(*idx[key], indexing="ij") if isinstance(idx[key], (tuple, list)) else idx[key]
            total[where] += state[key].double()
            count[where] += 1
        out[key] = torch.where(count > 0, total / count.clamp_min(1), old.double()).to(old.dtype)
    return out


def authors(repo, run, case):
    """The case's rounds through the authors' code, in float64."""
    with authors_code(repo) as (cfg, Server, client_module, conv_module), default_dtype(torch.float64):
        configure(cfg, case)
        sys.modules[Server.__module__].torch = Float64Torch()
        client_module.resnet = type("resnet", (), {"resnet18": staticmethod(cpu_conv(conv_module))})
        client_module.to_device = lambda value, device: value
        view = ServerView(conv_module.conv(model_rate=1.0))
        zero_biases = {k: torch.zeros_like(v) for k, v in view.state_dict().items() if k in CONV_BIASES}
        view.load_state_dict(to_server_initial(case["initial"], zero_biases))
        label_split = [list(range(10))] * len(case["caps"])
        server = Server(view, list(case["caps"]), {"label_split": label_split}, cfg)
        rounds = []
        for r, cohort in enumerate(case["cohorts"]):
            local_parameters, param_idx = server.distribute(cohort)
            record = {"indices": {c: indices_of(param_idx[m]) for m, c in enumerate(cohort)},
                      "sent": {c: from_server(p) for c, p in zip(cohort, local_parameters)}}
            trained = []
            for m, c in enumerate(cohort):
                client = client_module.ResnetClient("/tmp/fedrolex_golden_log", [cfg])
                client.local_parameters = to_client(copy.deepcopy(local_parameters[m]))
                client.client_id, client.model_rate, client.lr = c, case["caps"][c], case["lr"]
                client.label_split = label_split
                client.data_loader = [{"img": list(x), "label": list(y)} for x, y in run.batches[r][c]]
                out = to_server(client.step(m, len(cohort), time.time()))
                # zero gradient before batch statistics, up to the rounding of BN's backward sums
                assert all(float(out[k].abs().max()) < 1e-12 for k in CONV_BIASES), "a conv bias moved"
                trained.append(out)
            record["locals"] = {c: from_server(p) for c, p in zip(cohort, trained)}
            before = {k: v.clone() for k, v in server.global_parameters.items()}
            indices = [copy.deepcopy(p) for p in param_idx]  # combine re-indexes the classifier's in place
            server.step(trained, param_idx, cohort)
            combined = {k: v.clone() for k, v in server.global_model.state_dict().items()}
            record["combine"] = from_server(combined)
            mean = plain_mean(before, trained, indices, list(combined))
            for key in PLAIN_MEAN_KEYS:  # the helper is their combine where theirs is a plain mean
                assert float((mean[key] - combined[key]).abs().max()) < 1e-12, key
            server.global_model.load_state_dict(mean)
            server.global_parameters = server.global_model.state_dict()
            record["global"] = from_server(mean)
            record["rounds_after"] = int(server.rounds)
            rounds.append(record)
    return rounds


def main():
    args = common.repository_args("fedrolex")
    repo = common.add_repo(args.fedrolex)
    out = common.out_dir("fedrolex")
    run, _, _ = run_case()
    case = case_record(run)
    rounds = authors(repo, run, case)
    torch.save({"case": case, "rounds": rounds}, out / "authors.pt")
    combine_gap = max(float((r["combine"][k] - r["global"][k]).abs().max()) for r in rounds for k in PARAMS)
    common.write_provenance(
        "fedrolex", repo, "https://github.com/AIoT-MLSys-Lab/FedRolex", commit=args.commit,
        used=["resnet_server.py: ResnetServerRoll.__init__, distribute (split_model), step (combine)",
              "resnet_client.py: ResnetClient.__init__, step, pull",
              "models/conv.py: conv (norm bn, scale true, mask true)", "utils.py: make_optimizer, collate",
              "config.py: cfg"],
        notes="digits, 6 clients (Dirichlet 0.5: 242, 215, 249, 238, 246, 148 examples), 3 per round for 3 "
              "rounds (cohorts {1,4,5}, {0,1,4}, {2,4,5}), caps 3/4, 1/2, 3/4, 1/4, 1, 1/4; the project's CNN "
              "(channels 4, 8; their conv with zero conv biases); SGD lr 0.05 momentum 0.9 weight decay 5e-4, "
              "clipping at 1, one epoch of batch 32; the project's FedRolex with bn sbn, scaler true, weighting "
              "uniform. Both sides in float64 (combine's float32 accumulators read float64 through a proxy of torch in "
              "resnet_server.py). Batches stored as SHA-256 digests; case['levels'] holds the digits' grey levels. "
              "Label splits of all ten classes (masks are the identity). After each step the tensors "
              "combine weights by update counts (batch-norm parameters, conv biases, classifier) are replaced "
              "by the plain mean over the clients holding each position (the paper's rule); 'combine' keeps "
              f"their output, at most {combine_gap:.3g} from it. ray and anytree stubbed; their client builds "
              "their conv instead of resnet18, on the CPU.",
        combine_gap=combine_gap)


if __name__ == "__main__":
    main()
