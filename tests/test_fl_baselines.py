"""FedBABU, FedGH, FedAS and FedMut: each method's defining step against an independent
computation, exact resume of the stateful ones, one-line errors for bad options."""

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

from fl_lightning.algorithms.personalized.fedas import TRAINED, FedAS, alignment_loss
from fl_lightning.algorithms.personalized.fedbabu import FedBABU
from fl_lightning.algorithms.personalized.fedgh import FedGH
from fl_lightning.algorithms.fedmut import FedMut, balanced_signs
from fl_lightning.config import FederationConfig, LocalTrainConfig, PartitionConfig
from fl_lightning.data.federated import build_federated_data
from fl_lightning.federation.builder import build_global_model
from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.federation.loop import Federation, run_fit
from fl_lightning.federation.run_dir import RunDir
from fl_lightning.runtime.plan import ClientTask
from option_checks import option_refusal

TRAIN = LocalTrainConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-3)
HEAD = ("fc.weight", "fc.bias")  # the tiny CNN's classifier


def saved(spec, name="last.ckpt"):
    return load_checkpoint(Path(spec.out_dir) / spec.name / "checkpoints" / name)


def rows(spec, name):
    return [json.loads(line) for line in (Path(spec.out_dir) / spec.name / name).read_text().splitlines()]


def federation(spec):
    """The run's loop on one CPU rank, for stepping rounds by hand."""
    fed = Federation(Fabric(accelerator="cpu", devices=1), spec, RunDir(spec.out_dir, spec.name))
    fed._open_outputs()
    return fed


def shard_tensors(ctx, client):
    shard = ctx.shards[client]
    return shard.dataset.data[shard.indices], shard.dataset.targets[shard.indices]


def cnn_features(model, x):
    """The CNN's representation entering ``fc``, written out (not through the algorithms' hook)."""
    return F.adaptive_avg_pool2d(model.forward_features(x), 1).flatten(1)


def batch_bounds(rows, batch_size):
    """``(start, end)`` of consecutive batches, a one-row remainder joined to the batch before
    (batch norm on batch statistics needs two rows)."""
    starts = list(range(0, rows, batch_size))
    if len(starts) > 1 and rows - starts[-1] == 1:
        starts.pop()
    return list(zip(starts, starts[1:] + [rows]))


def batch_norm_features(model, x, batch_size):
    """``cnn_features`` with batch norm on the statistics of each batch in order, on a copy in
    training mode (the CNN has no dropout), so the model's running statistics are untouched."""
    copy_ = copy.deepcopy(model).train()
    with torch.no_grad():
        return torch.cat([cnn_features(copy_, x[a:b]) for a, b in batch_bounds(len(x), batch_size)])


