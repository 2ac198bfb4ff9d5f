"""FedSGA as docs/fedsga.md describes it: reductions to SplitFed, the logged cut against Psi,
the server loss and where its gradients go, harmonizer aggregation, ranks and resume."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fl_lightning.algorithms import FedSGA, SplitFed
from fl_lightning.config import BudgetConfig, FederationConfig, LocalTrainConfig, PartitionConfig
from fl_lightning.runtime.channel import Channel
from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.federation.loop import run_fit
from fl_lightning.elastic.models import ResNet18

RESNET = {"class_path": "fl_lightning.elastic.models.ResNet18", "init_args": {"width": 0.125}}
VIT = {"class_path": "fl_lightning.elastic.models.ViT", "init_args": {"patch_size": 2, "embed_dim": 16, "depth": 4, "num_heads": 2}}
# batch 64: three or four steps per client and epoch keep the runs short, while the clients'
# sample counts stay unequal (sample-weighted averages differ from plain ones)
TRAIN = LocalTrainConfig(epochs=1, batch_size=64, lr=0.05, momentum=0.9)


def saved(spec):
    """The run's last checkpoint; load it once per test (each call reads and unpickles the whole file)."""
    return load_checkpoint(Path(spec.out_dir) / spec.name / "checkpoints" / "last.ckpt")


def assert_same_state(expected, got):
    """Two checkpoints hold bit-identical model and algorithm state, tensor by tensor."""
    for section in ("model", "algorithm"):
        assert expected[section].keys() == got[section].keys(), section
        for key, value in expected[section].items():
            assert torch.equal(value, got[section][key]), (section, key)


def rows(spec, name):
    return [json.loads(line) for line in (Path(spec.out_dir) / spec.name / name).read_text().splitlines()]


def fedsga(**kw):
    options = dict(calibration_every=2, probe_size=8, prompt_width=1)
    options.update(kw)
    return FedSGA(**options)


def open_federation(spec):
    from lightning.fabric import Fabric

    from fl_lightning.federation.loop import Federation
    from fl_lightning.federation.run_dir import RunDir

    fed = Federation(Fabric(accelerator="cpu", devices=1), spec, RunDir(spec.out_dir, spec.name))
    fed._open_outputs()
    return fed


SPLITFED = {"splitfed_v2": lambda: SplitFed(cut="layer2.1", version="v2"),
            "splitfed_v1": lambda: SplitFed(cut="layer2.1", version="v1")}


def reference(shared_run, method, stop_after=None):
    """The 1-rank run of ``method`` that several tests compare against (run once): SplitFed V1/V2
    at layer2.1 for 3 rounds, FedSGA (ResNet or ViT) for 4 rounds (calibrations in rounds 1 and
    3), 4 of 6 clients a round; ``stop_after``: the same run stopped after that many rounds."""
    key = method if stop_after is None else f"{method}_stopped_after_{stop_after}"
    if method in SPLITFED:
        return shared_run(key, method, SPLITFED[method], model=RESNET, train=TRAIN, stop_after=stop_after,
                          federation=FederationConfig(rounds=3, clients_per_round=4))[0]
    model = {"fedsga": RESNET, "fedsga_vit_token_prompts": VIT}[method]
    return shared_run(key, method, fedsga, model=model, train=TRAIN, stop_after=stop_after,
                      federation=FederationConfig(rounds=4, clients_per_round=4))[0]


@pytest.mark.parametrize("server_model, version", [("shared", "v2"), ("copy", "v1")])
def test_without_its_components_fedsga_is_splitfed_bit_for_bit(spec_factory, shared_run, server_model, version):
    """A static cut, no prompts and no harmonization: what is left is SplitFed with the same
    server semantics (the probe still learns, on detached interfaces, and changes nothing)."""
    b = reference(shared_run, f"splitfed_{version}")
    reduced = fedsga(split_strategy="static", static_cut="layer2.1", adaptation_channel=False, harmonizer=False,
                     server_model=server_model, respect_budgets=False)
    a = spec_factory(name="sga", algorithm=reduced, model=RESNET, train=TRAIN, federation=b.federation)
    run_fit(a)
    got, expected = saved(a)["model"], saved(b)["model"]
    assert got.keys() == expected.keys()
    for key, value in got.items():
        assert torch.equal(value, expected[key]), key
    accuracy = [r["test_acc"] for r in rows(a, "metrics.jsonl")]
    assert accuracy == [r["test_acc"] for r in rows(b, "metrics.jsonl")]


