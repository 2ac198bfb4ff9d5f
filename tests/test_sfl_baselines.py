"""MergeSFL, MU-SplitFed and MultiSFL: the merged batch and its gradient slices, the unbalanced
server steps, branch aggregation and weak re-aggregation, knowledge replay's arithmetic, the
bytes at the cut, exact resume, bad options (docs/sfl_baselines.md)."""

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.algorithms.split.mergesfl import MergeSFL, merged_kl, regulate_batch_sizes
from fl_lightning.algorithms.split.musplitfed import MUSplitFed
from fl_lightning.algorithms.split.multisfl import (MultiSFL, choose_assistants, decayed_distribution,
                                              replay_requirement, weak_aggregate)
from fl_lightning.algorithms.split.splitfed import SplitFed
from fl_lightning.config import FederationConfig, LocalTrainConfig
from fl_lightning.elastic.models import build_model
from fl_lightning.errors import ConfigError
from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.federation.loop import run_fit
from fl_lightning.elastic.models import ResNet18
from option_checks import option_refusal

RESNET = {"class_path": "fl_lightning.elastic.models.ResNet18", "init_args": {"width": 0.125}}
TRAIN = LocalTrainConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9)
PLAIN = LocalTrainConfig(steps=1, batch_size=4, lr=0.1)  # one plain SGD step: hand computations
# three local steps a client (not an epoch): step-by-step equivalences and exact resume hold
# or break at the first steps of a round
STEPS = LocalTrainConfig(steps=3, batch_size=16, lr=0.05, momentum=0.9)


def fabric():
    from lightning.fabric import Fabric

    return Fabric(accelerator="cpu", devices=1)


def pair_of(fabric, front, back, lr, server_loss=None, server_optimizer=None):
    """A split pair of two toy halves trained with plain SGD at ``lr``."""
    from fl_lightning.modules.split import make_pair

    if server_loss is None:
        server_loss = lambda zs, t: F.cross_entropy(back(zs), t)  # noqa: E731
    return make_pair(fabric, PLAIN, client_forward=front, server_loss=server_loss, client_module=front,
                     server_module=back, client_params=front.parameters(), server_params=back.parameters(),
                     lr=lr, server_lr=lr, server_optimizer=server_optimizer)


def rows(spec, name):
    return [json.loads(line) for line in (Path(spec.out_dir) / spec.name / name).read_text().splitlines()]


def saved(spec):
    return load_checkpoint(Path(spec.out_dir) / spec.name / "checkpoints" / "last.ckpt")


def sgd_step(module, loss, lr):
    """A copy of ``module`` after one plain SGD step on ``loss(copy)``."""
    module = copy.deepcopy(module)
    loss(module).backward()
    with torch.no_grad():
        for p in module.parameters():
            p -= lr * p.grad
    return module


def assert_params(module, expected, atol=1e-6):
    """Toy halves (a few dozen float32 weights near 1) after one or a few SGD steps of lr <= 0.1:
    a different order of the float32 sums moves a gradient by a few ulps (~1e-7 of its size) and
    a weight by less than that; 1e-6 absolute (with allclose's 1e-5 relative) leaves a margin of
    about ten, while a wrong step moves a weight by lr x gradient, ~1e-2."""
    for (name, a), b in zip(module.named_parameters(), expected.parameters()):
        assert torch.allclose(a, b, atol=atol), name


