"""A client's local objective and step at non-default settings: the distillation temperature,
FedProx's mu, SCAFFOLD's control variates, gradient clipping, SGD's momentum and weight decay,
and Mixup's alpha. Each expected figure is computed here (by hand or in float64) on inputs where
a neighbouring formula gives another figure; both are stated."""

import math

import numpy as np
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from fl_lightning.config import LocalTrainConfig
from fl_lightning.modules.control_variates import ControlVariateClient, option_ii_update
from fl_lightning.modules.inplace_distillation import (OperatingPoint, Pass, kd_loss, sandwich_step, soft_targets,
                                                       student_loss)
from fl_lightning.modules.mixing import AlternatingMixer
from fl_lightning.modules.proximal import ProximalClient
from fl_lightning.modules.supervised import SupervisedClient
from fl_lightning.runtime.local_training import train_locally


def log_softmax(z):
    z = np.asarray(z, dtype=np.float64)
    return z - z.max() - math.log(np.exp(z - z.max()).sum())


# -- in-place distillation at a temperature ------------------------------------------------------

TEACHER, STUDENT = [2.0, 0.0], [0.5, 0.0]


def hand_kd(teacher, student, t):
    """``T^2 * -sum_c softmax(z_t / T)_c log softmax(z_s / T)_c`` for one example, in float64."""
    p = np.exp(log_softmax(np.array(teacher) / t))
    return t * t * float(-(p * log_softmax(np.array(student) / t)).sum())


def test_kd_loss_at_temperature_two():
    """Teacher (2, 0), student (0.5, 0), T = 2: p = softmax(1, 0) = (0.7311, 0.2689) and the soft
    cross-entropy with log softmax(0.25, 0) is 0.64317, times T^2: 2.5727. T instead of T^2 gives
    1.2863; the teacher's softmax without T 2.4230; no scaling 0.6432."""
    t = 2.0
    teacher, student = torch.tensor([TEACHER], dtype=torch.float64), torch.tensor([STUDENT], dtype=torch.float64)
    got = float(kd_loss(student, soft_targets(teacher, t), t))
    assert got == pytest.approx(hand_kd(TEACHER, STUDENT, t), rel=1e-12)
    assert got == pytest.approx(2.5727, abs=1e-4)
    assert soft_targets(teacher, t)[0].tolist() == pytest.approx([0.7310586, 0.2689414], abs=1e-7)


def test_sandwich_step_uses_the_temperature_for_the_teacher_and_the_student():
    """One teacher pass and one student pass at T = 2 and rho 0.3: the step's loss is
    CE(teacher) + 0.7 CE(student) + 0.3 KD = 0.1269 + 0.7 * 0.4741 + 0.3 * 2.5727 = 1.2306; at
    T = 1 the KD term would be 0.5337 and the total 0.6189."""
    logits = {"big": torch.tensor([TEACHER], dtype=torch.float64),
              "small": torch.tensor([STUDENT], dtype=torch.float64)}
    active = {}
    passes = [Pass(OperatingPoint("big", 2.0), "teacher"), Pass(OperatingPoint("small", 1.0), "student")]
    result = sandwich_step(passes, torch.zeros(1, 1), torch.tensor([0]), activate=lambda k: active.update(k=k),
                           forward=lambda x: logits[active["k"]], backward=lambda loss: None, rho=0.3, temperature=2.0)
    ce_teacher, ce_student = -log_softmax(TEACHER)[0], -log_softmax(STUDENT)[0]
    expected = ce_teacher + 0.7 * ce_student + 0.3 * hand_kd(TEACHER, STUDENT, 2.0)
    assert float(result.loss) == pytest.approx(expected, rel=1e-6)
    assert float(result.loss) == pytest.approx(1.2306, abs=1e-4)
    assert float(student_loss(torch.tensor(1.0), torch.tensor(3.0), 0.3)) == pytest.approx(1.6)  # 0.7 + 0.9


# -- FedProx ------------------------------------------------------------------------------------

def test_proximal_gradient_is_mu_times_the_distance_from_the_anchor():
    """mu 0.3, w - w0 = (0.5, -1, 2): the term (mu/2) ||w - w0||^2 = 0.7875 and its gradient
    mu (w - w0) = (0.15, -0.3, 0.6); a term of mu ||w - w0||^2 would double it, mu/2 (w - w0)
    halve it."""
    model = nn.Linear(3, 1, bias=False)
    client = ProximalClient(model, lr=0.1, mu=0.3)
    with torch.no_grad():
        model.weight.add_(torch.tensor([[0.5, -1.0, 2.0]]))
    term = client.proximal_term()
    term.backward()
    assert float(term.detach()) == pytest.approx(0.7875, rel=1e-6)
    assert model.weight.grad[0].tolist() == pytest.approx([0.15, -0.3, 0.6], rel=1e-6)


# -- SCAFFOLD -----------------------------------------------------------------------------------

