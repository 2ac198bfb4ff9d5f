"""The server optimiser (Reddi et al., 2021, Algorithm 2): each optimiser's step against its
formula written out in float64, FedOpt's default against FedAvg, SCAFFOLD's server rate
against the averaged change, and the one-line errors."""

import math
from pathlib import Path

import pytest
import torch

from fl_lightning.algorithms import FedAvg, FedOpt, Scaffold
from fl_lightning.config import FederationConfig, LocalTrainConfig
from fl_lightning.errors import ConfigError
from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.federation.loop import run_fit
from fl_lightning.runtime.server_optimizer import ServerOptimizer
from option_checks import option_refusal

LR, B1, B2, TAU, MU = 0.1, 0.9, 0.99, 1e-3, 0.8


def hand_steps(name, x, averages):
    """Reddi et al.'s Algorithm 2 on pseudo-gradients g = x - avg, element by element in float64
    (Adam as torch's: bias-corrected moments, tau added to the corrected root)."""
    x = list(x)
    m, v, buf = [0.0] * len(x), [TAU ** 2] * len(x), [None] * len(x)
    if name == "adam":
        v = [0.0] * len(x)
    for t, avg in enumerate(averages, start=1):
        for i, (xi, ai) in enumerate(zip(x, avg)):
            g = xi - ai
            if name == "sgd":
                buf[i] = g if buf[i] is None else MU * buf[i] + g
                x[i] = xi - LR * buf[i]
            elif name == "adagrad":
                v[i] += g * g
                x[i] = xi - LR * g / (math.sqrt(v[i]) + TAU)
            elif name == "adam":
                m[i] = B1 * m[i] + (1 - B1) * g
                v[i] = B2 * v[i] + (1 - B2) * g * g
                m_hat, v_hat = m[i] / (1 - B1 ** t), v[i] / (1 - B2 ** t)
                x[i] = xi - LR * m_hat / (math.sqrt(v_hat) + TAU)
            else:  # yogi
                m[i] = B1 * m[i] + (1 - B1) * g
                v[i] = v[i] - (1 - B2) * g * g * (1 if v[i] > g * g else -1 if v[i] < g * g else 0)
                x[i] = xi - LR * m[i] / (math.sqrt(v[i]) + TAU)
    return x


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam", "yogi"])
def test_each_step_follows_its_formula(name):
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(7, generator=gen, dtype=torch.float64)
    buffer = torch.randn(3, generator=gen, dtype=torch.float64)
    averages = [x0 + 0.3 * torch.randn(7, generator=gen, dtype=torch.float64) for _ in range(4)]
    state = {"w": x0.clone(), "running_mean": buffer.clone()}
    config = ServerOptimizer(name, lr=LR, momentum=MU if name == "sgd" else 0.0, betas=(B1, B2), eps=TAU)
    step = config.build(state, ["w"])
    for t, avg in enumerate(averages):
        new_buffer = buffer + t + 1
        step.apply({"w": avg, "running_mean": new_buffer})
        assert torch.equal(state["running_mean"], new_buffer)  # buffers take the average
    expected = hand_steps(name, x0.tolist(), [a.tolist() for a in averages])
    assert torch.allclose(state["w"], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    # the moments survive a checkpoint: a fresh step loaded from them continues identically
    saved = {k: v.clone() for k, v in step.state_dict().items()}
    twin_state = {k: v.clone() for k, v in state.items()}
    twin = config.build(twin_state, ["w"])
    twin.load_state_dict(saved)
    last = x0 - 0.2
    step.apply({"w": last, "running_mean": buffer})
    twin.apply({"w": last, "running_mean": buffer})
    assert torch.equal(state["w"], twin_state["w"])


def final_model(spec):
    return load_checkpoint(Path(spec.out_dir) / spec.name / "checkpoints" / "last.ckpt")["model"]


def test_fedopt_default_is_fedavg_and_fedadam_is_not(spec_factory):
    avg, same, adam = (spec_factory(name=n, algorithm=a) for n, a in
                       (("avg", FedAvg()), ("same", FedOpt()), ("adam", FedOpt(ServerOptimizer("adam", lr=0.01)))))
    for spec in (avg, same, adam):
        run_fit(spec)
    a, b, c = final_model(avg), final_model(same), final_model(adam)
    assert all(torch.equal(b[k], v) for k, v in a.items())
    assert any(not torch.allclose(c[k], v) for k, v in a.items() if v.is_floating_point())
    assert all(torch.isfinite(v).all() for v in c.values() if v.is_floating_point())


def test_scaffold_server_rate_moves_part_of_the_averaged_change(spec_factory):
    """Round 0 (c = 0 everywhere, so the clients train the same at any rate): the model moves by
    server_lr of the change the plain average makes."""
    base = dict(train=LocalTrainConfig(steps=2, batch_size=8, lr=0.1),
                federation=FederationConfig(rounds=1, clients_per_round=3))
    full, half = (spec_factory(name=n, algorithm=Scaffold(server_lr=r), **base) for n, r in (("full", 1.0), ("half", 0.5)))
    for spec in (full, half):
        run_fit(spec)
    from fl_lightning.data.federated import build_federated_data
    from fl_lightning.federation.builder import build_global_model
    start = build_global_model(full, build_federated_data(full.data, full.partition, 0)).state_dict()
    params = {k for k, _ in build_global_model(full, build_federated_data(full.data, full.partition, 0)).named_parameters()}
    a, b = final_model(full), final_model(half)
    for key in params:
        expected = start[key].double() + 0.5 * (a[key].double() - start[key].double())
        assert torch.allclose(b[key].double(), expected, rtol=0, atol=1e-6), key


@pytest.mark.parametrize("field, value", [("lr", 0.0), ("momentum", 1.0), ("betas", [0.9, 1.0]), ("eps", 0.0)])
def test_bad_settings_name_the_key(field, value):
    name = "adam" if field != "momentum" else "sgd"
    assert option_refusal("FedOpt", **{"server.name": name, f"server.{field}": value}).key == f"algorithm.server.{field}"


def test_momentum_is_sgd_only():
    with pytest.raises(ConfigError, match="algorithm.server.momentum"):
        FedOpt(ServerOptimizer("adam", momentum=0.5)).check(None)
