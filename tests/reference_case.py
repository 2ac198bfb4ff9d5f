"""The tiny one-round case on which golden values were taken from the reference
implementations (``tools/reference/``), and the recorder of the batches a run feeds.

Both sides see the same thing: the narrow CNN on digits built from seed 0 (its initial state
is stored beside the golden values), one round, and the exact mini-batches our loop drew for
each client (recorded here and replayed into the reference code by the adapter).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from pathlib import Path
from typing import Dict, List, Optional

import torch
from lightning.fabric import Fabric

from fl_lightning.config import (DataConfig, EvalConfig, FabricConfig, FederationConfig, LocalTrainConfig,
                                 PartitionConfig)
from fl_lightning.data import Digits
from fl_lightning.federation.builder import RunSpec
from fl_lightning.federation.loop import Federation
from fl_lightning.federation.run_dir import RunDir
from fl_lightning.runtime.client_data import ClientData

DATA_ROOT = Path(__file__).parent / "data" / "reference"
TRAIN = LocalTrainConfig(epochs=1, batch_size=32, lr=0.05, momentum=0.9, weight_decay=0.0)
HEAD = ("fc.weight", "fc.bias")
# A model without batch norm or dropout (as the originals' networks of FedGH and FedAS): a
# one-block ViT of width 8 on 2x2 patches of 4x4 pixels.
VIT = {"class_path": "fl_lightning.elastic.models.ViT", "init_args": {"patch_size": 4, "embed_dim": 8, "depth": 1, "num_heads": 2}}


def make_spec(out_dir, algorithm, *, train: LocalTrainConfig = TRAIN, num_clients: int = 8,
              clients_per_round: int = 2, partition: str = "dirichlet", model: Optional[dict] = None,
              data: Optional[DataConfig] = None, rounds: int = 1) -> RunSpec:
    """Digits, ``num_clients`` clients (Dirichlet 0.5 unless ``partition``), a CNN of 4 and 8
    channels, ``rounds`` rounds (default one) of ``clients_per_round`` clients, one CPU rank."""
    return RunSpec(
        name="ref", out_dir=str(out_dir), seed=0, algorithm=algorithm,
        data=data or DataConfig(dataset=Digits(), val_size=100),
        partition=PartitionConfig(method=partition, num_clients=num_clients, alpha=0.5),
        model=model or {"class_path": "fl_lightning.elastic.models.CNN", "init_args": {"channels": [4, 8]}},
        train=train,
        federation=FederationConfig(rounds=rounds, clients_per_round=clients_per_round),
        eval=EvalConfig(every=1),
        fabric=FabricConfig(accelerator="cpu", devices=1, threads_per_rank=1),
    )


class BatchRecorder:
    """Records every mini-batch ``ClientData.epoch`` yields, in order, keyed by the shard it
    came from (the first index of the shard identifies the client)."""

    def __init__(self):
        self.batches: List[tuple] = []  # (shard key, batch size, x, y)

    @contextlib.contextmanager
    def recording(self):
        original = ClientData.epoch
        recorder = self

        def epoch(data, generator):
            key = tuple(data.indices[:4].tolist()) + (len(data.indices),)
            for x, y in original(data, generator):
                recorder.batches.append((key, data.batch_size, x.clone(), y.clone()))
                yield x, y

        ClientData.epoch = epoch
        try:
            yield self
        finally:
            ClientData.epoch = original


def shard_key(data: ClientData) -> tuple:
    return tuple(data.indices[:4].tolist()) + (len(data.indices),)


def federation(spec: RunSpec) -> Federation:
    fed = Federation(Fabric(accelerator="cpu", devices=1), spec, RunDir(spec.out_dir, spec.name))
    fed._open_outputs()
    return fed


def run_one_round(spec: RunSpec):
    """Our side: the loop's round 0. Returns the federation, the initial global state, the
    round's cohort, and the batches each client's shard yielded (in order), keyed by client:
    ``batches[c]`` those of ``train.batch_size``, ``batches[(c, b)]`` those of another size
    ``b`` (an algorithm's own pass, e.g. FedAS's alignment)."""
    fed = federation(spec)
    alg, ctx = fed.algorithm, fed.ctx
    initial = {k: v.clone() for k, v in alg.global_state.items()}
    cohort = list(alg.plan(0).cohort)
    recorder = BatchRecorder()
    with recorder.recording():
        fed.round_row, fed.client_rows = fed.run_round(0)
    by_client: Dict[int, list] = {c: [] for c in cohort}
    keys = {shard_key(ctx.shards[c]): c for c in range(ctx.num_clients)}
    for key, size, x, y in recorder.batches:
        client = keys[key] if size == spec.train.batch_size else (keys[key], size)
        by_client.setdefault(client, []).append((x, y))
    return fed, initial, cohort, by_client


class Rounds:
    """What ``run_rounds`` saw: the initial global state, and per round the cohort (in plan
    order), each client's batches (as ``run_one_round``), each client's returned state (its
    trained local model's state dict, as committed) and the global state after the round."""

    def __init__(self, fed, initial):
        self.fed, self.initial = fed, initial
        self.cohorts: List[List[int]] = []
        self.batches: List[Dict] = []
        self.returned: List[Dict[int, Dict[str, torch.Tensor]]] = []
        self.globals: List[Dict[str, torch.Tensor]] = []


def _by_client(spec, ctx, cohort, recorder) -> Dict:
    """Batches by client (``run_one_round``'s keys); batches of data that is no client's shard
    (MultiSFL's replayed examples) under ``("replay", c)``, c the client whose batch came last."""
    by_client: Dict = {c: [] for c in cohort}
    keys = {shard_key(ctx.shards[c]): c for c in range(ctx.num_clients)}
    last = None
    for key, size, x, y in recorder.batches:
        if key not in keys:
            client = ("replay", last)
        else:
            last = keys[key]
            client = last if size == spec.train.batch_size else (last, size)
        by_client.setdefault(client, []).append((x, y))
    return by_client


@contextlib.contextmanager
def default_dtype(dtype: Optional[torch.dtype]):
    old = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def snap_to_levels(fed, levels: torch.Tensor) -> None:
    """Replace every pixel of the run's digits by the nearest stored grey level: the images a
    golden case was made from, exactly (ours agree with them to float32 rounding, checked)."""
    bundle = fed.ctx.data.bundle
    for dataset in {id(d): d for d in (bundle.train, bundle.train_eval, bundle.test)}.values():
        data = dataset.data
        lv = levels.to(data.dtype)
        idx = torch.bucketize(data, (lv[1:] + lv[:-1]) / 2)
        assert float((lv[idx] - data).abs().max()) < 1e-6, "the stored grey levels are not the run's pixels"
        dataset.data = lv[idx]


def load_initial(fed, initial: Dict[str, torch.Tensor]) -> None:
    """Start from a stored initial model (ours regenerates it to float32 rounding, checked)."""
    state = fed.algorithm.global_state
    for key, value in initial.items():
        ours = state[key]
        assert ours.shape == value.shape, key
        if ours.is_floating_point():
            assert torch.allclose(ours.double(), value.double(), rtol=1e-6, atol=1e-7), key
        else:
            assert torch.equal(ours, value), key
        ours.copy_(value)


def run_rounds(spec: RunSpec, rounds: int, dtype: Optional[torch.dtype] = None, levels: Optional[torch.Tensor] = None,
               initial: Optional[Dict[str, torch.Tensor]] = None, after_round=None) -> Rounds:
    """Our side over ``rounds`` rounds of the loop (``spec.federation.rounds`` should equal it,
    for the learning-rate schedule): everything a reference needs to replay them, and what to
    compare after each.

    ``dtype``: the model and the images in that precision (float64: a comparison whose only
    rounding is float64's); ``levels``: snap the images to these grey levels (a stored case's);
    ``initial``: start from this stored model; ``after_round(r, fed)``: called after each round
    (e.g. to read the served statistics)."""
    with default_dtype(dtype):
        fed = federation(spec)
        if dtype is not None:
            bundle = fed.ctx.data.bundle
            for dataset in {id(d): d for d in (bundle.train, bundle.train_eval, bundle.test)}.values():
                dataset.data = dataset.data.to(dtype)
        if levels is not None:
            snap_to_levels(fed, levels)
        if initial is not None:
            load_initial(fed, initial)
        out = _run(fed, spec, rounds, after_round)
    return out


def _run(fed, spec, rounds, after_round) -> Rounds:
    alg = fed.algorithm
    out = Rounds(fed, {k: v.clone() for k, v in alg.global_state.items()})
    commit = alg.commit

    def keep(acc, task, result, plan):
        state = result.model.module.state_dict() if result.model is not None else {}
        out.returned[-1][task.client] = {k: v.detach().clone() for k, v in state.items()}
        commit(acc, task, result, plan)

    alg.commit = keep
    try:
        for r in range(rounds):
            cohort = list(alg.plan(r).cohort)
            out.returned.append({})
            recorder = BatchRecorder()
            with recorder.recording():
                fed.round_row, fed.client_rows = fed.run_round(r)
            out.cohorts.append(cohort)
            out.batches.append(_by_client(spec, fed.ctx, cohort, recorder))
            out.globals.append({k: v.detach().clone() for k, v in alg.global_state.items()})
            if after_round is not None:
                after_round(r, fed)
    finally:
        alg.commit = commit
    return out


class ServedStatisticsLog:
    """An ``after_round`` callback: after each round, the BN running statistics of the model our
    method serves (``statistics.served``: under sbn, one pass over the client data) and the
    batches that pass read."""

    def __init__(self):
        self.rounds: List[dict] = []

    def __call__(self, round_idx, fed):
        statistics, seen = fed.algorithm.statistics, []
        original = statistics.client_batches

        def tee():
            for x, y in original():
                seen.append((x.clone(), y.clone()))
                yield x, y

        statistics.client_batches = tee
        try:
            state = statistics.served(fed.ctx.model).state_dict()
        finally:
            del statistics.client_batches
        stats = {k: v.detach().clone() for k, v in state.items() if k.endswith(("running_mean", "running_var"))}
        self.rounds.append({"stats": stats, "batches": seen})


def grey_levels(fed) -> torch.Tensor:
    """The distinct pixel values of the run's digits (17 grey levels, normalized), float32."""
    bundle = fed.ctx.data.bundle
    return torch.unique(torch.cat([bundle.train.data.flatten(), bundle.test.data.flatten()])).float()


def shard(ctx, client: int):
    """A client's whole shard, in shard order."""
    data = ctx.shards[client]
    return data.dataset.data[data.indices].clone(), data.dataset.targets[data.indices].clone()


def load(method: str, name: str):
    return torch.load(DATA_ROOT / method / name, map_location="cpu", weights_only=False)


def max_abs_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], keys) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in keys)