# -- MergeSFL ---------------------------------------------------------------------------------
@pytest.mark.parametrize("rescale", [True, False])
def test_merged_step_trains_the_concatenation_and_sends_each_client_its_slice(rescale):
    """Two clients with batches of 2 and 3: the server steps once on cat(z_1, z_2); client i
    steps on rows of the merged loss's gradient that are its own (times B / b_i when rescaled,
    the gradient of the mean loss over its own rows), all at the server's pre-step weights."""
    from fl_lightning.modules.split import SplitFit
    from fl_lightning.modules.split_variants import merged_step

    torch.manual_seed(0)
    fronts = [nn.Linear(3, 4), nn.Linear(3, 4)]
    back = nn.Linear(4, 5)
    batches = [(torch.randn(2, 3), torch.tensor([0, 4])), (torch.randn(3, 3), torch.tensor([1, 1, 2]))]
    lr = 0.1
    seen = []

    def server_loss(sent, y):
        seen.append((sent.detach().clone(), y.clone()))
        return F.cross_entropy(back(sent), y)

    before = [copy.deepcopy(f) for f in fronts]
    back_before = copy.deepcopy(back)
    f = fabric()
    pairs = [pair_of(f, fronts[0], back, lr, server_loss)]
    pairs.append(pair_of(f, fronts[1], back, lr, server_loss, server_optimizer=pairs[0].server_optimizer))
    fits = [SplitFit(0), SplitFit(0)]
    step = merged_step(f, pairs, server_loss, pairs[0].server_optimizer, back, batches, fits, PLAIN, rescale=rescale)
    (sent, y), = seen
    assert torch.equal(sent, torch.cat([f(x) for f, (x, _) in zip(before, batches)]).detach())
    assert torch.equal(y, torch.cat([b[1] for b in batches]))
    ys = torch.cat([b[1] for b in batches])
    assert_params(back, sgd_step(back_before, lambda m: F.cross_entropy(m(sent), ys), lr))
    for i, (front, (x, yi)) in enumerate(zip(before, batches)):
        scale = 1.0 if rescale else len(yi) / len(ys)  # the mean over own rows, or its share of the merged mean
        expected = sgd_step(front, lambda m: scale * F.cross_entropy(back_before(m(x)), yi), lr)
        assert_params(fronts[i], expected)
    assert step.sizes == [2, 3]
    # float32 activations, int64 labels
    assert [fit.cut_bytes_up for fit in fits] == [2 * 4 * 4 + 2 * 8, 3 * 4 * 4 + 3 * 8]
    assert [fit.cut_bytes_down for fit in fits] == [2 * 4 * 4, 3 * 4 * 4]


def test_batch_sizes_follow_speeds_within_bounds():
    assert regulate_batch_sizes([1, 2, 3, 4], [100] * 4, 20) == [2, 4, 6, 8]
    # client 3 is capped at its shard; the others share the rest in proportion
    assert regulate_batch_sizes([1, 1, 1, 10], [100, 100, 100, 5], 20) == [5, 5, 5, 5]
    # the slow client is lifted to min_batch, the rest shared again: 2 + 18 * (1/3, 2/3)
    assert regulate_batch_sizes([0.01, 1, 2], [100] * 3, 20, low=2) == [2, 6, 12]
    sizes = regulate_batch_sizes([1, 1, 1], [100] * 3, 10)
    assert sum(sizes) == 10 and sizes == [4, 3, 3]  # largest remainder, ties to the earlier client


def test_merged_kl_of_complementary_clients_is_zero():
    counts = torch.tensor([[10.0, 0.0], [0.0, 30.0]])
    reference = torch.tensor([0.5, 0.5])
    assert merged_kl(counts, [4, 4], reference) == pytest.approx(0.0)
    mix = torch.tensor([0.75, 0.25])  # b = (6, 2)
    assert merged_kl(counts, [6, 2], reference) == pytest.approx(float((mix * (mix / reference).log()).sum()))


def test_mergesfl_round_counts_the_bytes_that_cross(spec_factory):
    """Through the loop: every client's traffic is its activations and labels up and its
    gradient slice down, over the round's lock-stepped iterations; the batch sizes fill the
    merged batch; the fronts are averaged by the examples each client processed."""
    spec = spec_factory(name="merge", algorithm=MergeSFL(cut="layer2.0"), model=RESNET,
                        train=LocalTrainConfig(steps=3, batch_size=8, lr=0.05),
                        federation=FederationConfig(rounds=1, clients_per_round=3))
    run_fit(spec)
    model = build_model(ResNet18, 10, (1, 8, 8), width=0.125)
    per_example = model.forward_until(torch.zeros(1, 1, 8, 8), "layer2.0").numel() * 4
    clients = rows(spec, "clients.jsonl")
    assert sum(r["batch_size"] for r in clients) == 24
    for r in clients:
        assert r["steps"] == 3 and r["samples"] == 3 * r["batch_size"]
        assert r["cut_bytes_up"] == r["samples"] * (per_example + 8)
        assert r["cut_bytes_down"] == r["samples"] * per_example
    assert "merge/kl" in rows(spec, "metrics.jsonl")[0]


