"""FedDyn (Acar et al., 2021): the local objective by hand (the paper's squared pull, and the
unsquared one PFLlib writes), and three rounds against PFLlib's FedDyn (``tools/reference/
feddyn.py``; provenance in ``tests/data/reference/feddyn/``): unequal Dirichlet shards of 8
clients, 3 per round, the project's one-block ViT, plain SGD, both sides in float64."""

import pytest
import torch
from torch import nn

from reference_case import assert_close, load, unpack
from test_reference_fedprox_scaffold import run_ours, tolerance


@pytest.mark.parametrize("penalty", ["squared", "norm"])
def test_the_local_objective_by_hand(penalty):
    """theta = (1, 2, 2), received (1, 0, 0), grad_k = (0.5, -1, 0), alpha = 0.2: the pull is
    (0.2 / 2) * 8 = 0.8 squared (the paper) or (0.2 / 2) * sqrt(8) = 0.283 as PFLlib writes it,
    minus <grad_k, theta> = -1.5: 2.3 against 1.783; its gradient alpha (theta - received) - grad_k
    = (-0.5, 1.4, 0.4) squared, alpha (theta - received) / (2 ||.||) - grad_k unsquared."""
    from fl_lightning.modules.dynamic_regularization import DynamicRegularizedClient

    model = nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0, 2.0]]))
    client = DynamicRegularizedClient(model, 0.1, 0.0, 0.0, alpha=0.2, anchor=[torch.tensor([[1.0, 0.0, 0.0]])],
                                      grad=[torch.tensor([[0.5, -1.0, 0.0]])], penalty=penalty)
    value = client.regularizer()
    value.backward()
    diff, g = torch.tensor([[0.0, 2.0, 2.0]]), torch.tensor([[0.5, -1.0, 0.0]])
    if penalty == "squared":
        assert float(value.detach()) == pytest.approx(0.8 + 1.5)
        expected = 0.2 * diff - g
    else:
        assert float(value.detach()) == pytest.approx(0.1 * 8 ** 0.5 + 1.5)
        expected = 0.1 * diff / 8 ** 0.5 - g
    assert torch.allclose(model.weight.grad, expected)


def test_a_clients_first_step_at_the_received_model_is_plain_sgd():
    """At theta = received and grad_k = 0 (a client's first round) the regularizer and its
    gradient vanish, for the unsquared pull too (no NaN from the norm at zero)."""
    from fl_lightning.modules.dynamic_regularization import DynamicRegularizedClient

    model = nn.Linear(3, 2)
    anchor = [p.detach().clone() for p in model.parameters()]
    for penalty in ("squared", "norm"):
        model.zero_grad()
        client = DynamicRegularizedClient(model, 0.1, 0.0, 0.0, alpha=0.1, anchor=anchor,
                                          grad=[torch.zeros_like(a) for a in anchor], penalty=penalty)
        value = client.regularizer()
        value.backward()
        assert float(value.detach()) == 0.0
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def test_feddyn_rounds_match_pfllib(tmp_path):
    """PFLlib's clientDyn and FedDyn server (``penalty: norm``, ``weighting: uniform``), three
    rounds: every cohort client's trained model and gradient estimate (carried to its next
    round), the global model and the server's h after each round."""
    from fl_lightning.algorithms.feddyn import FedDyn

    golden = load("feddyn", "pfllib.pt")
    case = golden["case"]
    states = []

    def after(r, fed):
        alg = fed.algorithm
        states.append({"h": {k: v.clone() for k, v in alg.h.items()},
                       "grads": {c: {k: v.clone() for k, v in alg.store.get(c).items()} for c in case["cohorts"][r]}})

    run = run_ours(FedDyn(**case["options"]), case, tmp_path, after_round=after)
    assert any(c in case["cohorts"][r] for r in range(1, case["rounds"]) for c in case["cohorts"][0])
    tol = tolerance(case, golden)
    assert tol < 1e-9
    alpha = case["alpha"]
    for r, theirs in enumerate(golden["rounds"]):
        for c in run.cohorts[r]:
            assert_close(run.returned[r][c], unpack(theirs["locals"][c]), tol, f"round {r} client {c}")
            # grad_k - alpha (theta_k - theta): the model's rounding times alpha
            assert_close(states[r]["grads"][c], unpack(theirs["grads"][c]), tol * alpha, f"round {r} grad {c}")
        assert_close(states[r]["h"], unpack(theirs["h"]), tol * alpha, f"round {r} h")
        assert_close(run.globals[r], unpack(theirs["global"]), tol, f"round {r} global")
    assert max(float(v.abs().max()) for v in states[-1]["h"].values()) > 1e-4
