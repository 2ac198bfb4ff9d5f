"""Server-side formulas with a parameter, at non-default settings: the prototype moving average and
temperature of FedSGA's harmonizer, FedGH's header step, FedMut's mutation radius and
acceleration. Each expected figure is computed here on inputs where a neighbouring formula gives
another figure; both are stated. (The server optimisers' steps are checked against their formulas
in test_server_optimizer.py, HAS-FL's moving average over logged estimates in test_submodel.py.)"""

import math

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from fl_lightning.algorithms.fedmut import FedMut
from fl_lightning.algorithms.personalized.fedgh import FedGH
from fl_lightning.config import FederationConfig
from fl_lightning.federation.loop import Federation
from fl_lightning.federation.run_dir import RunDir
from fl_lightning.modules.harmonizer import InterfaceHarmonizer


# -- FedSGA's class prototypes -------------------------------------------------------------------

def test_prototype_moving_average_weighs_the_old_prototype_by_mu():
    """mu 0.7: class 0's prototype (1, 0) meets a round whose mean feature is (0, 1):
    normalize(0.7 (1, 0) + 0.3 (0, 1)) = (0.91915, 0.39392); the weights swapped would give
    (0.39392, 0.91915). Class 1, new this round, starts at its normalized mean: (0, 1) twice and
    (0.6, 0.8) once give (0.2, 0.9333) and (0.20953, 0.97780)."""
    h = InterfaceHarmonizer([4], num_classes=2, projection_dim=2, tau=0.2, momentum=0.7).double()
    h.update_prototypes(*h.class_sums(torch.tensor([[1.0, 0.0]], dtype=torch.float64), torch.tensor([0])))
    later = torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.6, 0.8], [0.0, 1.0]], dtype=torch.float64)
    h.update_prototypes(*h.class_sums(later, torch.tensor([1, 1, 1, 0])))
    blended = (0.7, 0.3)
    norm = math.hypot(*blended)
    assert h.prototypes[0].tolist() == pytest.approx([0.7 / norm, 0.3 / norm], abs=1e-12)
    assert h.prototypes[0].tolist() == pytest.approx([0.91915, 0.39392], abs=1e-5)
    mean = (0.2, (1 + 1 + 0.8) / 3)
    assert h.prototypes[1].tolist() == pytest.approx([v / math.hypot(*mean) for v in mean], abs=1e-12)
    assert h.prototypes[1].tolist() == pytest.approx([0.20953, 0.97780], abs=1e-5)


def test_prototype_similarities_are_divided_by_tau():
    """tau 0.2, prototypes (1, 0) and (0.6, 0.8), a feature (0.8, 0.6): logits (0.8, 0.96) / 0.2
    = (4, 4.8) and the alignment loss for class 0 is log(1 + e^0.8) = 1.1711; multiplying by tau
    would give (0.16, 0.192) and 0.7093, the default tau 0.5 (1.6, 1.92) and 0.8659."""
    h = InterfaceHarmonizer([4], num_classes=2, projection_dim=2, tau=0.2).double()
    h.update_prototypes(*h.class_sums(torch.tensor([[1.0, 0.0], [0.6, 0.8]], dtype=torch.float64),
                                      torch.tensor([0, 1])))
    feature = torch.tensor([[0.8, 0.6]], dtype=torch.float64)
    assert h.logits(feature)[0].tolist() == pytest.approx([4.0, 4.8], abs=1e-12)
    assert float(h.alignment_loss(feature, torch.tensor([0]))) == pytest.approx(math.log1p(math.exp(0.8)), abs=1e-12)


# -- FedGH's global header -----------------------------------------------------------------------