def test_mergesfl_selection_minimizes_the_merged_kl(spec_factory):
    from lightning.fabric import Fabric as LightningFabric

    from fl_lightning.federation.builder import build_context

    spec = spec_factory(name="sel", algorithm=MergeSFL(selection_trials=16), model=RESNET, train=TRAIN)
    ctx = build_context(spec, LightningFabric(accelerator="cpu", devices=1))
    algorithm = spec.algorithm
    plan = algorithm.plan(0)
    uniform = MergeSFL(selection="uniform")
    uniform.setup(ctx)
    cohort = uniform.plan(0).cohort
    chosen = merged_kl(algorithm.counts[plan.cohort], [t.choice.batch_size for t in plan.tasks], algorithm.reference)
    assert chosen <= merged_kl(algorithm.counts[cohort], algorithm.batch_sizes(cohort), algorithm.reference)
    assert plan.cohort != cohort  # 16 draws found a closer cohort than the uniform one


# -- MU-SplitFed ------------------------------------------------------------------------------
class OneBatch:
    """A shard of one fixed batch (the ClientData methods the passes use)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def batches_per_epoch(self):
        return 1

    def steps(self, n, generator):
        return iter([(self.x, self.y)] * n)

    def epoch(self, generator):
        return iter([(self.x, self.y)])


@pytest.mark.parametrize("feedback_at", ["start", "last_step", "end"])
def test_server_takes_tau_sgd_steps_per_client_step(feedback_at):
    """tau = 3: the server half is three plain SGD steps along the loss on the one activation
    batch; the client half one step along the gradient at the cut computed with the server's
    weights before its steps (start), before its third step (last_step) or after (end)."""
    from fl_lightning.modules.split import split_step, train_split
    from fl_lightning.modules.split_variants import unbalanced

    torch.manual_seed(1)
    front, back = nn.Linear(3, 4), nn.Linear(4, 5)
    x, y = torch.randn(6, 3), torch.randint(0, 5, (6,))
    lr, tau = 0.1, 3
    z = front(x).detach()
    states = [copy.deepcopy(back)]
    for _ in range(tau):
        states.append(sgd_step(states[-1], lambda m: F.cross_entropy(m(z), y), lr))
    server_at = {"start": states[0], "last_step": states[tau - 1], "end": states[tau]}[feedback_at]
    client_expected = sgd_step(front, lambda m: F.cross_entropy(server_at(m(x)), y), lr)
    f = fabric()
    fit = train_split(f, split_step(pair_of(f, front, back, lr), unbalanced(tau, feedback_at)), OneBatch(x, y),
                      PLAIN, torch.Generator())
    assert_params(back, states[tau])
    assert_params(front, client_expected)
    assert fit.steps == 1
    assert fit.cut_bytes_up == 6 * 4 * 4 + 6 * 8 and fit.cut_bytes_down == 6 * 4 * 4


def test_zeroth_order_unbalanced_update_by_hand():
    """The original's estimator: tau two-point server steps on the unperturbed activations,
    then one client step along v scaled by the loss difference of its +-lambda activations at
    the server's final weights; directions come from the generator in that order (v, u_1..u_tau)."""
    from fl_lightning.modules.split import train_split
    from fl_lightning.modules.split_variants import zeroth_order_step

    torch.manual_seed(2)
    front, back = nn.Linear(3, 4), nn.Linear(4, 5)
    x, y = torch.randn(6, 3), torch.randint(0, 5, (6,))
    lr, tau, lam = 0.05, 2, 1e-2
    f0, b0 = copy.deepcopy(front), copy.deepcopy(back)
    g = torch.Generator().manual_seed(7)
    draw = lambda module: [torch.randn(p.shape, generator=g) for p in module.parameters()]
    v = draw(f0)

    def run(module, params, inputs):
        return torch.func.functional_call(module, dict(zip(dict(module.named_parameters()), params)), (inputs,))

    def loss_with(module, params, inputs):
        return F.cross_entropy(run(module, params, inputs), y)

    with torch.no_grad():
        h = f0(x)
        fp = [p.detach() for p in f0.parameters()]
        sp = [p.detach() for p in b0.parameters()]
        for _ in range(tau):
            u = draw(b0)
            d = (loss_with(b0, [p + lam * e for p, e in zip(sp, u)], h)
                 - loss_with(b0, [p - lam * e for p, e in zip(sp, u)], h)) / (2 * lam)
            sp = [p - lr * d * e for p, e in zip(sp, u)]
        h_plus = run(f0, [p + lam * e for p, e in zip(fp, v)], x)
        h_minus = run(f0, [p - lam * e for p, e in zip(fp, v)], x)
        d = (loss_with(b0, sp, h_plus) - loss_with(b0, sp, h_minus)) / (2 * lam)
        fp = [p - lr * d * e for p, e in zip(fp, v)]
    f = fabric()
    pair = pair_of(f, front, back, lr)
    fit = train_split(f, zeroth_order_step(pair, tau, "end", lam, torch.Generator().manual_seed(7)), OneBatch(x, y),
                      PLAIN, torch.Generator())
    for p, e in zip(back.parameters(), sp):
        assert torch.allclose(p, e, atol=1e-6)
    for p, e in zip(front.parameters(), fp):
        assert torch.allclose(p, e, atol=1e-6)
    assert fit.cut_bytes_up == 3 * 6 * 4 * 4 + 6 * 8 and fit.cut_bytes_down == 4  # h, h+, h- up; one scalar down