def batch_digest(x: torch.Tensor, y: torch.Tensor) -> str:
    """SHA-256 of a batch's inputs (as float32) and labels (as int64), shapes included: what a
    golden file stores instead of the batches themselves, to stay small."""
    h = hashlib.sha256()
    for t, dtype in ((x, torch.float32), (y, torch.int64)):
        t = t.detach().to("cpu", dtype).contiguous()
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


# -- float64 comparisons --------------------------------------------------------------------------
EPS64 = torch.finfo(torch.float64).eps


def float64_bound(steps: int, terms: int, scale: float) -> float:
    """A bound on the rounding between two float64 runs of the same arithmetic: each of ``steps``
    sequential steps computes values as sums of at most ``terms`` products of magnitude at most
    ``scale``; recursive summation errs by at most ``terms * eps`` relative to the sum of the
    magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, Sec. 4.2), and errors
    of successive steps add (at these learning rates a step does not amplify them by more than
    the slack of the worst-case bound, which exceeds typical rounding by orders of magnitude).
    Either side may round differently, hence the factor 2."""
    return 2 * steps * terms * EPS64 * max(1.0, scale)


def assert_close(ours: Dict[str, torch.Tensor], theirs: Dict[str, torch.Tensor], tol: float, what: str = "") -> float:
    """Every entry of ``theirs`` within ``tol`` of ours (shapes equal); returns the max difference."""
    worst = 0.0
    for key, value in theirs.items():
        assert ours[key].shape == value.shape, (what, key, tuple(ours[key].shape), tuple(value.shape))
        diff = float((ours[key].double() - value.double()).abs().max()) if value.numel() else 0.0
        assert diff < tol, f"{what} {key}: {diff:.3g} >= {tol:.3g}"
        worst = max(worst, diff)
    return worst