def scramble_running_statistics(model):
    """Running statistics far from any data's (what a few local steps leave), in place."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("running_mean"):
                buffer.fill_(3.0)
            elif name.endswith("running_var"):
                buffer.fill_(1e-4)


def buffers_of(model):
    return {k: v.clone() for k, v in model.named_buffers()}


# -- FedBABU -------------------------------------------------------------------------------------
def test_fedbabu_trains_the_body_and_never_the_head(spec_factory):
    """With momentum and weight decay the head is still bit-identical to its initialization;
    every body tensor moved. ``ft_acc`` (fine-tuned personalization) appears only once the last
    round is done."""
    spec = spec_factory(name="babu", algorithm=FedBABU(finetune_epochs=1), train=TRAIN,
                        federation=FederationConfig(rounds=2, clients_per_round=3))
    summary = run_fit(spec)
    final = saved(spec)["model"]
    initial = build_global_model(spec, build_federated_data(spec.data, spec.partition, spec.seed)).state_dict()
    for key in HEAD:
        assert torch.equal(final[key], initial[key]), key
    moved = [k for k, v in initial.items() if v.is_floating_point() and k not in HEAD]
    assert moved and all(not torch.equal(final[k], initial[k]) for k in moved)
    metrics = rows(spec, "metrics.jsonl")
    assert "test_ft_acc" not in metrics[0] and 0.0 <= metrics[-1]["test_ft_acc"] <= 1.0
    assert 0.0 <= summary["final"]["test_ft_acc"] <= 1.0
    clients = rows(spec, "clients.jsonl")
    head_bytes = sum(initial[k].numel() * 4 for k in HEAD)
    assert all(r["bytes_up"] == r["bytes_down"] - head_bytes for r in clients)


def test_fedbabu_finetunes_at_a_hundredth_of_the_training_rate_without_weight_decay(spec_factory, monkeypatch):
    """The authors' personalization (analysis.ipynb of jhoon-oh/FedBABU) is SGD over body and
    head at lr 1e-3 after training at 0.1, with the training momentum and no weight decay: by
    default every client's fine-tuning optimizer gets ``train.lr / 100``, ``train.momentum``
    and weight decay 0; the explicit options still override."""
    import fl_lightning.modules.supervised as supervised

    built = []

    class Recording(supervised.SupervisedClient):
        def __init__(self, model, lr, momentum=0.0, weight_decay=0.0):
            built.append((lr, momentum, weight_decay))
            super().__init__(model, lr, momentum, weight_decay)

    monkeypatch.setattr(supervised, "SupervisedClient", Recording)
    spec = spec_factory(name="babu_ft", algorithm=FedBABU(finetune_epochs=1), train=TRAIN,
                        federation=FederationConfig(rounds=1, clients_per_round=3))
    fed = federation(spec)
    alg = fed.algorithm
    for client in range(fed.ctx.num_clients):
        alg.finetuned(client)
    assert len(built) == fed.ctx.num_clients
    assert all(b == pytest.approx((TRAIN.lr / 100, TRAIN.momentum, 0.0), abs=0, rel=1e-12) for b in built)
    assert FedBABU(finetune_lr=0.02).finetune_optimizer(TRAIN) == (0.02, TRAIN.momentum, 0.0)
    assert FedBABU(finetune_lr_scale=1.0, finetune_weight_decay=None).finetune_optimizer(TRAIN) == \
        (TRAIN.lr, TRAIN.momentum, TRAIN.weight_decay)


# -- FedGH ---------------------------------------------------------------------------------------
def test_fedgh_server_header_step_and_personal_bodies(spec_factory):
    """The global header after round 0 equals SGD by hand, one cross-entropy step per
    (client, class) prototype in cohort and class order, the prototypes being the per-class
    mean representations of each client's trained body (batch norm on the statistics of each
    batch of the shard); bodies are not aggregated, and every client's model carries the
    global header."""
    spec = spec_factory(name="gh", algorithm=FedGH(), train=TRAIN,
                        federation=FederationConfig(rounds=2, clients_per_round=3))
    fed = federation(spec)
    alg, ctx = fed.algorithm, fed.ctx
    initial = {k: v.clone() for k, v in alg.global_state.items()}
    cohort = alg.plan(0).cohort
    lr = alg.round_lr(0)
    _, logged = fed.run_round(0)
    logged = {r["client"]: r for r in logged}

    weight, bias = initial["fc.weight"].clone(), initial["fc.bias"].clone()
    for client in cohort:
        body = copy.deepcopy(ctx.model)
        body.load_state_dict({**initial, **{k: v for k, v in alg.store.states[client].items() if k in initial}})
        x, y = shard_tensors(ctx, client)
        # traffic: the float32 header down; one float32 prototype and one int64 label per held class up
        assert logged[client]["bytes_down"] == 4 * (weight.numel() + bias.numel())
        assert logged[client]["bytes_up"] == len(set(y.tolist())) * (4 * weight.shape[1] + 8)
        features = batch_norm_features(body, x, TRAIN.batch_size)
        for c in sorted(set(y.tolist())):
            prototype = features[y == c].mean(0, keepdim=True)
            w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
            loss = F.cross_entropy(prototype @ w.T + b, torch.tensor([c]))
            gw, gb = torch.autograd.grad(loss, (w, b))
            weight, bias = weight - lr * gw, bias - lr * gb
    assert torch.allclose(alg.global_state["fc.weight"], weight, atol=1e-5)
    assert torch.allclose(alg.global_state["fc.bias"], bias, atol=1e-5)

    body_keys = [k for k in initial if k not in HEAD]
    for key in body_keys:  # the server never aggregates bodies
        assert torch.equal(alg.global_state[key], initial[key]), key
    a, b = cohort[:2]
    assert not torch.equal(alg.store.states[a]["features.block0.conv.weight"],
                           alg.store.states[b]["features.block0.conv.weight"])
    for client in cohort:  # a client's model: its own body with the global header
        local = alg.route(ClientTask(client), None).module.state_dict()
        for key in HEAD:
            assert torch.equal(local[key], alg.global_state[key]), key
        for key in body_keys:
            assert torch.equal(local[key], alg.store.states[client][key]), key
    unseen = next(c for c in range(ctx.num_clients) if c not in cohort)
    local = alg.route(ClientTask(unseen), None).module.state_dict()
    assert all(torch.equal(local[k], alg.global_state[k]) for k in initial)


def test_prototypes_of_an_absent_class_are_finite_and_never_sent(spec_factory):
    """A class a client does not hold has count 0 and a zero row (no 0/0), and the server's
    header steps see exactly the (client, class) pairs the clients hold."""
    from fl_lightning.algorithms.personalized.head_body import class_prototypes

    spec = spec_factory(name="absent", algorithm=FedGH(), train=TRAIN,
                        partition=PartitionConfig(method="dirichlet", num_clients=6, alpha=0.1),
                        federation=FederationConfig(rounds=1, clients_per_round=3))
    fed = federation(spec)
    alg, ctx = fed.algorithm, fed.ctx
    cohort = alg.plan(0).cohort
    held = {c: sorted(set(shard_tensors(ctx, c)[1].tolist())) for c in cohort}
    client = next(c for c in cohort if len(held[c]) < ctx.num_classes)
    shard = ctx.shards[client]
    protos, counts = class_prototypes(ctx.model, alg.header, shard.dataset, shard.indices, ctx.num_classes, 16,
                                      batch_stats=True)
    absent = [c for c in range(ctx.num_classes) if c not in held[client]]
    assert torch.isfinite(protos).all()
    assert all(counts[c] == 0 and not protos[c].any() for c in absent)
    assert torch.equal(counts, torch.bincount(shard_tensors(ctx, client)[1], minlength=ctx.num_classes).float())

    seen = []
    train_header = alg.train_header
    alg.train_header = lambda protos, labels, lr: (seen.append((protos.clone(), labels.clone())),
                                                   train_header(protos, labels, lr))
    fed.run_round(0)
    (protos, labels), = seen
    assert labels.tolist() == [c for client in cohort for c in held[client]]
    assert torch.isfinite(protos).all() and (protos.norm(dim=1) > 0).all()


def test_batch_statistics_ignore_and_keep_the_running_statistics(spec_factory):
    """Prototypes with batch statistics are the same whatever the running statistics hold,
    and leave them untouched; evaluation-mode prototypes follow the running statistics (the
    FedGH divergence: they were up to 100 times the training-mode features)."""
    from fl_lightning.algorithms.personalized.head_body import class_prototypes, find_classifier

    spec = spec_factory(name="bs", algorithm=FedGH(), train=TRAIN)
    ctx = federation(spec).ctx
    model = copy.deepcopy(ctx.model)
    _, classifier = find_classifier(model)
    shard = ctx.shards[0]

    def prototypes(batch_stats):
        return class_prototypes(model, classifier, shard.dataset, shard.indices, ctx.num_classes, 16,
                                batch_stats=batch_stats)[0]

    plain_batch, plain_eval = prototypes(True), prototypes(False)
    scramble_running_statistics(model)
    kept = buffers_of(model)
    assert torch.allclose(prototypes(True), plain_batch, atol=1e-5)
    assert all(torch.equal(v, kept[k]) for k, v in model.named_buffers())
    assert not torch.allclose(prototypes(False), plain_eval, atol=1e-2)
    x, y = shard_tensors(ctx, 0)
    features = batch_norm_features(model, x, 16)
    for c in set(y.tolist()):
        assert torch.allclose(plain_batch[c], features[y == c].mean(0), atol=1e-5)


def test_a_one_row_batch_joins_the_one_before():
    from fl_lightning.algorithms.personalized.head_body import without_single_rows

    rows = lambda n, v: (torch.full((n, 3), float(v)), torch.full((n,), v))  # noqa: E731
    joined = list(without_single_rows([rows(2, 0), rows(2, 1), rows(1, 2)]))
    assert [y.tolist() for _, y in joined] == [[0, 0], [1, 1, 2]]
    assert torch.equal(joined[1][0][2], torch.full((3,), 2.0))
    assert [y.tolist() for _, y in without_single_rows([rows(1, 5)])] == [[5]]


# -- FedAS ---------------------------------------------------------------------------------------
def hand_fisher(model, ctx, client, batch_size):
    """sum over the shard's batches (in order) of the squared norm of the batch-mean NLL's
    gradient with respect to every parameter, batch norm on each batch's statistics (training
    mode: ``model`` is a copy, its running statistics do not matter)."""
    x, y = shard_tensors(ctx, client)
    model.train()
    total = 0.0
    for a, b in batch_bounds(len(y), batch_size):
        xb, yb = x[a:b], y[a:b]
        nll = -torch.log_softmax(model(xb), dim=1)[torch.arange(len(yb)), yb].mean()
        grads = torch.autograd.grad(nll, list(model.parameters()))
        total += sum(float((g.double() ** 2).sum()) for g in grads)
    return total


def test_fedas_fisher_weights_and_aggregate(spec_factory):
    """Two clients: each one's Fisher trace recomputed on its trained model, and the aggregate
    ``sum_i F_i theta_i / sum_j F_j`` by hand."""
    spec = spec_factory(name="as", algorithm=FedAS(), train=TRAIN,
                        federation=FederationConfig(rounds=3, clients_per_round=2))
    fed = federation(spec)
    alg, ctx = fed.algorithm, fed.ctx
    cohort = alg.plan(0).cohort
    _, clients = fed.run_round(0)
    assert len(cohort) == 2
    fishers, states = [], []
    for client in cohort:
        model = copy.deepcopy(ctx.model)
        state = {k: v for k, v in alg.store.states[client].items() if k in alg.global_state}
        model.load_state_dict(state)
        fishers.append(hand_fisher(model, ctx, client, TRAIN.batch_size))
        states.append(state)
    logged = {r["client"]: r for r in clients}
    sizes = {k: v.numel() * v.element_size() for k, v in ctx.model.state_dict().items()}
    for client, fisher in zip(cohort, fishers):
        # traffic: the global body down (the head stays personal), the whole trained model up
        assert logged[client]["bytes_down"] == sum(n for k, n in sizes.items() if k not in HEAD)
        assert logged[client]["bytes_up"] == sum(sizes.values()) + 8  # and the Fisher trace, one float64
        assert logged[client]["fisher_bytes_up"] == 8
        assert logged[client]["fisher_trace"] == pytest.approx(fisher, rel=1e-6)
        assert logged[client]["align_loss"] > 0.0  # the within-class scatter around the prototypes
    weights = [f / sum(fishers) for f in fishers]
    assert 0.0 < weights[0] < 1.0 and weights[0] != pytest.approx(0.5, abs=1e-3)
    for key, value in alg.global_state.items():
        if value.is_floating_point():
            expected = sum(w * s[key].double() for w, s in zip(weights, states))
            assert torch.allclose(value.double(), expected, atol=1e-6), key


def test_fedas_alignment_moves_the_global_body_towards_the_local_prototypes(spec_factory):
    """The alignment pass updates the received global body only (head and BN statistics
    untouched), and lowers the alignment loss to the client's previous-model prototypes."""
    from fl_lightning.algorithms.personalized.fedas import align_body
    from fl_lightning.algorithms.personalized.head_body import class_prototypes

    spec = spec_factory(name="align", algorithm=FedAS(align_epochs=3), train=TRAIN,
                        federation=FederationConfig(rounds=2, clients_per_round=2))
    fed = federation(spec)
    alg, ctx = fed.algorithm, fed.ctx
    client = alg.plan(0).cohort[0]
    fed.run_round(0)
    shard = ctx.shards[client]
    alg.model.load(alg.store.kept(client, TRAINED), alg.global_state.keys())
    prototypes, counts = class_prototypes(alg.worker, alg.model.classifier, shard.dataset, shard.indices,
                                          ctx.num_classes, 16, batch_stats=True)
    alg.model.load(alg.global_state, alg.global_state.keys())
    x, y = shard_tensors(ctx, client)

    def loss_now():
        return float(alignment_loss(batch_norm_features(alg.worker, x, 16), y, prototypes, counts > 0))

    before = loss_now()
    align_body(alg.model, alg.alignment, shard, prototypes, counts > 0, torch.Generator().manual_seed(0))
    after = loss_now()
    assert after < before
    aligned = alg.worker.state_dict()
    params = {n for n, _ in alg.worker.named_parameters()}
    for key, value in alg.global_state.items():
        same = torch.equal(aligned[key], value)
        assert same == (key in HEAD or key not in params), key


