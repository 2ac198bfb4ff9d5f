"""FEAST's server side: routing, sparse aggregation, evaluation, accounting (Algorithm 1)."""

from pathlib import Path

import pytest
import torch

from fl_lightning.algorithms import Feast
from fl_lightning.config import (BudgetConfig, DataConfig, EvalConfig, FederationConfig, LocalTrainConfig,
                                 ModelConfig, PartitionConfig)
from fl_lightning.data.federated import build_federated_data
from fl_lightning.elastic.envelope import route_envelope
from fl_lightning.elastic.search.cache import VariantCache
from fl_lightning.federation.checkpoint import load_checkpoint
from fl_lightning.federation.builder import build_global_model
from fl_lightning.federation.loop import run_fit
from fl_lightning.runtime.seeding import sample_clients

MODEL = ModelConfig(name="ofa_resnet", kwargs={"width_scale": 0.0625, "max_extra_blocks": 1, "divisor": 2})
DATA = DataConfig(name="synthetic", options={"num_classes": 4, "image_size": 16, "num_train": 400, "num_test": 80},
                  val_size=40, calib_size=32)



def small_cache(tmp_path, include_max=False) -> str:
    model = build_global_model_for_cache()
    g = torch.Generator().manual_seed(3)
    specs = {model.min_spec()} | {model.sample_spec(g) for _ in range(5)}
    if include_max:
        specs.add(model.max_spec())
    cache = VariantCache.from_specs(model, sorted(specs, key=str))
    path = tmp_path / "cache.json"
    cache.save(path)
    return str(path)


def build_global_model_for_cache():
    from fl_lightning.elastic.models import build_model

    return build_model("ofa_resnet", 4, (3, 16, 16), **MODEL.kwargs)


def feast_spec(spec_factory, tmp_path, name, budgets=None, **feast_args):
    cache = feast_args.pop("cache", None) or small_cache(tmp_path)
    return spec_factory(
        name=name, algorithm=Feast(cache=cache, mix_schedule="none", **feast_args), data=DATA, model=MODEL,
        partition=PartitionConfig(method="iid", num_clients=6, budgets=budgets or BudgetConfig(b_min=1e5, b_max=3e6, b_cap=2e6)),
        train=LocalTrainConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-4, grad_clip=10.0),
        federation=FederationConfig(rounds=1, clients_per_round=3), eval=EvalConfig(every=1, test="final"))


def test_only_routed_positions_are_aggregated(spec_factory, tmp_path):
    spec = feast_spec(spec_factory, tmp_path, "sparse")
    run_fit(spec)
    algorithm = spec.algorithm
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    before = build_global_model(spec, fed).state_dict()
    after = load_checkpoint(Path(spec.out_dir) / spec.name / "checkpoints" / "last.ckpt")["model"]
    covered = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in before.items() if v.is_floating_point()}
    for client in sample_clients(spec.seed, 0, 6, 3):
        for _, (key, region) in route_envelope(algorithm.ctx.model, algorithm.variants_of(client)).regions.items():
            if key in covered:
                region.fill_add(covered[key], 1.0)
    assert any((c == 0).any() for c in covered.values()), "the test needs some unrouted positions"
    for key, mask in covered.items():
        untouched = mask == 0
        assert torch.equal(after[key][untouched], before[key][untouched]), key
    conv = "stem.conv.weight"
    assert not torch.equal(after[conv][covered[conv] > 0], before[conv][covered[conv] > 0])


def test_routing_on_and_off_agree_when_everyone_affords_everything(spec_factory, tmp_path):
    cache = small_cache(tmp_path, include_max=True)
    rich = BudgetConfig(b_min=1e12, b_max=2e12, b_cap=1e12)
    on = feast_spec(spec_factory, tmp_path, "on", budgets=rich, cache=cache, routing=True)
    off = feast_spec(spec_factory, tmp_path, "off", budgets=rich, cache=cache, routing=False)
    run_fit(on)
    run_fit(off)
    a = load_checkpoint(Path(on.out_dir) / "on" / "checkpoints" / "last.ckpt")["model"]
    b = load_checkpoint(Path(off.out_dir) / "off" / "checkpoints" / "last.ckpt")["model"]
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


def test_nested_affordability_and_routing(spec_factory, tmp_path):
    """Proposition 1: b_i <= b_j implies A_i within A_j and U_i within U_j."""
    spec = feast_spec(spec_factory, tmp_path, "nested")
    run_fit(spec)
    algorithm = spec.algorithm
    budgets = algorithm.ctx.budgets.tolist()
    order = sorted(range(len(budgets)), key=lambda i: budgets[i])
    for lo, hi in zip(order, order[1:]):
        assert set(algorithm.sets[lo]) <= set(algorithm.sets[hi])
        small = route_envelope(algorithm.ctx.model, algorithm.variants_of(lo)).regions
        large = route_envelope(algorithm.ctx.model, algorithm.variants_of(hi)).regions
        for key, (_, region) in small.items():
            assert large[key][1].contains(region), key
    assert all(algorithm.cache.global_min() in s for s in algorithm.sets)


