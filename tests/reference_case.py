"""The tiny one-round case on which golden values were taken from the reference
implementations (``tools/reference/``), and the recorder of the batches a run feeds.

Both sides see the same thing: the narrow CNN on digits built from seed 0 (its initial state
is stored beside the golden values), one round, and the exact mini-batches our loop drew for
each client (recorded here and replayed into the reference code by the adapter).
"""

from __future__ import annotations

import contextlib
import hashlib
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
              data: Optional[DataConfig] = None) -> RunSpec:
    """Digits, ``num_clients`` clients (Dirichlet 0.5 unless ``partition``), a CNN of 4 and 8
    channels, one round of ``clients_per_round`` clients, one CPU rank."""
    return RunSpec(
        name="ref", out_dir=str(out_dir), seed=0, algorithm=algorithm,
        data=data or DataConfig(dataset=Digits(), val_size=100),
        partition=PartitionConfig(method=partition, num_clients=num_clients, alpha=0.5),
        model=model or {"class_path": "fl_lightning.elastic.models.CNN", "init_args": {"channels": [4, 8]}},
        train=train,
        federation=FederationConfig(rounds=1, clients_per_round=clients_per_round),
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