def test_fedas_alignment_and_fisher_do_not_follow_the_running_statistics(spec_factory):
    """The alignment pass and the Fisher trace run batch norm on batch statistics: with the
    running statistics scrambled (what a few local steps leave) they give the same result and
    leave the statistics as they were. In evaluation mode the alignment diverged (loss 2.2e27)
    and one round's traces spanned five orders of magnitude."""
    from fl_lightning.algorithms.personalized.fedas import align_body, fisher_trace

    spec = spec_factory(name="asbn", algorithm=FedAS(align_epochs=2), train=TRAIN,
                        federation=FederationConfig(rounds=1, clients_per_round=2))
    fed = federation(spec)
    alg, ctx = fed.algorithm, fed.ctx
    client = 0
    shard = ctx.shards[client]
    x, y = shard_tensors(ctx, client)
    prototypes = torch.stack([batch_norm_features(ctx.model, x, 16)[y == c].mean(0) if (y == c).any()
                              else torch.zeros(alg.model.classifier.in_features) for c in range(ctx.num_classes)])
    present = torch.bincount(y, minlength=ctx.num_classes) > 0

    def aligned(scrambled):
        alg.model.load(alg.init_state, alg.global_state.keys())
        if scrambled:
            scramble_running_statistics(alg.worker)
        kept = buffers_of(alg.worker)
        loss = align_body(alg.model, alg.alignment, shard, prototypes, present, torch.Generator().manual_seed(0))
        assert all(torch.equal(v, kept[k]) for k, v in alg.worker.named_buffers())
        trace = fisher_trace(alg.worker, shard.dataset, shard.indices, 16)
        assert all(torch.equal(v, kept[k]) for k, v in alg.worker.named_buffers())
        return loss, trace, {n: p.detach().clone() for n, p in alg.worker.named_parameters()}

    loss, trace, params = aligned(False)
    loss_s, trace_s, params_s = aligned(True)
    assert 0.0 < loss < 10.0 and loss_s == pytest.approx(loss, rel=1e-5)
    assert trace_s == pytest.approx(trace, rel=1e-4)
    assert all(torch.allclose(params_s[n], p, atol=1e-6) for n, p in params.items())
    assert not torch.equal(params["features.block0.conv.weight"], alg.init_state["features.block0.conv.weight"])