def test_logged_cut_is_psi_of_the_logged_r_within_the_budget(spec_factory):
    """Budgets between the second and third fronts' costs for some clients: every logged cut is
    Psi(r) = clamp(round((1 - r + rho)(K - 1))), capped at the deepest affordable candidate,
    recomputed here from fvcore's count of each front and the saved budgets."""
    from fl_lightning.elastic.macs import count_macs
    from fl_lightning.elastic.models import build_model

    partition = PartitionConfig(method="dirichlet", num_clients=6, alpha=0.5,
                                budgets=BudgetConfig(zipf_s=1.2, b_min=3.0e5, b_max=6.0e5, b_cap=6.0e5))
    rho = 0.1
    # one local step a client: the test is of the cut rule, not of training; the hand-crafted
    # score spreads r over [0.2, 0.75] here, so Psi asks for both the middle cut and the deepest
    # one, which the budget forbids some clients
    spec = spec_factory(name="psi", algorithm=fedsga(rho=rho, sufficiency_estimator=False), model=RESNET,
                        train=dataclasses.replace(TRAIN, steps=1),
                        partition=partition, federation=FederationConfig(rounds=5, clients_per_round=6))
    run_fit(spec)
    budgets = load_checkpoint(Path(spec.out_dir) / spec.name / "partition.pt")["budgets"].tolist()
    model = build_model(ResNet18, 10, (1, 8, 8), width=0.125)
    cuts = ["layer1.1", "layer2.1", "layer3.1"]
    macs = [count_macs(model.split(cut)[0], (1, 8, 8)) for cut in cuts]
    afford = [max(k for k, m in enumerate(macs) if m <= b) for b in budgets]
    assert set(afford) == {1, 2}  # some clients cannot afford the deepest cut
    decided = [r for r in rows(spec, "clients.jsonl") if "r" in r]
    capped = 0
    for r in decided:
        k = int(torch.floor(torch.tensor((1 - r["r"] + rho) * 2 + 0.5, dtype=torch.float64)))
        assert r["cut"] == min(max(k, 0), 2, afford[r["client"]]), r
        capped += min(max(k, 0), 2) > afford[r["client"]]
    assert decided and capped  # the budget cap bound on some decided client
    assert {min(max(int((1 - r["r"] + rho) * 2 + 0.5), 0), 2) for r in decided} == {1, 2}
    for r in rows(spec, "clients.jsonl"):
        assert r["cut"] <= afford[r["client"]]


def hand_projection(harmonizer, z, depth):
    """The harmonizer's projection written out: pooled, each example standardized over its own
    channels (biased variance), zero-padded, joined with the depth embedding, two linear layers,
    unit norm."""
    pooled = z.mean(dim=(2, 3)).double()
    pooled = (pooled - pooled.mean(1, keepdim=True)) / torch.sqrt(pooled.var(1, unbiased=False, keepdim=True) + 1e-5)
    padded = torch.cat([pooled, torch.zeros(len(z), harmonizer.in_width - pooled.shape[1], dtype=torch.float64)], 1)
    x = torch.cat([padded, harmonizer.depth_embedding.weight[depth].double().expand(len(z), -1)], 1)
    first, second = harmonizer.projector[0], harmonizer.projector[2]
    hidden = torch.relu(x @ first.weight.double().t() + first.bias.double())
    out = hidden @ second.weight.double().t() + second.bias.double()
    return out / out.norm(dim=1, keepdim=True)


@pytest.mark.parametrize("prompt_gradient, readout", [("all", "server_head"), ("task", "server_head"),
                                                      ("all", "additive"), ("all", "additive_bias")])