def test_option_ii_control_variate():
    """c_i 0.2, c 0.5, x 1.0, y 0.4, K = 3 steps at lr 0.1: c_i+ = 0.2 - 0.5 + 0.6 / 0.3 = 1.7.
    Dividing by K alone gives -0.1, by lr alone 5.7; (y - x) gives -2.3; c_i + c gives 2.7."""
    one = lambda v: [torch.tensor([v], dtype=torch.float64)]  # noqa: E731
    (new,) = option_ii_update(one(0.2), one(0.5), one(1.0), one(0.4), steps=3, lr=0.1)
    assert float(new) == pytest.approx(1.7, rel=1e-12)


def test_the_corrected_step_adds_c_minus_c_i_to_the_gradient():
    """y <- y - lr (g + c - c_i) with g = 1 per weight (the loss is their sum), lr 0.5 and
    c - c_i = (0.4, -2): y moves by (-0.7, 0.5); subtracting the correction would give (-0.3, -1.5)."""
    model = nn.Linear(2, 1, bias=False)
    start = model.weight.detach().clone()
    client = ControlVariateClient(model, lr=0.5, correction=[torch.tensor([[0.4, -2.0]])])
    optimizer = client.configure_optimizers()
    model.weight.sum().backward()
    client.on_before_optimizer_step(optimizer)
    optimizer.step()
    assert (model.weight.detach() - start)[0].tolist() == pytest.approx([-0.7, 0.5], rel=1e-6)


# -- the local step: clipping, momentum, weight decay ---------------------------------------------

class LinearLoss(SupervisedClient):
    """A client whose loss is ``<w, c>``: its gradient is ``c`` whatever ``w``."""

    def __init__(self, gradient, **kwargs):
        super().__init__(nn.Linear(len(gradient), 1, bias=False), **kwargs)
        with torch.no_grad():
            self.model.weight.copy_(torch.tensor([[1.0, -1.0]]))
        self.gradient = torch.tensor([gradient])

    def training_step(self, batch, batch_idx):
        return (self.model.weight * self.gradient).sum()


class Batches:
    """``steps`` empty batches: the loss above reads none."""

    def __len__(self):
        return 1

    def steps(self, num_steps, generator):
        return iter([(torch.zeros(1), torch.zeros(1))] * num_steps)


def local_change(steps=1, **settings) -> list:
    fabric = Fabric(accelerator="cpu", devices=1)
    client = LinearLoss([3.0, 4.0], lr=settings.pop("lr"), momentum=settings.pop("momentum", 0.0),
                        weight_decay=settings.pop("weight_decay", 0.0))
    cfg = LocalTrainConfig(steps=steps, batch_size=1, lr=client.lr, **settings)
    train_locally(fabric, client, Batches(), cfg, torch.Generator())
    return (client.model.weight.detach()[0] - torch.tensor([1.0, -1.0])).tolist()


def test_gradient_clipping_scales_the_gradient_to_the_norm():
    """Gradient (3, 4), norm 5, lr 0.1. grad_clip 2.5: the step takes half of it, (-0.15, -0.2);
    clipping each value at 2.5 would give (-0.25, -0.25), no clipping (-0.3, -0.4). grad_clip 10,
    above the norm: the whole gradient."""
    assert local_change(lr=0.1, grad_clip=2.5) == pytest.approx([-0.15, -0.2], rel=1e-5)
    assert local_change(lr=0.1, grad_clip=10.0) == pytest.approx([-0.3, -0.4], rel=1e-6)


def test_sgd_momentum_and_weight_decay():
    """Two steps at lr 0.1, momentum 0.5, weight decay 0.2 from w = (1, -1), gradient (3, 4):
    g1 = (3.2, 3.8), w1 = (0.68, -1.38); g2 = (3.136, 3.724), buffer 0.5 g1 + g2 = (4.736, 5.624),
    w2 = (0.2064, -1.9424): a change of (-0.7936, -0.9424). A buffer momentum b + (1 - momentum) g
    (EMA form) would give (-0.6368, -0.7562); decay as (wd/2) w, (-0.7719, -0.9711)."""
    assert local_change(steps=2, lr=0.1, momentum=0.5, weight_decay=0.2) == pytest.approx([-0.7936, -0.9424], rel=1e-5)


# -- Mixup's alpha -----------------------------------------------------------------------------

def test_mixup_draws_lambda_from_beta_alpha_alpha():
    """Mixup at alpha 2 (FEAST's 0.4 is the default): lam ~ Beta(2, 2), variance
    1 / (4 (2 alpha + 1)) = 0.05; Beta(0.4, 0.4) would give 0.1389 and CutMix's alpha 1,
    Beta(1, 1), 0.0833. 1000 batches of two examples of classes 0 and 1: lam is the first
    example's weight on class 0 (sample variance's standard deviation about 0.0015; 0.01 allowed)."""
    mixer = AlternatingMixer(2, mixup_alpha=2.0, cutmix_alpha=1.0, schedule="mixup",
                             generator=torch.Generator().manual_seed(0))
    x, y = torch.zeros(2, 1, 4, 4), torch.tensor([0, 1])
    lam = np.array([float(mixer(x, y)[1][0, 0]) for _ in range(1000)])
    assert lam.mean() == pytest.approx(0.5, abs=0.02)
    assert lam.var() == pytest.approx(0.05, abs=0.01)
