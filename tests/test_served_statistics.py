"""Where served models get their BN statistics (algorithms/bn_protocol.py, docs/served_statistics.md):
every protocol checked against statistics computed here, from the examples it must describe."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fl_lightning.algorithms import FedAvg, FjORD, SplitFed, Uniform
from fl_lightning.config import DataConfig, EvalConfig, FederationConfig, LocalTrainConfig, PartitionConfig
from fl_lightning.data import Digits
from fl_lightning.elastic.aggregation import SparseAccumulator
from fl_lightning.elastic.bn import batch_moments, statistics_keys
from fl_lightning.elastic.routing import full_region_map
from fl_lightning.federation.loop import run_fit
from fl_lightning.runtime.seeding import sample_clients

RESNET = {"class_path": "fl_lightning.elastic.models.ResNet18", "init_args": {"width": 0.125}}
DATA = DataConfig(dataset=Digits(), val_size=100, calib_size=64)
ONE_BATCH = 100_000  # a statistics pass in one batch: its statistics are those of the whole set


def population_moments(model: nn.Module, images: torch.Tensor) -> dict:
    """Mean and unbiased variance of every BN layer's input when ``images`` pass through a
    float64 copy of ``model`` in one batch, each BN normalizing with that batch's statistics:
    what a one-batch statistics pass must store, computed from the captured inputs."""
    twin = copy.deepcopy(model).double().eval()
    inputs = {}
    for name, module in twin.named_modules():
        if isinstance(module, _BatchNorm):
            module.train()
            module.track_running_stats = False  # batch statistics, nothing stored
            module.register_forward_pre_hook(lambda mod, args, name=name: inputs.__setitem__(name, args[0]))
    with torch.no_grad():
        twin(images.double())
    out = {}
    for name, x in inputs.items():
        flat = x.transpose(0, 1).flatten(1)
        out[name] = (flat.mean(1), flat.var(1, unbiased=True))
    return out


def assert_statistics(model: nn.Module, expected: dict) -> None:
    # The pass runs in float32: per-channel sums over ~10^4-10^5 values (relative error about
    # eps32 * log2(n) ~ 1e-6) of activations that carry float32 rounding through at most a few
    # conv layers (~1e-6 relative each); 1e-4 relative leaves a margin of ten. Statistics of
    # the wrong examples or of another width are off by more than 1e-2.
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            mean, var = expected[name]
            torch.testing.assert_close(module.running_mean.double(), mean, rtol=1e-4, atol=1e-5, msg=name)
            torch.testing.assert_close(module.running_var.double(), var, rtol=1e-4, atol=1e-5, msg=name)


def client_images(fed) -> torch.Tensor:
    return fed.bundle.train_eval.data[torch.cat(list(fed.clients))]


# -- sub-model policies ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bn,data", [("sbn", "train"), ("sbn", "calib"), ("recalibrate", "calib")])
def test_a_served_sub_model_has_the_statistics_of_a_full_width_pass(spec_factory, bn, data):
    """Uniform (widths 0.25-0.5, so no client trains the full width): the served global model's
    every BN holds the mean and variance of a full-width pass over exactly the chosen examples;
    under sBN no client tracked or sent statistics."""
    algorithm = Uniform(caps=[1.0, 0.5, 0.25, 0.5, 1.0, 0.25], bn=bn, sbn_data=data, calib_batch_size=ONE_BATCH,
                        calib_transform="eval")
    spec = spec_factory(name=f"{bn}_{data}", algorithm=algorithm, data=DATA,
                        federation=FederationConfig(rounds=2, clients_per_round=3))
    run_fit(spec)
    ctx = algorithm.ctx
    served = algorithm.statistics.served(ctx.model)
    fed = ctx.data
    images = client_images(fed) if data == "train" else fed.bundle.train_eval.data[fed.calib]
    assert_statistics(served, population_moments(served, images))
    state = ctx.model.state_dict()
    if bn == "sbn":  # nothing was tracked or aggregated: the global statistics are the initial ones
        for key in statistics_keys(ctx.model):
            initial = {"running_mean": 0.0, "running_var": 1.0, "num_batches_tracked": 0}[key.rsplit(".", 1)[1]]
            assert (state[key] == initial).all(), key


def test_served_statistics_are_estimated_once_per_global_model(spec_factory):
    """'val' and 'test' of one evaluation share the served model; any write to the global model
    (a round, a loaded checkpoint) gives a fresh estimate with the new weights' statistics."""
    algorithm = Uniform(caps=[1.0, 0.5, 0.25, 0.5, 1.0, 0.25], bn="sbn", calib_batch_size=ONE_BATCH,
                        calib_transform="eval")
    spec = spec_factory(name="cached", algorithm=algorithm, data=DATA,
                        federation=FederationConfig(rounds=1, clients_per_round=3))
    run_fit(spec)
    ctx = algorithm.ctx
    first = algorithm.statistics.served(ctx.model)
    assert algorithm.statistics.served(ctx.model) is first
    with torch.no_grad():
        ctx.model.state_dict()["features.block0.conv.weight"].mul_(1.5)  # as a round's apply writes it
    again = algorithm.statistics.served(ctx.model)
    assert again is not first
    assert_statistics(again, population_moments(again, client_images(ctx.data)))