def test_server_loss_is_ce_plus_lambda_align_and_the_gradients_reach_front_and_prompt(spec_factory, prompt_gradient,
                                                                                      readout):
    """One batch through a client pair at p1, prototypes of the previous rounds set for every
    class but one: the server loss equals CE(back(z)) + lambda CE(Z C^T / tau_a) over the
    examples whose class has a prototype (the default read-out; with an additive one
    CE(back(z) + W Z [+ b])), in float64 by hand; the front's gradient holds the alignment term,
    and the prompt's holds it with ``prompt_gradient: all`` (the default) and not with ``task``."""
    spec = spec_factory(name="loss", algorithm=fedsga(lambda_align=0.5, prompt_gradient=prompt_gradient,
                                                      readout=readout),
                        model=RESNET, train=TRAIN,
                        federation=FederationConfig(rounds=1, clients_per_round=2))
    fed = open_federation(spec)
    algorithm, ctx = fed.algorithm, fed.ctx
    head = algorithm.harmonizer.head
    assert (head is None) == (readout == "server_head")
    assert (head is not None and head.bias is not None) == (readout == "additive_bias")
    with torch.no_grad():
        if head is not None:  # a head that is not zero, so W Z (and b) count
            head.weight.normal_(0, 0.1)
            if head.bias is not None:
                head.bias.normal_(0, 0.1)
        prototypes = F.normalize(torch.randn(10, algorithm.harmonizer.prototypes.shape[1]), dim=1)
        algorithm.harmonizer.prototypes.copy_(prototypes)
        algorithm.harmonizer.has_prototype.fill_(1.0)
    plan = algorithm.plan(0)
    task = plan.tasks[0]
    task.choice, task.cut = dataclasses.replace(task.choice, index=0), "layer1.1"
    state = algorithm.store.get(task.client)
    with torch.no_grad():
        state["prompt"].normal_(0, 0.1)
    x, y = next(ctx.shards[task.client].steps(1, torch.Generator().manual_seed(0)))
    unknown = int(y[0])  # one class without a prototype: its examples are left out of the alignment

    def fresh_pair():  # both halves, the harmonizer and the prompt (from the store) as the round starts
        downlink = Channel().deliver(algorithm.downlink(task, plan))  # loads the halves and the harmonizer
        algorithm.harmonizer_worker.has_prototype[unknown] = 0.0
        client = algorithm.new_client(task, plan)
        client.begin(downlink)
        return client, algorithm.engine.build_pair(client, downlink.model.module)

    _, pair = fresh_pair()
    z = pair.client_forward(x)
    sent = z.detach().requires_grad_()
    h = algorithm.harmonizer_worker
    _, back = algorithm.engine.server_worker.split("layer1.1")
    with torch.no_grad():
        features = hand_projection(h, sent, 0)
        logits = back(sent).double()
        if h.head is not None:
            logits = logits + features @ h.head.weight.double().t()
            if h.head.bias is not None:
                logits = logits + h.head.bias.double()
        known = torch.tensor([c for c in range(10) if c != unknown])
        scored = y != unknown
        align_logits = features[scored] @ prototypes[known].double().t() / 0.5
        targets = torch.searchsorted(known, y[scored])
        expected = F.cross_entropy(logits, y) + 0.5 * F.cross_entropy(align_logits, targets)
    loss = pair.server_loss(sent, y)
    assert abs(float(loss.detach()) - float(expected)) <= 1e-5 * max(1.0, abs(float(expected)))

    # where the gradients go: one server step, then the client's backward from the cut
    from fl_lightning.modules.split import SplitFit, split_step

    prompt0 = state["prompt"].clone()

    client, pair = fresh_pair()
    fit = SplitFit(len(y))
    split_step(pair, client.server_rule)(ctx.fabric, 0, x, y, fit, ctx.train)
    front = pair.client_module
    assert torch.equal(state["prompt"], prompt0)  # the store's prompt is untouched until the commit
    prompt_grad = client.prompt.grad.detach().clone()
    front_grad = {n: p.grad.detach().clone() for n, p in front.named_parameters()}
    assert fit.cut_bytes_down == sent.numel() * 4
    # with the prompt kept from the alignment term, that term's gradient crosses too
    assert fit.channel.total("down", "align") == (sent.numel() * 4 if prompt_gradient == "task" else 0)

    # the same gradients by autograd through the composed network, from the same weights
    client, fresh = fresh_pair()
    z = fresh.client_forward(x)
    total = client.server_loss(back, z, y)
    align = client.align_term
    expected_prompt, = torch.autograd.grad(total - align if prompt_gradient == "task" else total,
                                           client.prompt, retain_graph=True)
    other_prompt, = torch.autograd.grad(total if prompt_gradient == "task" else total - align,
                                        client.prompt, retain_graph=True)
    align_only = torch.autograd.grad(align, list(front.parameters()), retain_graph=True, allow_unused=True)
    grads = torch.autograd.grad(total, list(front.parameters()))
    assert torch.allclose(prompt_grad, expected_prompt, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(prompt_grad, other_prompt, rtol=1e-4, atol=1e-6)  # the alignment part counts
    for (n, _), g in zip(front.named_parameters(), grads):
        assert torch.allclose(front_grad[n], g, rtol=1e-4, atol=1e-6), n
    assert any(g is not None and g.abs().sum() > 0 for g in align_only)  # the alignment term reaches the front


def test_copied_harmonizers_average_by_hand(spec_factory):
    """server_model: copy: the projector is the sample-weighted mean of the clients' copies; each
    prototype (the first round: no EMA yet) is the normalized mean projected feature of its class
    over every client's examples, i.e. the clients' class sums over their class counts."""
    spec = spec_factory(name="avg", algorithm=fedsga(server_model="copy"), model=RESNET, train=TRAIN,
                        federation=FederationConfig(rounds=1, clients_per_round=3))
    fed = open_federation(spec)
    algorithm = fed.algorithm
    seen = []
    commit = algorithm.commit

    def recording(acc, task, result, plan):
        seen.append((float(result.num_samples), result.payload.class_counts.clone(),
                     {k: v.detach().double().clone() for k, v in algorithm.harmonizer_worker.state_dict().items()},
                     result.payload.class_sums.clone()))
        commit(acc, task, result, plan)
    algorithm.commit = recording
    fed.run_round(0)
    assert len(seen) == 3
    total = sum(n for n, _, _, _ in seen)
    h = algorithm.harmonizer.state_dict()
    for key in h:
        if key in ("prototypes", "has_prototype") or not h[key].is_floating_point():
            continue
        expected = sum(n * s[key] for n, _, s, _ in seen) / total
        assert torch.allclose(h[key].double(), expected, rtol=1e-5, atol=1e-6), key
    counts = sum(c for _, c, _, _ in seen)
    assert len({tuple(c.tolist()) for _, c, _, _ in seen}) == 3  # unequal class counts
    for k in range(len(counts)):
        if counts[k] == 0:
            assert h["has_prototype"][k] == 0
            continue
        mean = sum(sums[k] for _, _, _, sums in seen) / counts[k]
        assert torch.allclose(h["prototypes"][k].double(), mean / mean.norm(), atol=1e-5), k


def test_without_harmonization_the_held_out_probes_beat_chance(spec_factory):
    """The w/o Harmon. row keeps the estimator's signal: in the calibration round the probes,
    refit on the first half of every client's probe batch through the model the round received,
    score the held-out half below the uniform guess ln 10 = 2.303 at both depths (probes fit on
    an earlier model and scored on this one read at or above it)."""
    import math

    spec = spec_factory(name="probe", algorithm=fedsga(harmonizer=False, probe_size=16), model=RESNET, train=TRAIN,
                        federation=FederationConfig(rounds=2, clients_per_round=6))
    run_fit(spec)
    calibrated = [r for r in rows(spec, "metrics.jsonl") if "calibration/probe_loss_p1" in r]
    assert [r["round"] for r in calibrated] == [1]
    for key in ("calibration/probe_loss_p1", "calibration/probe_loss_ref"):
        assert calibrated[0][key] < math.log(10) - 0.1, key
    assert 0.0 <= calibrated[0]["calibration/frac_sufficient"] <= 1.0


def test_calibration_and_descriptor_uploads_are_counted(spec_factory):
    spec = spec_factory(name="bytes", algorithm=fedsga(prompt_gradient="task"), model=RESNET, train=TRAIN,
                        federation=FederationConfig(rounds=2, clients_per_round=3))
    run_fit(spec)
    from fl_lightning.elastic.models import build_model

    model = build_model(ResNet18, 10, (1, 8, 8), width=0.125)
    x = torch.zeros(1, 1, 8, 8)
    p1 = model.forward_until(x, "layer1.1").numel() * 4
    ref = model.forward_until(x, "layer2.1").numel() * 4
    for r in rows(spec, "clients.jsonl"):
        # every round: the received model's probe-batch interfaces at p1 and p_ref and the labels
        # (the probes' data, and in calibration rounds the probe losses' too), then the trained
        # front's shallow interface (the descriptors)
        assert r["probe_bytes_up"] == 8 * (p1 + ref + 8) + 8 * p1
        assert "calibration_bytes_up" not in r
        extra = r["probe_bytes_up"]
        assert r["model_bytes_up"] == r["model_bytes_down"] > 0
        assert r["bytes_up"] == r["cut_bytes_up"] + r["model_bytes_up"] + extra
        # with the prompt kept from the alignment term, its gradient at the cut goes down beside
        # every cut gradient: the same shape, so the same bytes
        assert r["align_bytes_down"] == r["cut_bytes_down"] > 0
        assert r["bytes_down"] == r["cut_bytes_down"] + r["model_bytes_down"] + r["align_bytes_down"]


@pytest.mark.parametrize("method", ["fedsga", "splitfed_v2"])
def test_two_ranks_equal_one_rank(spec_factory, shared_run, fit_on_ranks, method):
    """The first two rounds' clients (FedSGA: a warm-up and a calibration round) spread over two
    forked gloo ranks give the 1-rank model and state."""
    one = reference(shared_run, method, stop_after=2)
    two = spec_factory(name=method, algorithm=fedsga() if method == "fedsga" else SPLITFED[method](), model=RESNET,
                       train=TRAIN, federation=one.federation, stop_after=2,
                       fabric=dataclasses.replace(one.fabric, devices=2, strategy="ddp_fork"))
    fit_on_ranks(two)
    assert_same_state(saved(one), saved(two))


@pytest.mark.parametrize("method", ["fedsga", "fedsga_vit_token_prompts", "splitfed_v2", "splitfed_v1"])
def test_resume_is_exact(spec_factory, shared_run, method):
    """Stopped after round 2 and resumed: the uninterrupted run's model and state (FedSGA's
    resumed rounds hold a calibration, which reads the estimator's saved state)."""
    import shutil

    whole, part = reference(shared_run, method), reference(shared_run, method, stop_after=2)
    assert load_checkpoint(Path(part.out_dir) / method / "checkpoints" / "last.ckpt")["round"] == 2
    resumed = spec_factory(name=method, algorithm=(SPLITFED[method] if method in SPLITFED else fedsga)(),
                           model=whole.model, train=TRAIN, federation=whole.federation)
    shutil.copytree(Path(part.out_dir) / method, Path(resumed.out_dir) / method)  # the shared folder stays as it is
    resumed.resume_from = str(Path(resumed.out_dir) / method / "checkpoints" / "last.ckpt")
    run_fit(resumed)
    assert_same_state(saved(whole), saved(resumed))


def test_the_p1_probe_does_not_depend_on_how_many_clients_trained_at_p1(spec_factory):
    """The depth probes are refit each round on every cohort client's received-model interfaces,
    whatever cut each client then trains at: after round 0 (same received model, cohort and
    probe batches), the static strategy (no client at p1) and the random one (about half at p1)
    hold the same probes. Probes trained only by the clients cut at a depth would differ."""
    fits, at_p1 = {}, {}
    for strategy in ("static", "random"):
        spec = spec_factory(name=strategy, algorithm=fedsga(split_strategy=strategy), model=RESNET, train=TRAIN,
                            federation=FederationConfig(rounds=1, clients_per_round=6))
        fed = open_federation(spec)
        initial = {k: v.clone() for k, v in fed.algorithm.probes.state_dict().items()}
        _, clients = fed.run_round(0)
        at_p1[strategy] = sum(r["cut"] == 0 for r in clients)
        fits[strategy] = {k: v.clone() for k, v in fed.algorithm.probes.state_dict().items()}
        assert any(not torch.equal(fits[strategy][k], initial[k]) for k in initial)  # the round fitted them
    assert at_p1["static"] == 0 and at_p1["random"] >= 2
    assert fits["static"].keys() == fits["random"].keys()
    for key in fits["static"]:
        torch.testing.assert_close(fits["static"][key], fits["random"][key], rtol=0, atol=0, msg=key)


def test_a_client_cut_at_p1_receives_the_front_to_p_ref_for_its_probes(spec_factory):
    """A client splitting at p1 computes the received model's interfaces at p1 and p_ref, so it
    receives the front up to p_ref (counted down) and sends back only what it trained, the front
    to p1 (counted up): under sbn, the exchanged (non-statistics) tensors of each front."""
    from fl_lightning.elastic.bn import statistics_keys
    from fl_lightning.elastic.models import build_model
    from fl_lightning.elastic.split import split_keys

    spec = spec_factory(name="p1", algorithm=fedsga(split_strategy="static", static_cut="layer1.1"), model=RESNET,
                        train=dataclasses.replace(TRAIN, steps=1), federation=FederationConfig(rounds=1, clients_per_round=3))
    run_fit(spec)
    model = build_model(ResNet18, 10, (1, 8, 8), width=0.125)
    state, unsent = model.state_dict(), statistics_keys(model)

    def front_bytes(cut):
        return sum(state[k].numel() * 4 for k in split_keys(model, cut)[0] if k not in unsent)

    assert front_bytes("layer1.1") < front_bytes("layer2.1")
    for r in rows(spec, "clients.jsonl"):
        assert r["cut"] == 0
        assert r["model_bytes_down"] == front_bytes("layer2.1")
        assert r["model_bytes_up"] == front_bytes("layer1.1")