def test_fedas_alignment_loss_is_the_summed_per_class_mse():
    torch.manual_seed(0)
    features, labels = torch.randn(7, 4), torch.tensor([0, 2, 2, 1, 0, 2, 3])
    prototypes, present = torch.randn(4, 4), torch.tensor([True, True, True, False])
    expected = sum(((features[labels == c] - prototypes[c]) ** 2).mean() for c in (0, 1, 2))
    assert torch.allclose(alignment_loss(features, labels, prototypes, present), expected)


# -- FedMut --------------------------------------------------------------------------------------
def test_fedmut_sends_balanced_mutations_along_the_last_update(spec_factory):
    """Round 0 sends the global model itself; round 1 sends w_g + alpha v_i (w_g - w_prev) with
    one sign per layer (parameter tensor), each layer's signs summing to zero over the cohort;
    buffers (batch-norm statistics) are sent as they are."""
    alpha = 4.0
    spec = spec_factory(name="mut", algorithm=FedMut(alpha=alpha), train=TRAIN,
                        federation=FederationConfig(rounds=2, clients_per_round=4))
    fed = federation(spec)
    alg = fed.algorithm
    previous = {k: v.clone() for k, v in alg.global_state.items()}
    plan = alg.plan(0)
    for task in plan.tasks:
        local = alg.route(task, plan).module.state_dict()
        assert all(torch.equal(local[k], previous[k]) for k in previous)
    fed.run_round(0)
    current = {k: v.clone() for k, v in alg.global_state.items()}
    plan = alg.plan(1)
    copies = [{k: v.clone() for k, v in alg.route(task, plan).module.state_dict().items()} for task in plan.tasks]
    params = {name for name, _ in alg.ctx.model.named_parameters()}
    floating = [k for k, v in current.items() if v.is_floating_point() and k in params]
    assert len(floating) > 10 and "features.block0.bn.weight" in floating
    signs = torch.zeros(len(copies), len(floating))
    for j, key in enumerate(floating):
        delta = current[key] - previous[key]
        big = delta.abs() > 1e-3
        assert big.any(), key
        for i, local in enumerate(copies):
            s = float(((local[key] - current[key])[big] / (alpha * delta[big])).mean().round())
            assert s in (-1.0, 1.0)
            assert torch.allclose(local[key], current[key] + alpha * s * delta, rtol=0, atol=1e-6), key
            signs[i, j] = s
        mutation = sum(local[key] - current[key] for local in copies)
        assert torch.allclose(mutation, torch.zeros_like(mutation), atol=1e-5), key
    assert (signs.sum(0) == 0).all()  # balanced in every layer
    assert len({tuple(col.tolist()) for col in signs.T}) > 1  # drawn per layer
    for key, value in current.items():
        if key not in params:  # running statistics and counters: never mutated by default
            assert all(torch.equal(local[key], value) for local in copies), key
    assert "features.block0.bn.running_var" in current
    again = alg.plan(1)  # the same draw again: signs depend on (seed, round) only
    assert [t.client for t in again.tasks] == [t.client for t in plan.tasks]
    assert all(torch.equal(a.choice.signs, b.choice.signs) for a, b in zip(again.tasks, plan.tasks))


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_fedmut_mutations_cancel_in_the_aggregate_only_with_equal_weights(spec_factory, weighting):
    """The aggregate of the mutated copies, weighted as the server weighs the returned models,
    is the global model itself under the default equal weights (the official code's plain
    mean), although the clients' shards differ in size; sample weights leave a residual
    mutation ``alpha sum_i n_i v_i / n`` of the last update."""
    algorithm = FedMut() if weighting == "uniform" else FedMut(weighting=weighting)  # uniform: the default
    spec = spec_factory(name=f"cancel_{weighting}", algorithm=algorithm, train=TRAIN,
                        federation=FederationConfig(rounds=2, clients_per_round=4))
    fed = federation(spec)
    alg, ctx = fed.algorithm, fed.ctx
    fed.run_round(0)
    plan = alg.plan(1)
    sizes = [len(ctx.shards[t.client]) for t in plan.tasks]
    assert len(set(sizes)) > 1
    weights = [alg.weight(SimpleNamespace(num_samples=n)) for n in sizes]
    offsets = []
    for task in plan.tasks:
        local = alg.route(task, plan).module.state_dict()
        offsets.append({k: (local[k] - alg.global_state[k]).double() for k in alg.mutated_keys})
    residual = max(float(sum(w * o[k] for w, o in zip(weights, offsets)).abs().max() / sum(weights))
                   for k in alg.mutated_keys)
    if weighting == "uniform":
        assert weights == [1.0] * len(sizes) and residual < 1e-6
    else:
        assert weights == [float(n) for n in sizes] and residual > 1e-3


