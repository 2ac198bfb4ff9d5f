"""Exact resume of FEAST and its baselines (FIARSE, HeteroFL's budget tiers, ScaleFL) and of
MergeSFL: a run stopped after round 2 and resumed from its checkpoint ends with the same model
and algorithm state, bit for bit, as the run that was never interrupted."""

from pathlib import Path

import pytest
import torch

from fl_lightning.algorithms import Feast, HeteroFL
from fl_lightning.algorithms.supernet.fiarse import FIARSE
from fl_lightning.algorithms.split.mergesfl import MergeSFL
from fl_lightning.algorithms.supernet.scalefl import ScaleFL
from fl_lightning.config import (BudgetConfig, DataConfig, EvalConfig, FederationConfig, LocalTrainConfig,
                                 PartitionConfig)
from fl_lightning.data import Digits, Synthetic
from fl_lightning.elastic.models import build_model
from fl_lightning.elastic.search.cache import VariantCache
from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.federation.loop import run_fit

ROUNDS, STOP = 3, 2
# three local steps a client (not an epoch): what a resume must restore is the same after any
# number of steps, and the round still moves the model (the last assertion)
TRAIN = LocalTrainConfig(steps=3, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-4, grad_clip=10.0)
DIGITS = DataConfig(dataset=Digits(), val_size=100, calib_size=64)
OFA = {"class_path": "fl_lightning.elastic.models.OFAResNet", "init_args": {"width_scale": 0.0625, "max_extra_blocks": 1, "divisor": 2}}
SYNTHETIC = DataConfig(dataset=Synthetic(num_classes=4, image_size=16, num_train=400, num_test=80),
                       val_size=40, calib_size=32)


def feast_cache(tmp_path) -> str:
    model = build_model(OFA, 4, (3, 16, 16))
    g = torch.Generator().manual_seed(3)
    specs = {model.min_spec()} | {model.sample_spec(g) for _ in range(5)}
    path = tmp_path / "cache.json"
    VariantCache.from_specs(model, sorted(specs, key=str)).save(path)
    return str(path)


def method_sections(method, tmp_path):
    """(algorithm factory, sections) of a small federation for each method."""
    fed = FederationConfig(rounds=ROUNDS, clients_per_round=3)
    if method == "feast":  # budgets across the cache: clients afford 1 to 6 variants
        cache = feast_cache(tmp_path)
        return (lambda: Feast(cache=cache, mix_schedule="alternate"),
                dict(data=SYNTHETIC, model=OFA, train=TRAIN, federation=fed,
                     partition=PartitionConfig(method="iid", num_clients=6,
                                               budgets=BudgetConfig(b_min=5e4, b_max=2e5, b_cap=2e5))))
    if method == "fiarse":
        return (lambda: FIARSE(mix_schedule="alternate"),
                dict(data=DIGITS, train=TRAIN, federation=fed,
                     partition=PartitionConfig(method="dirichlet", num_clients=6, alpha=0.5,
                                               budgets=BudgetConfig(b_min=1e5, b_max=7e5))))
    if method == "heterofl_tiers":  # budgets 2K-200K MACs: every tier, one client below the smallest
        return (lambda: HeteroFL(assign="budget", bn="sbn", scaler=True, mix_schedule="alternate"),
                dict(data=DIGITS, model={"class_path": "fl_lightning.elastic.models.ResNet18", "init_args": {"width": 0.125}}, train=TRAIN,
                     federation=FederationConfig(rounds=ROUNDS, clients_per_round=4),
                     partition=PartitionConfig(method="iid", num_clients=8,
                                               budgets=BudgetConfig(b_min=2e3, b_max=2e5))))
    if method == "scalefl":  # budgets 20K-929K MACs: levels 1-4 and one fallback
        return (lambda: ScaleFL(),
                dict(data=DIGITS, model={"class_path": "fl_lightning.elastic.models.ScaleFLResNet18", "init_args": {"width": 0.125}},
                     train=TRAIN, federation=fed,
                     partition=PartitionConfig(method="iid", num_clients=8,
                                               budgets=BudgetConfig(b_min=2e4, b_max=1e6))))
    if method == "mergesfl":
        return (lambda: MergeSFL(cut="layer2.0"),
                dict(model={"class_path": "fl_lightning.elastic.models.ResNet18", "init_args": {"width": 0.125}},
                     train=LocalTrainConfig(steps=3, batch_size=8, lr=0.05, momentum=0.9), federation=fed))
    raise ValueError(method)


def saved(spec):
    return load_checkpoint(Path(spec.out_dir) / spec.name / "checkpoints" / "last.ckpt")


@pytest.mark.parametrize("method", ["feast", "fiarse", "heterofl_tiers", "scalefl", "mergesfl"])
def test_resume_is_bit_exact(spec_factory, tmp_path, method):
    algorithm, sections = method_sections(method, tmp_path)
    sections["eval"] = EvalConfig(every=1, test="final")

    def make(name):
        return spec_factory(name=name, algorithm=algorithm(), **sections)

    whole = make("whole")
    run_fit(whole)
    part = make("part")
    part.stop_after = STOP
    run_fit(part)
    stopped = saved(part)
    assert int(stopped["round"]) == STOP
    resumed = make("part")
    resumed.resume_from = str(Path(part.out_dir) / "part" / "checkpoints" / "last.ckpt")
    run_fit(resumed)
    a, b = saved(whole), saved(resumed)
    assert int(b["round"]) == ROUNDS
    for section in ("model", "algorithm"):
        assert a[section].keys() == b[section].keys(), section
        for key, value in a[section].items():
            assert torch.equal(value, b[section][key]), (section, key)
    # the last round changed the model: the comparison is not between two copies of round 2
    assert any(not torch.equal(v, stopped["model"][k]) for k, v in a["model"].items() if v.is_floating_point())
