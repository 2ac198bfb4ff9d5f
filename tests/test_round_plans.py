"""The round-plan interface: plans the loop follows, client fits that report their own
metrics, non-finite clients left out, sequential-client methods on several ranks."""

import json
import math
from pathlib import Path

import pytest
import torch

from fl_lightning.algorithms import FedAvg
from fl_lightning.algorithms.client import LocalClient
from fl_lightning.cli import main
from fl_lightning.config import FederationConfig, LocalTrainConfig
from fl_lightning.elastic.routing import Routed
from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.federation.loop import run_fit
from fl_lightning.runtime import ClientTask, RoundPlan


class FixedCohort(FedAvg):
    """Trains the given clients every round, each with its own learning-rate factor, and adds a
    metric of its own to every client's row."""

    def __init__(self, clients, lr_factor=None):
        super().__init__()
        self.clients, self.lr_factor = list(clients), dict(lr_factor or {})

    def plan(self, round_idx):
        tasks = [ClientTask(c, choice=self.lr_factor.get(c, 1.0)) for c in self.clients]  # the lr factor
        return RoundPlan(round_idx, self.round_lr(round_idx), tasks)

    def new_client(self, task, plan):
        return ScaledLrClient(self.client_round(task, plan))

    def client_figures(self, task, result, plan):
        return {"weight_norm": float(sum(p.detach().pow(2).sum() for p in result.model.module.parameters()))}


class ScaledLrClient(LocalClient):
    """Local training at the round's rate times the task's factor (its ``choice``)."""

    def objective(self, downlink):
        module = super().objective(downlink)
        module.lr = self.round.lr * self.task.choice
        return module


def rows(spec, name):
    path = Path(spec.out_dir) / spec.name / name
    return [json.loads(line) for line in path.read_text().splitlines()]


def model_of(spec):
    return load_checkpoint(Path(spec.out_dir) / spec.name / "checkpoints" / "last.ckpt")["model"]


def test_loop_follows_the_plan_and_logs_the_fit_metrics(spec_factory):
    spec = spec_factory(name="fixed", algorithm=FixedCohort([4, 1]),
                        federation=FederationConfig(rounds=2, clients_per_round=3))
    run_fit(spec)
    clients = rows(spec, "clients.jsonl")
    assert [(r["round"], r["client"]) for r in clients] == [(0, 4), (0, 1), (1, 4), (1, 1)]
    assert all(r["weight_norm"] > 0 for r in clients)
    metrics = rows(spec, "metrics.jsonl")
    for m in metrics:
        mine = [r for r in clients if r["round"] == m["round"]]
        assert m["sum/weight_norm"] == pytest.approx(sum(r["weight_norm"] for r in mine))
        assert m["clients"] == 2


def test_a_diverging_client_is_left_out_and_logged(spec_factory):
    """Client 1 trains with a learning rate that overflows; the round goes on without it, so
    the model equals a run whose plan never had client 1."""
    train = LocalTrainConfig(epochs=1, batch_size=16, lr=0.05)
    diverging = spec_factory(name="div", algorithm=FixedCohort([0, 1, 2], lr_factor={1: 1e30}), train=train,
                             federation=FederationConfig(rounds=2, clients_per_round=3))
    summary = run_fit(diverging)
    without = spec_factory(name="without", algorithm=FixedCohort([0, 2]), train=train,
                           federation=FederationConfig(rounds=2, clients_per_round=3))
    run_fit(without)
    for key, value in model_of(without).items():
        assert torch.equal(value, model_of(diverging)[key]), key
    skipped = [r for r in rows(diverging, "clients.jsonl") if "skipped" in r]
    assert [(r["round"], r["client"]) for r in skipped] == [(0, 1), (1, 1)]
    assert "non-finite" in skipped[0]["skipped"]
    assert all(m["clients_skipped"] == 1 for m in rows(diverging, "metrics.jsonl"))
    saved = json.loads((Path(diverging.out_dir) / "div" / "summary.json").read_text())
    assert saved["final"]["test_acc"] == summary["final"]["test_acc"]
    best = load_checkpoint(Path(diverging.out_dir) / "div" / "checkpoints" / "best.ckpt")["model"]
    assert all(torch.isfinite(t).all() for t in best.values() if t.is_floating_point())