def test_one_server_step_answered_at_the_start_is_splitfed(spec_factory):
    fed = FederationConfig(rounds=2, clients_per_round=3)
    mu = spec_factory(name="mu", algorithm=MUSplitFed(cut="layer2.1", tau=1, feedback_at="start"), model=RESNET,
                      train=STEPS, federation=fed)
    plain = spec_factory(name="sfl", algorithm=SplitFed(cut="layer2.1"), model=RESNET, train=STEPS, federation=fed)
    run_fit(mu)
    run_fit(plain)
    assert all(r["server_steps"] == r["steps"] for r in rows(mu, "clients.jsonl"))  # tau = 1 step per batch
    for key, value in saved(mu)["model"].items():
        assert torch.allclose(value.double(), saved(plain)["model"][key].double(), rtol=1e-4, atol=1e-5), key


# -- MultiSFL ---------------------------------------------------------------------------------
def test_weak_aggregation_pulls_floating_tensors_only():
    branch = {"w": torch.tensor([1.0, 3.0]), "n": torch.tensor(5)}
    master = {"w": torch.tensor([12.0, -8.0]), "n": torch.tensor(9)}
    weak_aggregate(branch, master, 1 / 11)
    # the authors' (1 * master + 10 * branch) / 11
    assert torch.allclose(branch["w"], torch.tensor([(12 + 10) / 11, (-8 + 30) / 11]))
    assert branch["n"] == 5


