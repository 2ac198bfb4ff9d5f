"""Golden values of SuperFedNAS and DeepFedNAS from their authors' code (``tools/reference/
superfednas.py``, ``tools/reference/deepfednas.py``; provenance in
``tests/data/reference/<method>/provenance.json``).

The case (``tests/reference_fednas_case.py``): our unconstrained transfer on a tiny supernet equal
to the reference's network, 3 clients all in both rounds, plain SGD without Mixup/CutMix. The
authors' ``train_one_round`` ran twice on the same initial supernet and the batches our loop
drew; stored are its tracking-sandwich roles, MaxNet weights, each client's trained subnet of
round 0 and the supernet after each round. Nothing here runs the reference code."""

import pytest

from reference_case import float32_bound, load
from reference_fednas_case import ROUNDS, batch_fingerprints, float_state, run_case, state_fingerprint

# The references ran in float32: a bound on float32 rounding over the case's sequential steps (3
# batches of 8 per client and round), its longest sums (a batch of 8 at 8x8 positions: BN
# statistics, conv weight gradients) and the magnitude of the values (``float32_bound``).
TERMS = 8 * 8 * 8


def tolerance(case, values) -> float:
    steps = ROUNDS * max(len(b) for b in case["batches"].values())
    return float32_bound(steps, TERMS, max(float(v.abs().max()) for v in values))
METHODS = ["superfednas", "deepfednas"]
BN = {"trained": "authors", "frozen": "authors_frozen"}
"""Batch norm trained (the originals with ``--use_bn``; our transfer's default, FEAST's client)
or held at the identity (the originals' default; ours with ``frozen_bn``)."""


def golden(method, bn="trained"):
    name = BN[bn]
    main = load(method, f"{name}.pt")
    return {**main, "locals": load(method, f"{name}_locals.pt")["locals"],
            "globals": [main["global"], load(method, f"{name}_round1.pt")["global"]]}


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    runs = {}

    def get(method, bn="trained"):
        if (method, bn) not in runs:
            runs[(method, bn)] = run_case(method, tmp_path_factory.mktemp(method), frozen_bn=bn == "frozen")
        return runs[(method, bn)]
    return get


def max_abs_diff(a, b) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def assert_same_case(stored, case):
    """Our run starts from the stored supernet, trains on the stored batches and plans the
    stored rounds (architectures, roles, weights), else the golden values are about another case.

    The stored fingerprints hash exact bytes, so only those of integer tensors (labels, batch
    counters) are compared: a float tensor computed on another CPU (initial weights, normalized
    images) differs in its last bits, which the golden values' tolerance absorbs, while another
    case would fail them by far."""
    initial = state_fingerprint(case["initial"])
    assert initial.keys() == stored["initial"].keys()
    exact = [k for k, v in case["initial"].items() if not v.is_floating_point()]
    assert exact and all(initial[k] == stored["initial"][k] for k in exact)
    ours = batch_fingerprints(case["batches"])
    assert ours.keys() == stored["batches"].keys()
    for key, pairs in ours.items():
        assert [y for _, y in pairs] == [y for _, y in stored["batches"][key]], key
    assert case["rounds"] == stored["rounds"]


@pytest.mark.parametrize("method", METHODS)
def test_sandwich_roles_and_maxnet_weights_match_the_authors_code(method, ours):
    """Per round: the max role goes to the client the authors' ``update_sample`` puts in
    ``largest_subnet_min_idx``, the min role to its ``smallest_subnet_min_idx``; every client's
    MaxNet weight is ``maxnet_cos_all_subnet``'s (c(0) = 0.9 on client 0, c(1) = 0.7865 on client
    1, (1 - c) / 2 on the others); the tracking counts after two rounds agree (round 1's random
    DeepFedNAS client drew the path's largest architecture and counts as "largest" on both
    sides); each client trained at the authors' rate."""
    case, g = ours(method), golden(method)
    assert_same_case(g["case"], case)
    ref = g["reference"]
    for r, (rnd, roles, weights) in enumerate(zip(case["rounds"], ref["roles"], ref["weights"])):
        by_role = {t["role"]: t["client"] for t in rnd["tasks"]}
        assert [by_role["max"]] == roles["largest"] and [by_role["min"]] == roles["smallest"], r
        assert [t["client"] for t in rnd["tasks"]] == list(range(len(weights)))
        assert [t["maxnet_weight"] for t in rnd["tasks"]] == pytest.approx(weights, abs=1e-12)
        for t in rnd["tasks"]:
            assert ref["lrs"][(r, t["client"])] == pytest.approx(rnd["lr"])
    assert ref["weights"][0][0] == pytest.approx(0.9) and ref["weights"][1][1] == pytest.approx(0.7865038777)
    assert case["tracking"] == ref["tracking"]


