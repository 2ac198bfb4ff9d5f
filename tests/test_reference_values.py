"""Golden values from the reference implementations (``tools/reference/``, provenance in
``tests/data/reference/<method>/provenance.json``): our implementation on the same one-round
case (the stored initial model, the stored batches) against what the reference code produced.
Nothing here reaches a network or the reference code: only the stored figures are read."""

from dataclasses import replace

import pytest
import torch

from reference_case import TRAIN, load, make_spec, max_abs_diff, run_one_round

TOL = 1e-5


def assert_same_case(case, initial, cohort, batches):
    """Our run starts from the stored model and trains on the stored batches (else the golden
    values would be about another case)."""
    assert list(cohort) == list(case["cohort"])
    for key, value in case["initial"].items():
        assert torch.equal(initial[key], value), key
    for client in case["cohort"]:
        ours, stored = batches[client], case["batches"][client]
        assert len(ours) >= len(stored)
        for (x, y), (xs, ys) in zip(ours, stored):
            assert torch.equal(x, xs) and torch.equal(y, ys)


def float_keys(state, skip=()):
    return [k for k, v in state.items() if v.is_floating_point() and k not in skip]


# -- FedBABU -------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["authors", "pfllib"])
def test_fedbabu_round_matches_reference(tmp_path, source):
    """One round of body-only local training and aggregation. Authors' code (momentum 0.9, equal
    shards, plain mean of the state dicts): every floating entry, running statistics included.
    PFLlib (plain SGD, unequal shards, sample weights): parameters (PFLlib keeps the first
    client's buffers)."""
    from fl_lightning.algorithms.fedbabu import FedBABU

    golden = load("fedbabu", f"{source}.pt")
    case = golden["case"]
    train = replace(TRAIN, lr=case["lr"], momentum=case["momentum"])
    spec = make_spec(tmp_path, FedBABU(finetune_epochs=0), num_clients=6, partition=case["partition"], train=train)
    fed, initial, cohort, batches = run_one_round(spec)
    assert_same_case(case, initial, cohort, batches)
    ours = fed.algorithm.global_state
    keys = float_keys(ours)
    if source == "pfllib":
        keys = [k for k in keys if not k.endswith(("running_mean", "running_var"))]
    assert max_abs_diff(ours, golden["global"], keys) < TOL
    for key in ("fc.weight", "fc.bias"):  # the head never moves
        assert torch.equal(ours[key], initial[key])