def test_replay_arithmetic():
    d, w = decayed_distribution(torch.zeros(4, dtype=torch.float64), torch.zeros((), dtype=torch.float64),
                                torch.tensor([8.0, 0, 2, 0], dtype=torch.float64), 0.5)
    assert w == 1 and torch.equal(d, torch.tensor([8.0, 0, 2, 0], dtype=torch.float64))
    d, w = decayed_distribution(d, w, torch.tensor([0.0, 6, 0, 0], dtype=torch.float64), 0.5)
    assert w == 1.5 and torch.allclose(d, torch.tensor([4.0, 6, 1, 0], dtype=torch.float64) / 1.5)
    # mean 2.5: deficits (0, 0, 1.5, 2.5) / 4 of R = max(4, 0.01 * 1000) = 10 -> floor(3.75), floor(6.25)
    need = replay_requirement(torch.tensor([4.0, 5, 1, 0], dtype=torch.float64), 1000, 0.01)
    assert need.tolist() == [0, 0, 3, 6]
    counts = torch.tensor([[0, 0, 9, 9], [0, 0, 2, 1], [0, 0, 5, 5], [9, 9, 9, 9]], dtype=torch.float64)
    chosen = choose_assistants(need, counts, client=3, generator=torch.Generator().manual_seed(0))
    assert 3 not in [h for h, _ in chosen]
    total = sum(give for _, give in chosen)
    assert total.tolist() == [0, 0, 3, 6]
    for helper, give in chosen:
        assert (give <= counts[helper]).all()


def test_branches_average_into_the_master_and_are_pulled_back(spec_factory):
    """One round by hand from the trained branches: the master is their plain mean, each branch
    then moves 1/11 of the way to it."""

    class Recording(MultiSFL):
        def finish_round(self, acc, plan):
            self.seen = {t.choice.branch: {k: acc[f"branch/{t.choice.branch}/{k}"].clone() for k in self.branches[0]}
                         for t in plan.tasks}
            return super().finish_round(acc, plan)

    algorithm = Recording(cut="layer2.0", bn="aggregated")  # the authors' master averages every tensor
    spec = spec_factory(name="multi", algorithm=algorithm, model=RESNET, train=TRAIN,
                        federation=FederationConfig(rounds=1, clients_per_round=3))
    run_fit(spec)
    trained = algorithm.seen
    assert sorted(trained) == [0, 1, 2]
    model = saved(spec)["model"]
    for key, value in model.items():
        if not value.is_floating_point():
            continue
        mean = sum(trained[b][key].double() for b in range(3)) / 3
        assert torch.allclose(value.double(), mean, atol=1e-6), key
        for b in range(3):
            expected = trained[b][key].double() + (mean - trained[b][key].double()) / 11
            assert torch.allclose(algorithm.branches[b][key].double(), expected, atol=1e-6), key


def test_replayed_examples_reach_the_server(spec_factory):
    spec = spec_factory(name="replay", algorithm=MultiSFL(cut="layer2.0", replay_budget=0.1), model=RESNET,
                        train=TRAIN, federation=FederationConfig(rounds=2, clients_per_round=3))
    run_fit(spec)
    model = build_model(ResNet18, 10, (1, 8, 8), width=0.125)
    per_example = model.forward_until(torch.zeros(1, 1, 8, 8), "layer2.0").numel() * 4
    clients = rows(spec, "clients.jsonl")
    assert sum(r["replay_examples"] for r in clients) > 0
    for r in clients:
        assert r["replay_bytes_up"] == r["replay_examples"] * (per_example + 8)
        assert r["cut_bytes_up"] == r["samples"] * (per_example + 8)
    assert sorted(r["branch"] for r in clients if r["round"] == 0) == [0, 1, 2]


def test_multisfl_resumes_exactly(spec_factory):
    fed = FederationConfig(rounds=3, clients_per_round=3)
    options = dict(cut="layer2.0", replay_budget=0.1)
    whole = spec_factory(name="whole", algorithm=MultiSFL(**options), model=RESNET, train=STEPS, federation=fed)
    run_fit(whole)
    part = spec_factory(name="part", algorithm=MultiSFL(**options), model=RESNET, train=STEPS, federation=fed)
    part.stop_after = 1
    run_fit(part)
    resumed = spec_factory(name="part", algorithm=MultiSFL(**options), model=RESNET, train=STEPS, federation=fed)
    resumed.resume_from = str(Path(part.out_dir) / "part" / "checkpoints" / "last.ckpt")
    run_fit(resumed)
    a, b = saved(whole), saved(resumed)
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert set(a["algorithm"]) == set(b["algorithm"])
    for key, value in a["algorithm"].items():
        assert torch.equal(value, b["algorithm"][key]), key