@pytest.mark.parametrize("method", METHODS)
def test_maxnet_schedule_matches_the_authors_code_through_and_after_the_anneal(method):
    """``maxnet_cos_all_subnet`` for rounds 0..2T (T = 4 anneal rounds, the max client at cohort
    position 1): ours, ``maxnet_weights(3, 1, maxnet_coefficient(t, T))``, from 0.9 down to 0.125
    and held there."""
    from fl_lightning.elastic.maxnet import maxnet_coefficient, maxnet_weights

    from reference_fednas_case import CLIENTS, MAXNET_STEPS

    theirs = golden(method)["reference"]["schedule"]
    assert len(theirs) == 2 * MAXNET_STEPS + 1
    for t, weights in enumerate(theirs):
        assert maxnet_weights(CLIENTS, 1, maxnet_coefficient(t, MAXNET_STEPS)) == pytest.approx(weights, abs=1e-12), t
    assert theirs[MAXNET_STEPS][1] == pytest.approx(0.125) and theirs[-1] == theirs[MAXNET_STEPS]


@pytest.mark.parametrize("bn", list(BN))
@pytest.mark.parametrize("method", METHODS)
def test_client_subnets_match_the_authors_subnet_trainer(method, bn, ours):
    """Round 0: each client's trained subnet (extracted from the same supernet: the authors'
    ``get_subnet`` and ours hold the same tensors, name for name and shape for shape), after the
    authors' ``SubnetTrainer.train`` (cross-entropy, SGD with weight decay, clipping; batch norm
    in training mode with ``--use_bn``, else held at the identity in evaluation mode) against
    ours, every floating entry including running statistics."""
    case, g = ours(method, bn), golden(method, bn)
    assert_same_case(g["case"], case)
    assert g["reference"]["same_function"] < 1e-5  # the extracted networks compute the same logits
    for client, theirs in g["locals"].items():
        mine = float_state(case["locals"][(0, client)])
        assert max_abs_diff(mine, theirs) < tolerance(case, theirs.values()), client
        initial_slices = {k: case["initial"][k][tuple(slice(0, n) for n in v.shape)] for k, v in mine.items()}
        assert max_abs_diff(mine, initial_slices) > 1e-3  # the client did train


@pytest.mark.parametrize("bn", list(BN))
@pytest.mark.parametrize("method", METHODS)
def test_supernet_after_each_round_matches_the_authors_aggregation(method, bn, ours):
    """The supernet after round 0 and after round 1 (the authors' ``_aggregate``: per position
    the MaxNet-weighted sum over the clients whose subnet covers it divided by the sum of their
    weights, the old value where nobody does), every floating entry of ours. Frozen, every
    batch norm the clients held comes back at the identity: the running statistics aggregate to
    0 and 1 wherever a client covered them, on both sides."""
    case, g = ours(method, bn), golden(method, bn)
    assert_same_case(g["case"], case)
    for r in range(ROUNDS):
        mine = float_state(case["globals"][r])
        assert max_abs_diff(mine, g["globals"][r]) < tolerance(case, g["globals"][r].values()), r
    assert max_abs_diff(float_state(case["globals"][1]), float_state(case["initial"])) > 1e-3
    variances = [k for k in g["globals"][1] if k.endswith("running_var")]
    trained = max(float((g["globals"][1][k] - 1).abs().max()) for k in variances)
    assert (trained == 0.0) if bn == "frozen" else (trained > 1e-3)


def test_deepfednas_path_is_read_and_counted_as_the_authors_do(ours):
    """The authors' ``_prepare_subnet_cache`` sorts the path by MACs from their counter
    (``subnet_macs``); it comes out in our order, with our MACs, and its ends are the min and
    max roles' architectures."""
    case, g = ours("deepfednas"), golden("deepfednas")
    ref = g["reference"]
    blocks = len(ref["path"][0]["e"]) // len(ref["path"][0]["d"])
    theirs = [{"d": a["d"], "e": a["e"][::blocks], "w": a["w_indices"]} for a in ref["path"]]
    assert theirs == case["path"]
    assert all(a["e"] == [a["e"][0]] * blocks + [a["e"][blocks]] * blocks for a in ref["path"])
    assert ref["path_macs"] == case["path_macs"]
    assert ref["op_smallest"] == ref["path"][0] and ref["op_largest"] == ref["path"][-1]
    by_role = {t["role"]: t["spec"] for t in case["rounds"][0]["tasks"]}
    assert by_role["min"] == case["path"][0] and by_role["max"] == case["path"][-1]


def test_the_comparison_sees_a_changed_maxnet_weight(ours, tmp_path):
    """The golden supernet is sensitive to the rule compared: with the max role's coefficient
    0.8 instead of 0.9 our round-0 supernet leaves the authors' by far more than the tolerance."""
    from reference_fednas_case import algorithm

    alg = algorithm("superfednas", tmp_path)
    alg.maxnet_init = 0.8
    case = run_case("superfednas", tmp_path, alg=alg)
    g = golden("superfednas")
    assert state_fingerprint(case["initial"]) == g["case"]["initial"]
    assert max_abs_diff(float_state(case["globals"][0]), g["globals"][0]) > 100 * tolerance(case, g["globals"][0].values())
