"""The tiny two-round case of the SuperFedNAS / DeepFedNAS golden values (``tools/reference/
superfednas.py``, ``tools/reference/deepfednas.py``, ``tests/test_reference_fednas.py``).

Our side: the project's transfer (``algorithms/supernet/fednas.py``, unconstrained) on a narrowed
``ofa_resnet`` built to be the same network as the reference's supernet, synthetic 3 x 8 x 8
images of 4 classes, 3 clients all in every round (so both sides' cohort is every client, in
id order), two rounds of one local epoch of batches of 8, plain SGD (no momentum, weight decay,
gradient clipping) and no Mixup/CutMix (the originals' client: cross-entropy on the batch).
:func:`run_case` runs the rounds through the federation loop and records what the reference
needs (initial model, each client's batches, architectures, MaxNet weights) and what is compared
(each client's trained subnet, the global model after each round, the tracking counts).
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Dict

import torch

from fl_lightning.config import (BudgetConfig, DataConfig, EvalConfig, FabricConfig, FederationConfig,
                                 LocalTrainConfig, PartitionConfig)
from fl_lightning.data import Synthetic
from fl_lightning.federation.builder import RunSpec

from reference_case import BatchRecorder, federation, shard_key

NUM_CLASSES = 4
INPUT = (3, 8, 8)
ROUNDS, CLIENTS = 2, 3
MAXNET_STEPS = 4
"""Anneal length of both sides' MaxNet coefficient: c(0) = 0.9, c(1) = 0.125 + 0.775 (1 + cos(pi/4)) / 2."""
TRAIN = LocalTrainConfig(epochs=1, batch_size=8, lr=0.05, momentum=0.0, weight_decay=5e-4, grad_clip=3.0)
DATA = DataConfig(dataset=Synthetic(num_classes=NUM_CLASSES, image_size=8, num_train=80,
                                    num_test=16), val_size=4, calib_size=4)
BUDGETS = BudgetConfig(b_min=1e9, b_max=2e9, b_cap=2e9)  # every client affords every architecture

# SuperFedNAS's ResNet-10-26 supernet (``OFAResNets32x32_10_26``) with two stages of base widths
# 80 and 96, width multipliers 0.125 and 0.25, channel divisor 4: stem 8 / 16, stage widths
# 12 / 20 and 12 / 24, up to two extra blocks per stage, middle widths round(out * e).
SFN_MODEL = {"class_path": "fl_lightning.elastic.models.OFAResNet", "init_args": {
    "stem_channels": 64, "stage_channels": [80, 96], "width_multipliers": [0.125, 0.25], "max_extra_blocks": 2,
    "divisor": 4, "round_middle": True}}
# DeepFedNAS's ``GenericOFAResNet`` with two stages: stem 8, stage widths 16 and 40, width
# multipliers 0.5 and 1.0, channel divisor 8, one extra block per stage, both stages strided.
DFN_MODEL = {"class_path": "fl_lightning.elastic.models.OFAResNet", "init_args": {
    "stem_channels": 8, "stage_channels": [16, 40], "width_multipliers": [0.5, 1.0], "max_extra_blocks": 1,
    "divisor": 8, "stage_strides": [2, 2], "round_middle": True}}


def build_model(method: str):
    from fl_lightning.elastic.models import build_model as build

    return build(SFN_MODEL if method == "superfednas" else DFN_MODEL, NUM_CLASSES, INPUT)


def algorithm(method: str, out_dir: Path, frozen_bn: bool = False):
    """Our transfer, unconstrained, evaluated on a two-variant cache (evaluation is not part of
    the case); ``frozen_bn``: the originals' client without ``--use_bn``."""
    from fl_lightning.algorithms.supernet.fednas import DeepFedNAS, PathSearch, SuperFedNAS
    from fl_lightning.elastic.search.cache import VariantCache

    model = build_model(method)
    cache = out_dir / "cache.json"
    VariantCache.from_specs(model, [model.min_spec(), model.max_spec()]).save(cache)
    common = dict(cache=str(cache), mix_schedule="none", maxnet_steps=MAXNET_STEPS, frozen_bn=frozen_bn)
    if method == "superfednas":
        return SuperFedNAS(**common)
    # the Pareto path over the complete (tiny) supernet, searched cheaply; the narrowed
    # supernet's effectiveness is above FEAST's ceilings, hence rho 1
    return DeepFedNAS(path=PathSearch(targets=6, population=16, generations=8, rho=1.0), **common)


def make_spec(method: str, out_dir, alg=None) -> RunSpec:
    out_dir = Path(out_dir)
    return RunSpec(
        name=method, out_dir=str(out_dir), seed=0, algorithm=alg or algorithm(method, out_dir), data=DATA,
        partition=PartitionConfig(method="iid", num_clients=CLIENTS, budgets=BUDGETS),
        model=SFN_MODEL if method == "superfednas" else DFN_MODEL, train=TRAIN,
        federation=FederationConfig(rounds=ROUNDS, clients_per_round=CLIENTS), eval=EvalConfig(every=ROUNDS),
        fabric=FabricConfig(accelerator="cpu", devices=1, threads_per_rank=1))


