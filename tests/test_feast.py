"""FEAST's server side: routing, sparse aggregation, evaluation, accounting (Algorithm 1)."""

from pathlib import Path

import pytest
import torch

from fl_lightning.algorithms import Feast
from fl_lightning.config import (BudgetConfig, DataConfig, EvalConfig, FederationConfig, LocalTrainConfig,
                                 PartitionConfig)
from fl_lightning.data import Synthetic
from fl_lightning.data.federated import build_federated_data
from fl_lightning.elastic.envelope import route_envelope
from fl_lightning.elastic.models.ofa_resnet import OFASpec
from fl_lightning.elastic.search.cache import VariantCache
from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.federation.builder import build_global_model
from fl_lightning.federation.loop import run_fit
from fl_lightning.runtime.seeding import sample_clients
from hand_counts import basic_pair_params, hooked_macs, make_divisible

MODEL = {"class_path": "fl_lightning.elastic.models.OFAResNet", "init_args": {"width_scale": 0.0625, "max_extra_blocks": 1, "divisor": 2}}
DATA = DataConfig(dataset=Synthetic(num_classes=4, image_size=16, num_train=400, num_test=80),
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

    return build_model(MODEL, 4, (3, 16, 16))


def feast_spec(spec_factory, tmp_path, name, budgets=None, **feast_args):
    cache = feast_args.pop("cache", None) or small_cache(tmp_path)
    return spec_factory(
        name=name, algorithm=Feast(cache=cache, mix_schedule="none", **feast_args), data=DATA, model=MODEL,
        # budgets across the cache (41K-175K MACs): clients afford 1, 1, 1, 4, 5 and 6 variants
        partition=PartitionConfig(method="iid", num_clients=6,
                                  budgets=budgets or BudgetConfig(b_min=5e4, b_max=2e5, b_cap=2e5)),
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
        for _, (key, region) in route_envelope(algorithm.ctx.model, algorithm.variants.specs_of(client)).regions.items():
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
        small = route_envelope(algorithm.ctx.model, algorithm.variants.specs_of(lo)).regions
        large = route_envelope(algorithm.ctx.model, algorithm.variants.specs_of(hi)).regions
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
    subnet = algorithm.variants.calibrated_subnet(variant)
    bn = next(m for m in subnet.modules() if isinstance(m, torch.nn.BatchNorm2d))
    inputs = []
    hook = bn.register_forward_hook(lambda module, args, out: inputs.append(args[0].detach()))
    subnet.eval()
    with torch.no_grad():
        for x in algorithm.variants.calibration.batches():
            subnet(x)
    hook.remove()
    assert len(inputs) == len(algorithm.variants.calibration.batches()) >= 1
    means = torch.stack([h.mean(dim=(0, 2, 3)) for h in inputs]).mean(0)
    variances = torch.stack([h.transpose(0, 1).flatten(1).var(dim=1, unbiased=True) for h in inputs]).mean(0)
    torch.testing.assert_close(bn.running_mean, means, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bn.running_var, variances, rtol=1e-4, atol=1e-5)
    again = algorithm.variants.calibrated_subnet(variant)
    for key, value in subnet.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    for key, value in algorithm.ctx.model.state_dict().items():
        assert torch.equal(value, before[key]), key


def envelope_counts(specs) -> tuple:
    """(parameters, BN channels, BN layers) of the routed envelope of ``specs`` (Supp. Eq. 12:
    coordinate-wise maximum depth and width, expansion 0.25) of MODEL, from its layer shapes:
    base channels 64 x 0.0625 = 4 (stem) and [8, 16, 32, 64], divisor 2, basic_pair blocks."""
    d = [max(s.d[l] for s in specs) for l in range(4)]
    w = [max(s.w[j] for s in specs) for j in range(5)]
    width = lambda base, j: make_divisible(base * round(0.1 * (w[j] + 1), 1), 2)  # noqa: E731
    stem, stages = width(4, 0), []
    for l, base in enumerate((8, 16, 32, 64)):
        out = width(base, l + 1)
        stages.append((out, make_divisible(out * 0.25, 2), 1 + d[l]))
    bn_channels = stem + sum(blocks * (mid + out) + out for out, mid, blocks in stages)
    bn_layers = 1 + sum(2 * blocks + 1 for _, _, blocks in stages)
    return basic_pair_params(stem, stages, 4), bn_channels, bn_layers


def test_run_reports_every_variant_and_accounting(spec_factory, tmp_path, capsys):
    """The saved accounting and the logged traffic, recomputed here from the budgets, the cache's
    MACs and the layer shapes with plain arithmetic (Supp. C Eq. 16, Supp. D Eq. 26)."""
    import json
    import statistics

    spec = feast_spec(spec_factory, tmp_path, "report")
    summary = run_fit(spec)
    out = capsys.readouterr().out
    algorithm = spec.algorithm
    cache, ctx = algorithm.cache, algorithm.ctx
    n = len(cache.specs)
    assert all(f"test_variant{j:02d}_acc" in summary["best"] for j in range(n))
    assert "population accuracy under largest-affordable serving" in out
    assert "traffic reduction" in out and "affordable variants" in out
    run = Path(spec.out_dir) / "report"
    saved = json.loads((run / "accounting.json").read_text())

    budgets, sizes = ctx.budgets.tolist(), ctx.client_sizes
    sets = [[j for j, m in enumerate(cache.macs) if m <= b] for b in budgets]  # Eq. 11
    counts = [len(s) for s in sets]
    population = saved["population"]
    assert (population["afford_1"], population["afford_2"], population["afford_3_or_more"]) == \
        (counts.count(1), counts.count(2), sum(c >= 3 for c in counts))
    assert len(set(counts)) > 1, "the test needs clients affording different sets"

    full = envelope_counts([ctx.model.max_spec()])[0]
    routed = [envelope_counts([cache.specs[j] for j in s])[0] for s in sets]
    comm = saved["communication"]
    assert comm["full_params"] == full
    assert comm["mean_routed_params"] == pytest.approx(sum(routed) / 6, rel=1e-12)
    assert comm["traffic_reduction"] == pytest.approx(6 * full / sum(routed), rel=1e-12)
    ratios = [full / p for p in routed]
    assert comm["client_reduction_mean"] == pytest.approx(sum(ratios) / 6, rel=1e-12)
    assert comm["client_reduction_median"] == pytest.approx(statistics.median(ratios), rel=1e-12)
    assert comm["client_reduction_max"] == pytest.approx(max(ratios), rel=1e-12)

    # Eq. 26: kappa_fb = 3, one epoch, each client in 1 round x 3 of 6 clients on average
    feast = single = 0.0
    for s, size in zip(sets, sizes):
        macs = [cache.macs[j] for j in s]
        low, high = cache.macs[0], macs[-1]
        middle = [m for m in macs if low < m < high]
        per_example = low if high == low else low + high + (sum(middle) / len(middle) if middle else 0)
        feast, single = feast + size * per_example, single + size * high
    compute = saved["computation"]
    assert compute["feast_train_macs"] == pytest.approx(3 * 0.5 * feast, rel=1e-12)
    assert compute["single_variant_train_macs"] == pytest.approx(3 * 0.5 * single, rel=1e-12)

    # Traffic logged per client: the routed envelope's float32 tensors (parameters and BN
    # running statistics) and one int64 batch counter per BN layer, both ways.
    rows = [json.loads(line) for line in (run / "clients.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        params, bn_channels, bn_layers = envelope_counts([cache.specs[j] for j in sets[row["client"]]])
        assert row["bytes_down"] == row["bytes_up"] == 4 * (params + 2 * bn_channels) + 8 * bn_layers


def test_client_without_affordable_variant_is_refused(spec_factory, tmp_path):
    from fl_lightning.errors import ConfigError

    spec = feast_spec(spec_factory, tmp_path, "poor", budgets=BudgetConfig(b_min=10.0, b_max=20.0, b_cap=20.0))
    with pytest.raises(ConfigError, match="affords no cached variant"):
        run_fit(spec)


def test_evaluate_and_extract_commands_on_a_finished_run(spec_factory, tmp_path, capsys):
    """A run long enough to learn the four synthetic classes (chance: 25%): the trained supernet
    classifies far above chance; ``evaluate`` re-scores the saved model; a subnet extracted
    under 0.1M MACs has its MACs and accuracy recounted here, and extraction at a cached
    variant's MACs returns that variant with the accuracy the run reported for it."""
    import json
    from dataclasses import replace

    from fl_lightning.cli import main
    from fl_lightning.elastic.models import build_model

    # provenance as build_cache writes it: each variant searched at its own MACs under ceiling 10
    cache = VariantCache.load(small_cache(tmp_path))
    cache = VariantCache([replace(v, info={"target": v.macs, "rho_limit": 10.0}) for v in cache.variants],
                         cache.input_shape, cache.num_classes, cache.model_options,
                         {"segments": [[cache.macs[0], cache.macs[-1], len(cache), 10.0]], "seed": 0})
    cache.save(tmp_path / "searched.json")
    spec = feast_spec(spec_factory, tmp_path, "done", cache=str(tmp_path / "searched.json"))
    spec = replace(spec, data=replace(DATA, dataset=Synthetic(**{**DATA.dataset.options(), "noise": 0.5})),
                   train=replace(spec.train, epochs=2), federation=FederationConfig(rounds=4, clients_per_round=3),
                   eval=EvalConfig(every=4, test="final"))
    spec.config_yaml = _config_yaml(spec)
    summary = run_fit(spec)
    assert summary["best"]["test_acc"] >= 0.5 and summary["best"]["test_mean_variant_acc"] >= 0.45
    run = str(Path(spec.out_dir) / "done")
    capsys.readouterr()
    assert main(["evaluate", "--run", run, "--fabric.accelerator", "cpu"]) == 0
    out = capsys.readouterr().out
    evaluated = json.loads(out[out.rindex("{\n"):])
    assert evaluated["test_acc"] == pytest.approx(summary["best"]["test_acc"])
    assert main(["extract", "--run", run, "--budget", "0.1M", "--rho", "10", "--population", "16",
                 "--generations", "5", "--out", str(tmp_path / "subnet.pt"), "--fabric.accelerator", "cpu"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.rindex("{\n"):])
    saved = load_checkpoint(tmp_path / "subnet.pt")
    spec_found = OFASpec(**saved["spec"])
    subnet = build_model(MODEL, 4, (3, 16, 16)).extract(spec_found).module
    subnet.load_state_dict(saved["model"])  # the saved weights are exactly that architecture's
    assert hooked_macs(subnet, (3, 16, 16))["paper"] == saved["macs"] == result["macs"] <= 0.1e6
    test = build_federated_data(spec.data, spec.partition, spec.seed).bundle.test
    x = torch.stack([test[i][0] for i in range(len(test))])
    y = torch.tensor([int(test[i][1]) for i in range(len(test))])
    with torch.no_grad():
        accuracy = (subnet.eval()(x).argmax(1) == y).float().mean().item()
    assert accuracy == pytest.approx(result["test_acc"])
    # at a cached variant's own MACs, with the default options, extract gives back that variant
    # and scores what the run served (the cache file below records each variant's target)
    j = len(cache.specs) - 1
    assert main(["extract", "--run", run, "--budget", str(cache.macs[j]), "--population", "16", "--generations", "5",
                 "--fabric.accelerator", "cpu"]) == 0
    out = capsys.readouterr().out
    served = json.loads(out[out.rindex("{\n"):])
    assert served["spec"] == str(cache.specs[j]) and not served["searched"] and served["genes_from_cache"] == 0
    assert served["test_acc"] == pytest.approx(summary["best"][f"test_variant{j:02d}_acc"], abs=1e-6)


def _config_yaml(spec) -> str:
    """The YAML a CLI run would have saved for this spec (evaluate and extract re-read it)."""
    from dataclasses import asdict

    import yaml

    algorithm = spec.algorithm
    init_args = {"cache": algorithm.cache_path, "routing": algorithm.routing, "mix_schedule": algorithm.mix_schedule}
    source = spec.data.source()
    data = {**asdict(spec.data), "dataset": {"class_path": f"fl_lightning.data.{type(source).__name__}",
                                              "init_args": source.options()}}
    return yaml.safe_dump({
        "name": spec.name, "out_dir": spec.out_dir, "seed": spec.seed, "data": data,
        "partition": asdict(spec.partition), "model": spec.model, "train": asdict(spec.train),
        "federation": asdict(spec.federation), "eval": asdict(spec.eval), "fabric": asdict(spec.fabric),
        "algorithm": {"class_path": "fl_lightning.algorithms.Feast", "init_args": init_args}})


def test_feast_on_two_ranks_matches_one_rank(spec_factory, tmp_path, fit_on_ranks):
    """FEAST adds nothing rank-specific: clients spread over 2 forked gloo ranks give the 1-rank
    model, with the quick start's training (full rule with in-place distillation, alternating
    Mixup/CutMix, two local epochs, routing) and every variant's BN recalibration."""
    from dataclasses import replace

    cache = small_cache(tmp_path)
    models = {}
    for name, devices, strategy in (("one", 1, "auto"), ("two", 2, "ddp_fork")):
        spec = feast_spec(spec_factory, tmp_path, name, cache=cache)
        spec = replace(spec, algorithm=Feast(cache=cache), train=replace(spec.train, epochs=2, lr_schedule="cosine"),
                       federation=FederationConfig(rounds=2, clients_per_round=4), eval=EvalConfig(every=2),
                       fabric=replace(spec.fabric, devices=devices, strategy=strategy))
        assert (spec.algorithm.rule, spec.algorithm.mix_schedule, spec.algorithm.routing) == ("full", "alternate", True)
        fit_on_ranks(spec)
        models[name] = load_checkpoint(Path(spec.out_dir) / name / "checkpoints" / "last.ckpt")["model"]
    a, b = models["one"], models["two"]
    assert a.keys() == b.keys()
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) <= 1e-5


def test_routed_but_untrained_positions_enter_the_denominator_of_eq_7(spec_factory, tmp_path):
    """Eq. 7 by hand: every position's new value is sum_i n_i theta_i[u] / sum_i n_i over the
    cohort clients whose routed envelope holds u, whether or not the client's variants
    activated u. With no weight decay a routed position a client never activated comes back
    with the value it was sent, and it still weighs in: the result is not the mean over the
    clients that trained it."""
    from fl_lightning.elastic.regions import LeadingSlice

    class Recording(Feast):
        def plan(self, round_idx):
            self.before = {k: v.detach().clone() for k, v in self.global_state.items()}
            self.returned = []
            return super().plan(round_idx)

        def commit(self, acc, task, result, plan):
            local = result.model.module.state_dict()
            self.returned.append((float(result.num_samples), {
                global_key: (region, local[local_key].detach().to(torch.float64).clone())
                for local_key, (global_key, region) in result.model.regions.items()}))
            super().commit(acc, task, result, plan)

    spec = feast_spec(spec_factory, tmp_path, "eq7")
    spec.algorithm = Recording(cache=small_cache(tmp_path), mix_schedule="none")
    spec.train = LocalTrainConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9, weight_decay=0.0, grad_clip=10.0)
    spec.federation = FederationConfig(rounds=1, clients_per_round=6)  # budgets afford 1, 1, 1, 4, 5, 6 variants
    run_fit(spec)
    algorithm = spec.algorithm
    before = {k: v.to(torch.float64) for k, v in algorithm.before.items() if v.is_floating_point()}
    after = load_checkpoint(Path(spec.out_dir) / spec.name / "checkpoints" / "last.ckpt")["model"]
    assert len(algorithm.returned) == 6
    checked = differ = 0
    for key, old in before.items():
        num, den = torch.zeros_like(old), torch.zeros_like(old)
        trained_num, trained_den = torch.zeros_like(old), torch.zeros_like(old)
        for n, values in algorithm.returned:
            if key not in values:
                continue
            region, value = values[key]
            assert isinstance(region, LeadingSlice)  # routing copies leading slices
            box = tuple(slice(0, size) for size in value.shape)
            num[box] += n * value
            den[box] += n
            trained = value != old[box]
            trained_num[box] += torch.where(trained, n * value, torch.zeros_like(value))
            trained_den[box] += torch.where(trained, torch.full_like(value, n), torch.zeros_like(value))
        expected = torch.where(den > 0, num / den.clamp_min(1e-300), old)
        # one float32 rounding of the float64 quotient (sums of six terms in another order)
        torch.testing.assert_close(after[key].to(torch.float64), expected, rtol=2 ** -23, atol=1e-30, msg=key)
        # positions trained by some client and returned untouched by another routing client
        mixed = (trained_den > 0) & (trained_den < den)
        if mixed.any():
            trainers_only = trained_num[mixed] / trained_den[mixed]
            apart = (after[key].to(torch.float64)[mixed] - trainers_only).abs() > 1e-4 * trainers_only.abs()
            checked, differ = checked + int(mixed.sum()), differ + int(apart.sum())
    assert checked > 1000, "the test needs routed positions that some routing clients did not train"
    assert differ > 0.9 * checked  # a trainers-only denominator would give another model


@pytest.mark.parametrize("rule", ["max_only", "full"])
def test_trained_and_routed_data_mass_per_round(spec_factory, tmp_path, rule):
    """The logged share of routed data mass that the clients trained. With the max-only rule
    a client trains exactly its largest affordable variant, so the share is
    sum_i n_i P(max_i) / sum_i n_i P_i with both counts taken from the extracted networks;
    the full rule also trains the minimum and intermediates, all inside the envelope."""
    import json

    from fl_lightning.elastic.envelope import routed_param_count
    from fl_lightning.elastic.macs import count_params

    spec = feast_spec(spec_factory, tmp_path, f"mass_{rule}", rule=rule)
    spec.federation = FederationConfig(rounds=2, clients_per_round=6)  # budgets afford 1, 1, 1, 4, 5, 6 variants
    run_fit(spec)
    algorithm = spec.algorithm
    rows = [json.loads(line) for line in (Path(spec.out_dir) / spec.name / "metrics.jsonl").read_text().splitlines()]
    model, sizes = algorithm.ctx.model, algorithm.ctx.client_sizes
    routed = sum(sizes[c] * routed_param_count(model, algorithm.variants.specs_of(c)) for c in range(6))
    largest = sum(sizes[c] * count_params(model.extract(algorithm.variants.specs_of(c)[-1]).module) for c in range(6))
    assert largest < routed, "the test needs envelopes larger than their largest variant"
    for row in rows:
        share = row["mass/trained_frac"]
        if rule == "max_only":
            assert share == pytest.approx(largest / routed, rel=1e-12)
        else:
            assert largest / routed < share <= 1.0
        assert {k for k in row if k.startswith("mass/trained_frac/")} >= {"mass/trained_frac/stem",
                                                                          "mass/trained_frac/classifier"}


@pytest.mark.parametrize("routing", [True, False])
def test_only_routing_free_feast_builds_a_worker(spec_factory, tmp_path, routing):
    """With routing every client trains its routed envelope, so no whole-supernet worker is
    built (at paper scale it held 55.7M parameters for nothing); without routing the worker is
    where clients train."""
    from fl_lightning.federation.builder import build_context, make_fabric

    spec = feast_spec(spec_factory, tmp_path, f"worker_{routing}", routing=routing)
    build_context(spec, make_fabric(spec.fabric))
    assert hasattr(spec.algorithm, "worker") == (not routing)