@pytest.mark.parametrize("b_min, b_max, expected", [(2e5, 2.5e5, {0}), (25e6, 1500e6, {2})])
def test_adaptive_split_cuts_each_client_at_the_deepest_affordable_candidate(spec_factory, b_min, b_max, expected):
    """Budgets between the first (0.157M MACs) and the second (0.291M) front, or above all."""
    from lightning.fabric import Fabric as LightningFabric

    from fl_lightning.config import BudgetConfig, PartitionConfig
    from fl_lightning.federation.builder import build_context

    partition = PartitionConfig(method="dirichlet", num_clients=6, alpha=0.5,
                                budgets=BudgetConfig(b_min=b_min, b_max=b_max, b_cap=b_max))
    spec = spec_factory(name="ad", algorithm=MultiSFL(adaptive_split=True), model=RESNET, train=TRAIN,
                        partition=partition)
    build_context(spec, LightningFabric(accelerator="cpu", devices=1))
    algorithm = spec.algorithm
    assert algorithm.cuts == ["layer1.1", "layer2.1", "layer3.1"]
    assert {algorithm.cuts.index(c) for c in algorithm.client_cut} == expected
    assert {t.cut for t in algorithm.plan(0).tasks} == {algorithm.cuts[i] for i in expected}


# -- options ----------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm, options, key", [
    ("MergeSFL", dict(speeds="fast"), "algorithm.speeds"),
    ("MergeSFL", dict(selection="greedy"), "algorithm.selection"),
    ("MergeSFL", dict(min_batch=0), "algorithm.min_batch"),
    ("MergeSFL", dict(total_batch=2.5), "algorithm.total_batch"),
    ("MergeSFL", dict(selection_trials=0), "algorithm.selection_trials"),
    ("MUSplitFed", dict(tau=0), "algorithm.tau"),
    ("MUSplitFed", dict(feedback_at="middle"), "algorithm.feedback_at"),
    ("MUSplitFed", dict(estimator="so"), "algorithm.estimator"),
    ("MUSplitFed", dict(zo_smoothing=0), "algorithm.zo_smoothing"),
    ("MUSplitFed", dict(version="v3"), "algorithm.version"),
    ("MultiSFL", dict(pull=1.5), "algorithm.pull"),
    ("MultiSFL", dict(replay_budget=-0.1), "algorithm.replay_budget"),
    ("MultiSFL", dict(replay_decay=2), "algorithm.replay_decay"),
    ("MultiSFL", dict(candidates=["layer1.1", "layer2.1"]), "algorithm.candidates"),
    ("MultiSFL", dict(cut="layer2.0", adaptive_split=True), "algorithm.cut"),
])
def test_bad_option_values(algorithm, options, key):
    error = option_refusal(algorithm, **options)
    assert error.key == key
    assert "\n" not in str(error)


@pytest.mark.parametrize("algorithm, key", [
    (lambda: MergeSFL(total_batch=4), "algorithm.total_batch"),  # 3 clients x min_batch 2 > 4 rows
    (lambda: MergeSFL(cut="fc"), "algorithm.cut"),
    (lambda: MultiSFL(adaptive_split=True, candidates=["layer2.1", "layer1.1"]), "algorithm.candidates"),
])
def test_bad_set_ups_are_refused_before_training(spec_factory, algorithm, key):
    spec = spec_factory(name="bad", algorithm=algorithm(), model=RESNET, train=TRAIN)
    with pytest.raises(ConfigError) as error:
        run_fit(spec)
    assert error.value.key == key
    assert not (Path(spec.out_dir) / spec.name / "checkpoints").exists()