def spec_dict(spec) -> dict:
    return {"d": list(spec.d), "e": list(spec.e), "w": list(spec.w)}


def run_case(method: str, out_dir=None, alg=None, frozen_bn: bool = False) -> dict:
    """Our two rounds. ``alg``: an already built algorithm (a test perturbs one); ``frozen_bn``:
    batch norm held at the identity (the originals' default client)."""
    out_dir = Path(out_dir or tempfile.mkdtemp())
    spec = make_spec(method, out_dir, alg or algorithm(method, out_dir, frozen_bn))
    fed = federation(spec)
    alg, ctx = fed.algorithm, fed.ctx
    initial = {k: v.clone() for k, v in alg.global_state.items()}
    local_states: Dict[tuple, Dict[str, torch.Tensor]] = {}
    commit = alg.commit

    def recording_commit(acc, task, result, plan):
        local_states[(plan.round_idx, task.client)] = {
            k: v.detach().clone() for k, v in result.model.module.state_dict().items()}
        commit(acc, task, result, plan)

    alg.commit = recording_commit
    keys = {shard_key(ctx.shards[c]): c for c in range(ctx.num_clients)}
    rounds, batches, globals_ = [], {}, []
    for r in range(ROUNDS):
        plan = alg.plan(r)
        rounds.append({
            "cohort": list(plan.cohort), "lr": plan.lr, "coefficient": alg.coefficient(r),
            "tasks": [{"client": t.client, "role": t.choice.role, "spec": spec_dict(t.spec),
                       "maxnet_weight": t.choice.maxnet_weight} for t in plan.tasks]})
        recorder = BatchRecorder()
        with recorder.recording():
            fed.run_round(r)
        for key, size, x, y in recorder.batches:
            assert size == TRAIN.batch_size
            batches.setdefault((r, keys[key]), []).append((x, y))
        globals_.append({k: v.clone() for k, v in alg.global_state.items()})
    model = build_model(method)  # the initial supernet, for the reference's function check
    model.load_state_dict(initial)
    out = {"initial": initial, "rounds": rounds, "batches": batches, "locals": local_states, "globals": globals_,
           "tracking": {"largest": alg.largest.tolist(), "smallest": alg.smallest.tolist()},
           "model": model, "algorithm": alg, "frozen_bn": bool(alg.frozen_bn)}
    if method == "deepfednas":
        out["path"] = [spec_dict(s) for s in alg.path.specs]
        out["path_macs"] = [int(m) for m in alg.path.macs]
    return out


# -- fingerprints (the golden files keep these instead of the tensors themselves) ---------------
def fingerprint(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def state_fingerprint(state: Dict[str, torch.Tensor]) -> Dict[str, str]:
    return {k: fingerprint(v) for k, v in state.items()}


def batch_fingerprints(batches) -> Dict[tuple, list]:
    return {key: [(fingerprint(x), fingerprint(y)) for x, y in value] for key, value in batches.items()}


def float_state(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items() if v.is_floating_point()}


# -- our state-dict names <-> the references' --------------------------------------------------
def to_reference_key(key: str, blocks_per_stage: int, supernet: bool, block_index=None) -> str:
    """Our name of a tensor as the reference names it: in its supernet (``supernet``: block
    ``stage * blocks_per_stage + b``, OFA's dynamic layers' doubled names) or in one of its
    extracted subnets (``block_index[(stage, b)]``: the subnet's running block number)."""
    parts = key.split(".")
    dyn = ".conv" if supernet else ""
    bn = ".bn" if supernet else ""
    if parts[0] == "stem":
        layer, name = parts[1], parts[2]
        return f"input_stem.0.conv{dyn}.{name}" if layer == "conv" else f"input_stem.0.bn{bn}.{name}"
    if parts[0] == "classifier":
        return f"classifier.linear{'.linear' if supernet else ''}.{parts[1]}"
    assert parts[0] == "stages", key
    stage, b = int(parts[1]), int(parts[2])
    index = stage * blocks_per_stage + b if supernet else block_index[(stage, b)]
    rest = parts[3:]
    if rest[0] == "shortcut":
        layer, name = rest[1], rest[2]
        inner = f"conv{dyn}" if layer == "conv" else f"bn{bn}"
        return f"blocks.{index}.downsample.{inner}.{name}"
    layer, name = rest[0], rest[1]
    conv = {"conv1": "conv1", "bn1": "conv1", "conv2": "conv2", "bn2": "conv2"}[layer]
    inner = f"conv{dyn}" if layer.startswith("conv") else f"bn{bn}"
    return f"blocks.{index}.{conv}.{inner}.{name}"


def subnet_block_index(local_keys) -> Dict[tuple, int]:
    """(stage, block) -> running block number of a subnet from its (our) key names."""
    pairs = sorted({(int(k.split(".")[1]), int(k.split(".")[2])) for k in local_keys if k.startswith("stages.")})
    return {pair: i for i, pair in enumerate(pairs)}