def test_bn_recalibration_matches_an_independent_estimate(spec_factory, tmp_path):
    """After recalibration the first BN layer's running mean and variance are the average over
    the fixed calibration batches of its input's per-batch mean and unbiased variance (BN with
    momentum None), computed here from that layer's inputs; weights are untouched."""
    spec = feast_spec(spec_factory, tmp_path, "bn")
    run_fit(spec)
    algorithm = spec.algorithm
    before = {k: v.clone() for k, v in algorithm.ctx.model.state_dict().items()}
    variant = algorithm.cache.specs[-1]
    subnet = algorithm.calibrated_subnet(variant)
    bn = next(m for m in subnet.modules() if isinstance(m, torch.nn.BatchNorm2d))
    inputs = []
    hook = bn.register_forward_hook(lambda module, args, out: inputs.append(args[0].detach()))
    subnet.eval()
    with torch.no_grad():
        for x in algorithm.calibration_batches():
            subnet(x)
    hook.remove()
    assert len(inputs) == len(algorithm.calibration_batches()) >= 1
    means = torch.stack([h.mean(dim=(0, 2, 3)) for h in inputs]).mean(0)
    variances = torch.stack([h.transpose(0, 1).flatten(1).var(dim=1, unbiased=True) for h in inputs]).mean(0)
    torch.testing.assert_close(bn.running_mean, means, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bn.running_var, variances, rtol=1e-4, atol=1e-5)
    again = algorithm.calibrated_subnet(variant)
    for key, value in subnet.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    for key, value in algorithm.ctx.model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_run_reports_every_variant_and_accounting(spec_factory, tmp_path, capsys):
    spec = feast_spec(spec_factory, tmp_path, "report")
    summary = run_fit(spec)
    out = capsys.readouterr().out
    n = len(spec.algorithm.cache.specs)
    assert all(f"test_variant{j:02d}_acc" in summary["best"] for j in range(n))
    assert "population accuracy under largest-affordable serving" in out
    assert "traffic reduction" in out and "affordable variants" in out
    assert (Path(spec.out_dir) / "report" / "accounting.json").is_file()


def test_client_without_affordable_variant_is_refused(spec_factory, tmp_path):
    from fl_lightning.errors import ConfigError

    spec = feast_spec(spec_factory, tmp_path, "poor", budgets=BudgetConfig(b_min=10.0, b_max=20.0, b_cap=20.0))
    with pytest.raises(ConfigError, match="affords no cached variant"):
        run_fit(spec)


def test_evaluate_and_extract_commands_on_a_finished_run(spec_factory, tmp_path, capsys):
    import json

    from fl_lightning.cli import main

    spec = feast_spec(spec_factory, tmp_path, "done")
    spec.config_yaml = _config_yaml(spec)
    summary = run_fit(spec)
    run = str(Path(spec.out_dir) / "done")
    capsys.readouterr()
    assert main(["evaluate", "--run", run, "--fabric.accelerator", "cpu"]) == 0
    out = capsys.readouterr().out
    evaluated = json.loads(out[out.rindex("{\n"):])
    assert evaluated["test_acc"] == pytest.approx(summary["best"]["test_acc"])
    assert main(["extract", "--run", run, "--budget", "0.5M", "--rho", "10", "--population", "16",
                 "--generations", "5", "--out", str(tmp_path / "subnet.pt"), "--fabric.accelerator", "cpu"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.rindex("{\n"):])
    assert result["macs"] <= 0.5e6 and 0 <= result["test_acc"] <= 1
    saved = load_checkpoint(tmp_path / "subnet.pt")
    assert saved["macs"] == result["macs"] and "stem.conv.weight" in saved["model"]
    assert summary["best"]["test_acc"] >= 0


def _config_yaml(spec) -> str:
    """The YAML a CLI run would have saved for this spec (evaluate and extract re-read it)."""
    from dataclasses import asdict

    import yaml

    algorithm = spec.algorithm
    init_args = {"cache": algorithm.cache_path, "routing": algorithm.routing, "mix_schedule": algorithm.mix_schedule}
    return yaml.safe_dump({
        "name": spec.name, "out_dir": spec.out_dir, "seed": spec.seed, "data": asdict(spec.data),
        "partition": asdict(spec.partition), "model": asdict(spec.model), "train": asdict(spec.train),
        "federation": asdict(spec.federation), "eval": asdict(spec.eval), "fabric": asdict(spec.fabric),
        "algorithm": {"class_path": "fl_lightning.algorithms.Feast", "init_args": init_args}})


def test_feast_on_two_ranks_matches_one_rank(tmp_path):
    """FEAST adds nothing rank-specific: clients spread over 2 gloo ranks give the 1-rank model."""
    import os
    import subprocess
    import sys

    common = [sys.executable, "-m", "fl_lightning", "fit", "--config", "configs/quickstart.yaml",
              "--federation.rounds", "2", "--federation.clients_per_round", "4", "--eval.every", "2",
              "--fabric.threads_per_rank", "1", "--out_dir", str(tmp_path)]
    root = Path(__file__).parents[1]
    for name, extra in (("one", []), ("two", ["--fabric.devices", "2", "--fabric.strategy", "ddp"])):
        done = subprocess.run(common + ["--name", name] + extra, cwd=root, capture_output=True, text=True,
                              timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))
        assert done.returncode == 0, done.stderr[-3000:]
    a = load_checkpoint(tmp_path / "one" / "checkpoints" / "last.ckpt")["model"]
    b = load_checkpoint(tmp_path / "two" / "checkpoints" / "last.ckpt")["model"]
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) <= 1e-5
