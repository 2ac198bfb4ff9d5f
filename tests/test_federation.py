"""The round loop: FedAvg/FedProx/SCAFFOLD semantics, resume exactness, rank independence."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fl_lightning.algorithms import FedAvg, FedOpt, FedProx, Scaffold
from fl_lightning.config import FederationConfig, LocalTrainConfig, PartitionConfig
from fl_lightning.data.federated import build_federated_data
from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.federation.builder import build_global_model
from fl_lightning.federation.loop import run_fit
from fl_lightning.runtime.server_optimizer import ServerOptimizer
from fl_lightning.modules.control_variates import option_ii_update


def final_model(spec):
    return load_checkpoint(Path(spec.out_dir) / spec.name / "checkpoints" / "last.ckpt")["model"]


def float_items(state):
    return {k: v for k, v in state.items() if v.is_floating_point()}


def test_fedavg_one_client_one_step_equals_centralized_sgd(spec_factory):
    spec = spec_factory(partition=PartitionConfig(method="iid", num_clients=1),
                        federation=FederationConfig(rounds=1, clients_per_round=1),
                        train=LocalTrainConfig(steps=1, batch_size=10_000, lr=0.1, momentum=0.9, weight_decay=1e-3))
    run_fit(spec)
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    model = build_global_model(spec, fed)
    idx = fed.clients[0]
    x, y = fed.bundle.train.data[idx], fed.bundle.train.targets[idx]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    model.train()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    got = final_model(spec)
    for key, want in float_items(model.state_dict()).items():
        torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-6, msg=key)


def test_fedprox_with_zero_mu_equals_fedavg(spec_factory):
    a = spec_factory(name="avg", algorithm=FedAvg())
    b = spec_factory(name="prox", algorithm=FedProx(mu=0.0))
    run_fit(a)
    run_fit(b)
    for key, value in final_model(a).items():
        assert torch.equal(value, final_model(b)[key]), key


def test_fedprox_pulls_towards_global_model(spec_factory):
    a = spec_factory(name="avg", algorithm=FedAvg(), federation=FederationConfig(rounds=1, clients_per_round=3))
    b = spec_factory(name="prox", algorithm=FedProx(mu=10.0), federation=FederationConfig(rounds=1, clients_per_round=3))
    run_fit(a)
    run_fit(b)
    fed = build_federated_data(a.data, a.partition, a.seed)
    init = float_items(build_global_model(a, fed).state_dict())
    moved = lambda s: sum((s[k] - v).pow(2).sum() for k, v in init.items() if "weight" in k)
    assert moved(final_model(b)) < moved(final_model(a))


def test_option_ii_formula():
    c_i, c, x, y = [torch.tensor([1.0])], [torch.tensor([0.5])], [torch.tensor([2.0])], [torch.tensor([1.0])]
    assert torch.allclose(option_ii_update(c_i, c, x, y, steps=4, lr=0.5)[0], torch.tensor([1.0 - 0.5 + 1.0 / 2.0]))


def test_scaffold_control_variates_after_one_round(spec_factory):
    spec = spec_factory(name="scaffold", algorithm=Scaffold(),
                        partition=PartitionConfig(method="iid", num_clients=4),
                        federation=FederationConfig(rounds=1, clients_per_round=1),
                        train=LocalTrainConfig(steps=3, batch_size=8, lr=0.1))
    run_fit(spec)
    ckpt = load_checkpoint(Path(spec.out_dir) / spec.name / "checkpoints" / "last.ckpt")
    client_row = json.loads((Path(spec.out_dir) / spec.name / "clients.jsonl").read_text().splitlines()[0])
    client, steps = client_row["client"], client_row["steps"]
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    x0 = dict(build_global_model(spec, fed).named_parameters())
    x1 = ckpt["model"]
    for name, before in x0.items():
        c_i = ckpt["algorithm"][f"clients/{client}/{name}"]
        expected = (before.detach() - x1[name]) / (steps * 0.1)  # c = c_i = 0 before the round
        torch.testing.assert_close(c_i, expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ckpt["algorithm"][f"c/{name}"], expected / 4, rtol=1e-4, atol=1e-5)


def test_scaffold_correction_changes_the_local_step(spec_factory):
    base = dict(partition=PartitionConfig(method="iid", num_clients=2),
                federation=FederationConfig(rounds=3, clients_per_round=1),
                train=LocalTrainConfig(steps=2, batch_size=8, lr=0.1))
    a, b = spec_factory(name="avg", **base), spec_factory(name="scaffold", algorithm=Scaffold(), **base)
    run_fit(a)
    run_fit(b)
    assert any(not torch.equal(v, final_model(b)[k]) for k, v in float_items(final_model(a)).items())


@pytest.mark.parametrize("algorithm", [FedAvg, Scaffold, lambda: FedOpt(ServerOptimizer("yogi", lr=0.01))])
def test_resume_is_bit_exact(spec_factory, algorithm):
    train = LocalTrainConfig(epochs=1, batch_size=16, lr=0.05, lr_schedule="cosine")
    whole = spec_factory(name="whole", algorithm=algorithm(), train=train,
                         federation=FederationConfig(rounds=4, clients_per_round=3))
    run_fit(whole)
    part = spec_factory(name="part", algorithm=algorithm(), train=train,
                        federation=FederationConfig(rounds=4, clients_per_round=3))
    part.stop_after = 2
    run_fit(part)
    assert load_checkpoint(Path(part.out_dir) / "part" / "checkpoints" / "last.ckpt")["round"] == 2
    resumed = copy.copy(part)
    resumed.stop_after = None
    resumed.algorithm = algorithm()
    resumed.resume_from = str(Path(part.out_dir) / "part" / "checkpoints" / "last.ckpt")
    run_fit(resumed)
    for key, value in final_model(whole).items():
        assert torch.equal(value, final_model(resumed)[key]), key
    rows = [json.loads(l) for l in (Path(part.out_dir) / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3]


def test_run_directory_contents(spec_factory):
    spec = spec_factory(name="outputs")
    summary = run_fit(spec)
    run = Path(spec.out_dir) / "outputs"
    assert (run / "checkpoints" / "best.ckpt").is_file() and (run / "partition.pt").is_file()
    assert list((run / "tensorboard").rglob("events.out.tfevents.*"))
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"train_loss", "test_acc", "val_acc", "sum/bytes_down", "sum/bytes_up", "round_seconds"} <= set(rows[-1])
    # FedAvg sends the whole model both ways: every tensor of the state dict, in its own dtype.
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    model_bytes = sum(t.numel() * t.element_size() for t in build_global_model(spec, fed).state_dict().values())
    clients = [json.loads(l) for l in (run / "clients.jsonl").read_text().splitlines()]
    assert len(clients) == 3 * 3 and all(c["bytes_down"] == c["bytes_up"] == model_bytes for c in clients)
    assert rows[-1]["sum/bytes_down"] == 3 * model_bytes
    assert sum(c["samples"] for c in clients if c["round"] == 2) == rows[-1]["sum/samples"]
    assert summary["final"]["test_acc"] > 0.5  # three rounds of FedAvg on digits (chance: 0.1)
    assert summary["best"]["round"] >= 0


@pytest.mark.parametrize("test_schedule", ["every", "final"])
def test_final_evaluation_scores_the_last_model_once(spec_factory, monkeypatch, test_schedule):
    """The summary's final figures are the last model's, scored by hand from last.ckpt; when the
    last round already scored a split, the final evaluation reuses it instead of scoring again."""
    from fl_lightning.config import EvalConfig

    calls = []
    scored = FedAvg.evaluate
    monkeypatch.setattr(FedAvg, "evaluate", lambda self, split, bs: calls.append(split) or scored(self, split, bs))
    spec = spec_factory(name=f"final_{test_schedule}", eval=EvalConfig(every=2, test=test_schedule))
    summary = run_fit(spec)  # 3 rounds: evaluated after rounds 1 and 2 (the last)
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    model = build_global_model(spec, fed)
    model.load_state_dict(final_model(spec))
    model.eval()
    with torch.no_grad():
        for split, dataset, idx in (("test", fed.bundle.test, torch.arange(len(fed.bundle.test))),
                                    ("val", fed.bundle.train_eval, fed.val)):
            pred = model(dataset.data[idx]).argmax(1)
            want = (pred == dataset.targets[idx]).double().mean().item()
            assert summary["final"][f"{split}_acc"] == pytest.approx(want, abs=1e-6), split
    if test_schedule == "every":
        assert calls == ["val", "test", "val", "test"]
    else:  # the test set is first scored at the end (and the best checkpoint's once more if older)
        assert calls[:3] == ["val", "val", "test"] and calls.count("val") == 2
    rows = [json.loads(l) for l in (Path(spec.out_dir) / spec.name / "metrics.jsonl").read_text().splitlines()]
    assert summary["final"]["val_acc"] == rows[-1]["val_acc"]


def _cli(args, cwd):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "fl_lightning", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("algorithm,momentum,several", [
    ("FedAvg", "0.9", []),  # the default: devices auto, forked ranks
    ("Scaffold", "0.0", ["--fabric.devices", "2", "--fabric.strategy", "ddp"]),  # ranks re-run the command
    ("FedGH", "0.9", ["--fabric.devices", "2"]),  # per-client sums and a store in the round's reduction
])
def test_two_processes_match_one_process(tmp_path, monkeypatch, capsys, cli_on_ranks, algorithm, momentum, several):
    """Clients split over gloo ranks give the 1-rank model, with the default devices (one rank
    per physical core, at most the cohort of 5) and with 2 ranks started by Fabric's ddp
    launcher; SCAFFOLD also checks that the per-client control variates are synchronized
    across ranks (round 2 reuses clients), FedGH that every rank trains the header on every
    client's prototypes and holds every client's body. Fabric's ddp launcher re-runs the
    command line, so that case starts a real ``python -m fl_lightning``; the others run the
    command line's ``main`` here (as if started from it), which forks the ranks from this process."""
    from fl_lightning.federation import loop, machine
    from fl_lightning.federation.machine import physical_cores

    common = ["fit", "--data.dataset", "fl_lightning.data.Digits", "--data.val_size", "100", "--partition.num_clients", "6",
              "--federation.rounds", "3", "--federation.clients_per_round", "5", "--train.batch_size", "16",
              "--train.momentum", momentum, "--algorithm", algorithm, "--eval.every", "3",
              "--fabric.accelerator", "cpu", "--out_dir", str(tmp_path)]
    for module in (loop, machine):  # place and print as ``python -m fl_lightning`` does
        monkeypatch.setattr(module, "launched_by_command_line", lambda: True)
    assert cli_on_ranks(common + ["--name", "one", "--fabric.devices", "1"]) == 0
    assert "fit: 1 rank(s) x 1 thread(s) on cpu (as configured" in capsys.readouterr().err
    if "ddp" in several:
        two = _cli(common + ["--name", "two", *several], tmp_path)
        assert two.returncode == 0, two.stderr[-3000:]
        err = two.stderr
    else:
        assert cli_on_ranks(common + ["--name", "two", *several]) == 0
        err = capsys.readouterr().err
    ranks = 2 if several else min(physical_cores(), 5)
    assert f"fit: {ranks} rank(s) x 1 thread(s) on cpu" in err, err[-3000:]
    a = load_checkpoint(tmp_path / "one" / "checkpoints" / "last.ckpt")
    b = load_checkpoint(tmp_path / "two" / "checkpoints" / "last.ckpt")
    for part in ("model", "algorithm"):
        assert a[part].keys() == b[part].keys()
        diff = max(((a[part][k].double() - b[part][k].double()).abs().max().item() for k in a[part]), default=0.0)
        assert diff == 0.0, part