def test_balanced_signs_odd_cohorts_and_acceleration():
    signs = balanced_signs(torch.Generator().manual_seed(1), 5, 40)
    idle = [i for i in range(5) if (signs[i] == 0).all()]
    assert len(idle) == 1 and (signs.sum(0) == 0).all() and ((signs != 0).sum(0) == 4).all()
    fast = balanced_signs(torch.Generator().manual_seed(1), 4, 3, negative=-0.7)
    assert ((fast == 1).sum(0) == 2).all() and ((fast == -0.7).sum(0) == 2).all()
    mut = FedMut(acc_rate=0.3, acc_rounds=50)
    assert mut.negative_weight(1) == pytest.approx(-0.7) and mut.negative_weight(26) == pytest.approx(-0.85)
    assert mut.negative_weight(51) == -1.0 and FedMut().negative_weight(1) == -1.0


# -- resume --------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", [FedGH, FedAS, FedMut], ids=["fedgh", "fedas", "fedmut"])
def test_resume_is_bit_exact(spec_factory, algorithm):
    """Per-client bodies (FedGH), local models (FedAS) and the previous global model (FedMut)
    survive a stop and resume: the resumed run ends with the uninterrupted run's tensors."""
    train = LocalTrainConfig(epochs=1, batch_size=16, lr=0.05, lr_schedule="cosine")
    fed = FederationConfig(rounds=4, clients_per_round=3)
    whole = spec_factory(name="whole", algorithm=algorithm(), train=train, federation=fed)
    run_fit(whole)
    part = spec_factory(name="part", algorithm=algorithm(), train=train, federation=fed)
    part.stop_after = 2
    run_fit(part)
    assert saved(part)["round"] == 2
    resumed = copy.copy(part)
    resumed.stop_after = None
    resumed.algorithm = algorithm()
    resumed.resume_from = str(Path(part.out_dir) / "part" / "checkpoints" / "last.ckpt")
    run_fit(resumed)
    a, b = saved(whole), saved(resumed)
    for section in ("model", "algorithm"):
        assert a[section].keys() == b[section].keys()
        for key, value in a[section].items():
            assert torch.equal(value, b[section][key]), (section, key)
    assert [r["round"] for r in rows(part, "metrics.jsonl")] == [0, 1, 2, 3]