def hand_header_steps(weight, bias, prototypes, labels, lr, epochs, batch):
    """Plain SGD on the mean cross-entropy of each batch, the gradient written out:
    dL/dz = (softmax(z) - onehot) / batch, dW = dz^T p, db = sum dz."""
    for _ in range(epochs):
        for start in range(0, len(labels), batch):
            p, y = prototypes[start:start + batch], labels[start:start + batch]
            dz = (torch.softmax(p @ weight.T + bias, dim=1) - F.one_hot(y, weight.shape[0]).double()) / len(y)
            weight, bias = weight - lr * dz.T @ p, bias - lr * dz.sum(0)
    return weight, bias


def test_fedgh_header_takes_server_lr_epochs_and_batches():
    """server_lr 0.3 (the round's 0.05 ignored), 2 epochs over 3 prototypes in batches of 2:
    four SGD steps. The round's rate, one epoch or batches of one each give another header."""
    torch.manual_seed(0)
    prototypes = torch.randn(3, 2, dtype=torch.float64)
    labels = torch.tensor([0, 2, 1])
    fedgh = FedGH(server_lr=0.3, server_epochs=2, server_batch_size=2)
    fedgh.header = nn.Linear(2, 3).double()
    weight, bias = fedgh.header.weight.detach().clone(), fedgh.header.bias.detach().clone()
    fedgh.train_header(prototypes, labels, round_lr=0.05)
    want = hand_header_steps(weight, bias, prototypes, labels, 0.3, 2, 2)
    assert torch.allclose(fedgh.header.weight.detach(), want[0], rtol=0, atol=1e-12)
    assert torch.allclose(fedgh.header.bias.detach(), want[1], rtol=0, atol=1e-12)
    for neighbour in ((0.05, 2, 2), (0.3, 1, 2), (0.3, 2, 1)):
        other = hand_header_steps(weight, bias, prototypes, labels, *neighbour)
        assert not torch.allclose(other[0], want[0], rtol=0, atol=1e-6), neighbour


# -- FedMut --------------------------------------------------------------------------------------

def test_fedmut_acceleration_weight():
    """acc_rate 0.4 over 10 rounds: the models sent in round 6 (five rounds done) mutate with
    -(1 - 0.4 (1 - 5/10)) = -0.8; counting six rounds done gives -0.84, the default 50 rounds
    -0.64; from round 11 on, -1."""
    mut = FedMut(acc_rate=0.4, acc_rounds=10)
    assert mut.negative_weight(6) == pytest.approx(-0.8, abs=1e-12)
    assert mut.negative_weight(1) == pytest.approx(-0.6, abs=1e-12)
    assert mut.negative_weight(11) == -1.0 and mut.negative_weight(40) == -1.0


def test_fedmut_sends_w_plus_alpha_times_the_weighted_last_update(spec_factory):
    """alpha 1.5 (default 4), acc_rate 0.4 over 10 rounds, round 6: with a last update d of 0.01
    in one layer, each client receives w + 1.5 d (two of four) or w - 1.5 * 0.8 d = w - 1.2 d
    (the other two); the default radius would send w + 4 d and w - 3.2 d."""
    spec = spec_factory(name="mut", algorithm=FedMut(alpha=1.5, acc_rate=0.4, acc_rounds=10),
                        federation=FederationConfig(rounds=8, clients_per_round=4))
    fed = Federation(Fabric(accelerator="cpu", devices=1), spec, RunDir(spec.out_dir, spec.name))
    alg = fed.algorithm
    key = alg.mutated_keys[0]
    with torch.no_grad():
        alg.global_state[key].add_(0.01)  # the last update d: the previous model is the initial one
    plan = alg.plan(6)
    offsets = []
    for task in plan.tasks:
        local = alg.route(task, plan).module.state_dict()
        offset = (local[key] - alg.global_state[key]).double()
        offsets.append(float(offset.mean()))
        assert torch.allclose(offset, torch.full_like(offset, offset.mean()), rtol=0, atol=1e-7)
    assert sorted(offsets) == pytest.approx([-0.012, -0.012, 0.015, 0.015], abs=1e-7)