def test_fjord_per_width_statistics_come_from_the_clients_at_the_served_width(spec_factory):
    """FjORD's default (the Flower baseline's per-width statistics): only clients that trained
    the full width send statistics; with caps below 1 for all, nobody does and they stay initial,
    while the parameters move."""
    algorithm = FjORD(caps=[0.5, 0.75, 0.5, 0.25, 0.75, 0.5])
    spec = spec_factory(name="fjord", algorithm=algorithm, federation=FederationConfig(rounds=2, clients_per_round=3))
    run_fit(spec)
    state = algorithm.ctx.model.state_dict()
    assert float(state["features.block0.bn.running_var"].sub(1).abs().max()) == 0.0
    assert float(state["features.block0.bn.weight"].sub(1).abs().max()) > 0.0
    full = FjORD(tiers=[1.0], tier_probs=[1.0], caps=[1.0] * 6)  # every client at the full width
    spec = spec_factory(name="fjord_full", algorithm=full, federation=FederationConfig(rounds=1, clients_per_round=3))
    run_fit(spec)
    assert float(full.ctx.model.state_dict()["features.block0.bn.running_var"].sub(1).abs().max()) > 0.0


# -- pooled client statistics -----------------------------------------------------------------------------
def test_batch_moments_pool_every_batch_a_model_normalized():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    batches = [torch.randn(4, 3, 2, 2) * s + s for s in (1.0, 3.0, 0.5)]
    batch_moments(bn)
    bn.train()
    for x in batches:
        bn(x)
    values = torch.cat([x.transpose(0, 1).flatten(1) for x in batches], dim=1).double()
    torch.testing.assert_close(bn.running_mean.double(), values.mean(1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bn.running_var.double(), values.var(1, unbiased=False), rtol=1e-5, atol=1e-6)
    batch_moments(bn)  # a reset: the next client's batches only
    bn(batches[0])
    torch.testing.assert_close(bn.running_mean.double(), batches[0].transpose(0, 1).flatten(1).double().mean(1),
                               rtol=1e-6, atol=1e-6)


def test_pooled_variances_follow_the_law_of_total_variance():
    """Two clients whose statistics differ in mean: the pooled variance is the weighted mean of
    the variances plus the spread of the means, not the mean of the variances."""
    state = {"bn.running_mean": torch.zeros(2), "bn.running_var": torch.ones(2), "w": torch.zeros(2)}
    acc = SparseAccumulator(state, dense=True, pooled_variances=True)
    a = {"bn.running_mean": torch.tensor([0.0, 1.0]), "bn.running_var": torch.tensor([1.0, 2.0]), "w": torch.ones(2)}
    b = {"bn.running_mean": torch.tensor([2.0, 1.0]), "bn.running_var": torch.tensor([3.0, 2.0]), "w": torch.ones(2)}
    acc.add(a, 1.0, full_region_map(a))
    acc.add(b, 3.0, full_region_map(b))
    out = acc.result()
    mean = (1 * a["bn.running_mean"] + 3 * b["bn.running_mean"]) / 4
    within = (1 * a["bn.running_var"] + 3 * b["bn.running_var"]) / 4
    between = (1 * (a["bn.running_mean"] - mean) ** 2 + 3 * (b["bn.running_mean"] - mean) ** 2) / 4
    torch.testing.assert_close(out["bn.running_mean"], mean)
    torch.testing.assert_close(out["bn.running_var"], within + between)  # [2.5 + 0.75, 2]
    plain = SparseAccumulator(state, dense=True)
    plain.add(a, 1.0, full_region_map(a))
    plain.add(b, 3.0, full_region_map(b))
    torch.testing.assert_close(plain.result()["bn.running_var"], within)


def test_client_statistics_pool_every_clients_batches_of_the_round(spec_factory):
    """FedAvg with bn: client and lr 0 (the model does not move, so every batch sees the same
    weights): the first BN's statistics after a round are the mean and (biased) variance of the
    stem's outputs over every example of the round's clients, not a momentum average."""
    algorithm = FedAvg(bn="client")
    spec = spec_factory(name="client", algorithm=algorithm, train=LocalTrainConfig(epochs=1, batch_size=16, lr=0.0),
                        federation=FederationConfig(rounds=1, clients_per_round=3), eval=EvalConfig(every=1))
    run_fit(spec)
    ctx = algorithm.ctx
    cohort = sample_clients(0, 0, ctx.num_clients, 3)
    images = ctx.data.bundle.train.data[torch.cat([torch.as_tensor(ctx.data.clients[c]) for c in cohort])]
    conv = ctx.model.features["block0"].conv
    out = torch.nn.functional.conv2d(images.double(), conv.weight.double(), padding=1).transpose(0, 1).flatten(1)
    bn = ctx.model.features["block0"].bn
    torch.testing.assert_close(bn.running_mean.double(), out.mean(1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bn.running_var.double(), out.var(1, unbiased=False), rtol=1e-4, atol=1e-5)


# -- split methods ---------------------------------------------------------------------------------------
def test_splitfed_v2_serves_population_statistics_not_the_last_clients(spec_factory):
    """SplitFed V2 (static BN, the default): the served model's every BN, server half included,
    holds the statistics of a pass over the union of the client shards; the server half's
    running buffers under the old aggregated protocol (the round's last clients) are far off."""
    served_models = {}
    for bn in ("sbn", "aggregated"):
        algorithm = SplitFed(cut="layer2.0", version="v2", bn=bn, calib_batch_size=ONE_BATCH, calib_transform="eval")
        spec = spec_factory(name=f"v2_{bn}", algorithm=algorithm, data=DATA, model=RESNET,
                            partition=PartitionConfig(method="dirichlet", num_clients=6, alpha=0.1),
                            train=LocalTrainConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9),
                            federation=FederationConfig(rounds=1, clients_per_round=6))
        run_fit(spec)
        served_models[bn] = (algorithm, algorithm.statistics.served(algorithm.ctx.model))
    algorithm, served = served_models["sbn"]
    expected = population_moments(served, client_images(algorithm.ctx.data))
    assert_statistics(served, expected)
    _, last_clients = served_models["aggregated"]
    expected = population_moments(last_clients, client_images(algorithm.ctx.data))
    gap = max(float((m.running_var.double() - expected[n][1]).abs().max() / expected[n][1].abs().max())
              for n, m in last_clients.named_modules() if isinstance(m, _BatchNorm) and n.startswith("layer3"))
    assert gap > 0.05


# -- defaults as a user meets them ---------------------------------------------------------------------
@pytest.mark.parametrize("algorithm, expected", [("FedAvg", "aggregated"), ("FedProx", "aggregated"),
                                                 ("HeteroFL", "sbn"), ("HASFL", "sbn"), ("FjORD", "per_width"),
                                                 ("FedRolex", "sbn"), ("SplitFed", "sbn"), ("FedSGA", "sbn")])
def test_a_method_named_without_bn_gets_its_own_default(algorithm, expected):
    """On the command line the algorithm replaces the default FedAvg, whose options the parser
    carries over to the new class: the method's own default must still apply."""
    from fl_lightning.cli import parse_command

    _, args, _ = parse_command(["fit", "--algorithm", algorithm])
    assert args.algorithm.bn == expected
    _, args, _ = parse_command(["fit", "--algorithm", "FedProx", "--algorithm", algorithm])
    assert args.algorithm.bn == expected
