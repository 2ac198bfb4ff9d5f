"""FedRolex against the authors' code (AIoT-MLSys-Lab/FedRolex): the golden values of
``tools/reference/fedrolex.py`` (provenance in ``tests/data/reference/fedrolex/provenance.json``).
Only the stored figures are read.

Three rounds of our FedRolex (``tests/reference_fedrolex_case.py``: unequal shards, rates 1/4 to
1, a CNN of 4 and 8 channels) against their ``ResnetServerRoll.distribute`` / ``step`` and
``ResnetClient.step`` on the same batches:

- the positions every client holds in every round (their ``split_model``'s index sets): the
  window starts at ``(-r) mod C`` in round ``r``, per layer, on the output channels of every
  convolution and the input side of the next layer and of the classifier, every class kept;
- the sub-model each client is sent, the one it returns, and the global model after each round
  (one weight per client: the paper's plain mean, which the golden trajectory follows).

Both sides ran in float64 and ours runs in float64 here, from the stored initial model and
images (the digits' grey levels), so the tolerance is float64 rounding (``float64_bound``).
"""

import pytest
import torch

from reference_case import assert_close, batch_digest, load
from reference_fedrolex_case import PARAMS, ROUNDS, run_case, tolerance


@pytest.fixture(scope="module")
def golden():
    return load("fedrolex", "authors.pt")


@pytest.fixture(scope="module")
def ours(golden, tmp_path_factory):
    return run_case(tmp_path_factory.mktemp("fedrolex"), case=golden["case"])


@pytest.fixture(scope="module")
def tol(golden):
    scale = max(float(v.abs().max()) for rnd in golden["rounds"] for v in rnd["global"].values())
    return tolerance(golden["case"], scale)


def test_the_case_is_the_stored_one(golden, ours):
    """Our run trains the stored cohorts on the stored batches of unequal shards, else the golden
    values are about another case."""
    case, (run, _, _) = golden["case"], ours
    sizes = {c: len(run.fed.ctx.shards[c]) for c in range(run.fed.ctx.num_clients)}
    assert sizes == case["sizes"] and len(set(sizes.values())) == len(sizes)
    assert run.cohorts == case["cohorts"]
    for r, cohort in enumerate(run.cohorts):
        for c in cohort:
            assert [batch_digest(x, y) for x, y in run.batches[r][c]] == case["digests"][r][c], (r, c)


def test_windows_are_the_authors_split_model(golden, ours):
    """Every client's positions in every round, tensor by tensor, as split_model's index sets
    (exact), and the windows move: clients 1 (at 1/2) and 4 (at 1), in the cohorts of rounds 0
    and 1, hold other channels, or the same in another order, in round 1."""
    _, _, regions = ours
    for r, record in enumerate(golden["rounds"]):
        for client, theirs in record["indices"].items():
            mine = regions[(r, client)]
            for key in PARAMS:
                assert len(mine[key]) >= len(theirs[key]), (r, client, key)
                for dim, (a, b) in enumerate(zip(mine[key], theirs[key])):
                    assert torch.equal(a, b), (r, client, key, dim, a.tolist(), b.tolist())
    first, second = golden["rounds"][0]["indices"], golden["rounds"][1]["indices"]
    for client in set(first) & set(second):
        for key in ("features.block0.conv.weight", "features.block1.conv.weight"):
            assert not torch.equal(first[client][key][0], second[client][key][0]), (client, key)


def test_rounds_match_the_authors_code(golden, ours, tol):
    """What each client is sent and returns, and the global model after each round, within
    float64 rounding; each round moves the global model; their own ``combine``, which weighs
    norms, biases and the classifier by update counts, is visibly another model."""
    run, sent, _ = ours
    assert tol < 1e-8
    for r, record in enumerate(golden["rounds"]):
        for c in run.cohorts[r]:
            assert_close(sent[(r, c)], record["sent"][c], tol, f"round {r} client {c} sent")
            assert_close(run.returned[r][c], record["locals"][c], tol, f"round {r} client {c} trained")
        assert_close(run.globals[r], record["global"], tol, f"round {r} global")
        before = run.globals[r - 1] if r else run.initial
        assert max(float((run.globals[r][k].double() - before[k].double()).abs().max()) for k in PARAMS) > 1e-3
        assert max(float((record["combine"][k] - record["global"][k]).abs().max()) for k in PARAMS) > 1e-3
    assert len(golden["rounds"]) == ROUNDS and golden["rounds"][-1]["rounds_after"] == ROUNDS