# -- bad options ---------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm, options, key", [
    ("FedBABU", dict(finetune_epochs=-1), "algorithm.finetune_epochs"),
    ("FedBABU", dict(finetune_part="body"), "algorithm.finetune_part"),
    ("FedBABU", dict(finetune_lr=0.0), "algorithm.finetune_lr"),
    ("FedBABU", dict(finetune_lr_scale=0.0), "algorithm.finetune_lr_scale"),
    ("FedBABU", dict(finetune_weight_decay=-1e-4), "algorithm.finetune_weight_decay"),
    ("FedGH", dict(server_lr=-0.1), "algorithm.server_lr"),
    ("FedGH", dict(server_epochs=0), "algorithm.server_epochs"),
    ("FedGH", dict(server_batch_size=0), "algorithm.server_batch_size"),
    ("FedAS", dict(align_lr=float("nan")), "algorithm.align_lr"),
    ("FedAS", dict(align_epochs=-1), "algorithm.align_epochs"),
    ("FedAS", dict(align_batch_size=0), "algorithm.align_batch_size"),
    ("FedMut", dict(alpha=-1.0), "algorithm.alpha"),
    ("FedMut", dict(acc_rate=1.0), "algorithm.acc_rate"),
    ("FedMut", dict(acc_rounds=0), "algorithm.acc_rounds"),
    ("FedMut", dict(weighting="median"), "algorithm.weighting"),
])
def test_bad_options_are_one_line_config_errors(algorithm, options, key):
    error = option_refusal(algorithm, **options)
    assert error.key == key
    assert "\n" not in str(error) and str(error).startswith(f"{key}: ")