def test_a_round_where_every_client_diverges_stops_the_run(tmp_path, capsys):
    out = tmp_path / "runs"
    code = main(["fit", "--data.dataset", "fl_lightning.data.Digits", "--data.val_size", "100", "--partition.num_clients", "4",
                 "--federation.rounds", "3", "--federation.clients_per_round", "2", "--train.lr", "1e30",
                 "--fabric.accelerator", "cpu", "--out_dir", str(out), "--name", "nan"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 1
    assert len(err) == 1 and "round 0: every client's update was non-finite" in err[0]
    assert not (out / "nan" / "checkpoints" / "best.ckpt").exists()
    assert not (out / "nan" / "checkpoints" / "last.ckpt").exists()


class Cyclic(FedAvg):
    """Within a round each client continues from the previous client's model (cyclic /
    sequential training): the result depends on the order, so the cohort must run in order."""

    def route(self, task, plan):
        if task.client == plan.cohort[0]:
            return super().route(task, plan)
        return Routed(self.worker, self.worker_regions)

    def commit(self, acc, task, result, plan):
        if task.client == plan.cohort[-1]:
            acc.add(result.model.module.state_dict(), 1.0, result.model.regions)


def test_sequential_clients_on_two_ranks_match_one_rank(spec_factory, fit_on_ranks):
    """The cohort of a sequential-client method runs in order on one rank whatever the ranks
    (two forked gloo ranks here); without the flag each rank starts its share from the global
    model, which gives another result."""
    import dataclasses

    def run(devices, sequential, name):
        algorithm = Cyclic()
        algorithm.sequential_clients = sequential
        spec = spec_factory(name=name, algorithm=algorithm, federation=FederationConfig(rounds=2, clients_per_round=4))
        spec = dataclasses.replace(spec, eval=dataclasses.replace(spec.eval, every=2),
                                   fabric=dataclasses.replace(spec.fabric, devices=devices,
                                                              strategy="ddp_fork" if devices > 1 else "auto"))
        fit_on_ranks(spec)
        return model_of(spec)

    one, two = run(1, True, "one"), run(2, True, "two")
    assert one.keys() == two.keys()
    for key, value in one.items():
        assert torch.equal(value, two[key]), key
    # Without the flag each rank starts its share from the global model: another result.
    parallel = run(2, False, "parallel")
    assert any(not torch.equal(v, parallel[k]) for k, v in one.items() if v.is_floating_point())
    assert all(math.isfinite(float(v.float().sum())) for v in one.values())


def test_ranks_share_a_round_by_estimated_work():
    """Longest-first to the least-loaded rank, by hand: work 5, 1, 4, 3, 2 on two ranks gives
    5 -> r0, 4 -> r1, 3 -> r1, 2 -> r0, 1 -> r0 (tie to the lower rank): loads 8 and 7."""
    from fl_lightning.runtime.seeding import balanced_share

    items, work = ["a", "b", "c", "d", "e"], [5, 1, 4, 3, 2]
    assert balanced_share(items, work, 0, 2) == ["a", "b", "e"]  # plan order kept
    assert balanced_share(items, work, 1, 2) == ["c", "d"]
    assert balanced_share(items, work, 0, 1) == items
    shares = [balanced_share(list(range(7)), [1.0] * 7, r, 3) for r in range(3)]
    assert sorted(sum(shares, [])) == list(range(7)) and [len(s) for s in shares] == [3, 2, 2]


class _Alternating:
    """A selector of the form a method may plug in: even clients on even rounds, odd on odd."""

    def __init__(self, num_clients):
        self.num_clients = num_clients

    def cohort(self, round_idx):
        return [c for c in range(self.num_clients) if c % 2 == round_idx % 2]


@pytest.mark.parametrize("method", ["FedAvg", "HeteroFL", "SplitFed", "MultiSFL"])
def test_every_family_plans_the_cohort_its_selector_gives(spec_factory, method):
    """The client selector is a part of the base: replaced after set-up, every family's plan
    trains its cohort (the default draws uniformly from (seed, round))."""
    from lightning.fabric import Fabric

    import fl_lightning.algorithms as algorithms
    from fl_lightning.federation.loop import Federation
    from fl_lightning.federation.run_dir import RunDir
    from fl_lightning.runtime.seeding import sample_clients

    overrides = {}
    if method in ("SplitFed", "MultiSFL"):
        overrides["model"] = {"class_path": "fl_lightning.elastic.models.ResNet18", "init_args": {"width": 0.125}}
    spec = spec_factory(name=method, algorithm=getattr(algorithms, method)(), **overrides)
    alg = Federation(Fabric(accelerator="cpu", devices=1), spec, RunDir(spec.out_dir, spec.name)).algorithm
    ctx = alg.ctx
    assert alg.plan(3).cohort == sample_clients(ctx.seed, 3, ctx.num_clients, ctx.clients_per_round)
    alg.selector = _Alternating(ctx.num_clients)
    assert sorted(alg.plan(2).cohort) == [0, 2, 4] and sorted(alg.plan(3).cohort) == [1, 3, 5]