def pack(state: Dict[str, torch.Tensor]) -> dict:
    """A state dict as one flat float64 tensor plus its keys and shapes (a golden file stays
    small: torch.save spends about a kilobyte on every tensor); :func:`unpack` inverts it."""
    keys = list(state)
    return {"keys": keys, "shapes": [tuple(state[k].shape) for k in keys],
            "flat": torch.cat([state[k].detach().double().flatten() for k in keys]) if keys else torch.zeros(0)}


def unpack(packed: dict) -> Dict[str, torch.Tensor]:
    sizes = [int(torch.Size(s).numel()) for s in packed["shapes"]]
    parts = packed["flat"].split(sizes)
    return {k: p.reshape(s) for k, s, p in zip(packed["keys"], packed["shapes"], parts)}


EPS32 = torch.finfo(torch.float32).eps
CNN_TERMS = 32 * 8 * 8  # the CNN's longest sums of a step: a batch of 32 at 8x8 positions
VIT_TERMS = 32 * 5 * 32  # the one-block ViT's: a batch of 32, 5 tokens, its MLP width 32


def float32_bound(steps: int, terms: int, scale: float) -> float:
    """A bound on the rounding between two float32 runs of the same arithmetic (a case whose
    reference ran in float32): torch's CPU reductions sum in blocks and pairs, whose error is at
    most about ``ceil(log2 n) eps`` relative to the sum of the magnitudes (pairwise summation,
    Higham Sec. 4.2), rather than recursive summation's ``n eps``; each of ``steps`` sequential
    steps adds one such error on values of magnitude at most ``scale``, and either side may
    round differently (factor 2). The new float64 cases use ``float64_bound``; this one is for
    the float32 cases made before them."""
    return 2 * steps * math.ceil(math.log2(max(terms, 2))) * EPS32 * max(1.0, scale)


def keep_training_modules(alg) -> dict:
    """Wrap ``alg.new_client`` so that each client's training module is kept, keyed by
    ``(round, client)``, to read what it drew (widths, variants) after the run."""
    modules, new_client = {}, alg.new_client

    def keeping_modules(task, plan):
        client = new_client(task, plan)
        objective = client.objective

        def kept(downlink):
            modules[(plan.round_idx, task.client)] = objective(downlink)
            return modules[(plan.round_idx, task.client)]

        client.objective = kept
        return client

    alg.new_client = keeping_modules
    return modules