def test_evaluate_rescores_a_personalized_method_with_its_client_state(tmp_path, capsys):
    """FedGH's test figure averages each client's own body with the global header: best.ckpt
    carries the per-client state, so ``evaluate`` reproduces the summary's best figure and the
    final evaluation does not mix the best round's header with the last round's bodies."""
    from fl_lightning.cli import main

    config = tmp_path / "fedgh.yaml"
    config.write_text(
        "name: gh\nseed: 0\ndata: {dataset: {class_path: fl_lightning.data.Digits}, val_size: 100}\n"
        "partition: {method: dirichlet, num_clients: 6, alpha: 0.5}\nmodel: {class_path: fl_lightning.elastic.models.CNN}\n"
        "algorithm: {class_path: fl_lightning.algorithms.FedGH}\n"
        "train: {epochs: 1, batch_size: 16, lr: 0.05}\nfederation: {rounds: 4, clients_per_round: 6}\n"
        "eval: {every: 1}\nfabric: {accelerator: cpu}\n")
    assert main(["fit", "--config", str(config), "--out_dir", str(tmp_path / "runs")]) == 0
    summary = json.loads((tmp_path / "runs" / "gh" / "summary.json").read_text())
    capsys.readouterr()
    assert main(["evaluate", "--run", str(tmp_path / "runs" / "gh"), "--fabric.accelerator", "cpu"]) == 0
    out = capsys.readouterr().out
    evaluated = json.loads(out[out.rindex("{\n"):])
    assert evaluated["test_acc"] == pytest.approx(summary["best"]["test_acc"])
    assert "algorithm" in load_checkpoint(tmp_path / "runs" / "gh" / "checkpoints" / "best.ckpt")
