"""MultiSFL against the authors' code (``tools/reference/multisfl.py``; provenance in
``tests/data/reference/multisfl/provenance.json``): two rounds of their ``MultiSFL.main`` on
unequal Dirichlet shards, momentum 0.9, BN statistics tracked (ours ``bn: aggregated``), with
knowledge replay (``replay``, our default; their ``--MR 1``) and without (``no_replay``, their
default). Our replayed examples stand in for the ones their ``random`` draws, chunk by chunk.

Both sides ran in float64 and ours runs in float64 here, from the stored initial model and
images, so the tolerance is float64 rounding. Compared after every round: the master (the plain
mean of the branches), every branch after the weak aggregation (1 : 10), and each branch's
decayed label statistic. Only the stored figures are read."""

import pytest
import torch

from reference_case import TRAIN, assert_close, batch_digest, float64_bound, load, make_spec, run_rounds

BATCH_TERMS = 48 * 8 * 8  # the longest sums of a step: a batch and its replay chunk at 8x8 positions


def merged(chunks):
    """Replay chunks as a step reads them: a one-row last chunk joins the one before."""
    chunks = list(chunks)
    if len(chunks) > 1 and len(chunks[-1][1]) == 1:
        (ax, ay), (bx, by) = chunks[-2], chunks[-1]
        chunks[-2:] = [(torch.cat([ax, bx]), torch.cat([ay, by]))]
    return chunks


def floats(state):
    return {k: v for k, v in state.items() if v.is_floating_point()}


@pytest.fixture(scope="module", params=["replay", "no_replay"])
def compared(request, tmp_path_factory):
    from fl_lightning.algorithms.split.multisfl import MultiSFL

    golden = load("multisfl", f"{request.param}.pt")
    case = golden["case"]
    alg = MultiSFL(bn="aggregated", **case["options"])
    spec = make_spec(tmp_path_factory.mktemp(request.param), alg, rounds=case["rounds"],
                     train=TRAIN.__class__(**{**TRAIN.__dict__, "lr": case["lr"], "momentum": case["momentum"]}))
    snapshots = []

    def after(r, fed):
        a = fed.algorithm
        snapshots.append({"branches": [{k: v.clone() for k, v in b.items()} for b in a.branches],
                          "distributions": a.distribution.clone(), "weights": a.distribution_weight.clone()})

    run = run_rounds(spec, case["rounds"], dtype=torch.float64, levels=case["levels"], initial=case["initial"],
                     after_round=after)
    return golden, run, snapshots


def test_multisfl_rounds_match_the_authors_code(compared):
    golden, run, snapshots = compared
    case = golden["case"]
    alg = run.fed.algorithm
    sizes = {c: len(run.fed.ctx.shards[c]) for c in range(run.fed.ctx.num_clients)}
    assert sizes == case["sizes"] and run.cohorts == case["cohorts"]
    steps = 0
    for r, cohort in enumerate(run.cohorts):
        assert {t.client: t.choice.branch for t in alg.plan(r).tasks} == case["branches"][r]
        for c in cohort:
            assert [batch_digest(x, y) for x, y in run.batches[r][c]] == case["digests"][r][c], (r, c)
            chunks = run.batches[r].get(("replay", c), [])
            if case["variant"] == "replay":
                assert chunks, "no replayed examples"
            assert [batch_digest(x, y) for x, y in merged(chunks)] == case["replay_digests"][r][c], (r, c)
        steps += max(len(case["digests"][r][c]) for c in cohort)
    scale = max(float(v.abs().max()) for rnd in golden["rounds"] for v in floats(rnd["master"]).values())
    tol = float64_bound(steps, BATCH_TERMS, scale)
    assert tol < 1e-9
    for r, theirs in enumerate(golden["rounds"]):
        assert_close(run.globals[r], floats(theirs["master"]), tol, f"round {r} master")
        for b, branch in enumerate(theirs["branches"]):
            assert_close(snapshots[r]["branches"][b], floats(branch), tol, f"round {r} branch {b}")
        for b, (distribution, weight) in enumerate(zip(theirs["distributions"], theirs["weights"])):
            assert torch.allclose(snapshots[r]["distributions"][b], distribution, rtol=1e-12, atol=0)
            assert float(snapshots[r]["weights"][b]) == pytest.approx(weight, rel=1e-12)
    assert max(float((run.globals[-1][k] - run.initial[k].double()).abs().max())
               for k in floats(golden["rounds"][-1]["master"])) > 1e-2


def test_replay_shows():
    """With and without replay the masters differ by far: the default is what is checked."""
    a, b = load("multisfl", "replay.pt"), load("multisfl", "no_replay.pt")
    first, second = floats(a["rounds"][0]["master"]), b["rounds"][0]["master"]
    assert max(float((first[k] - second[k]).abs().max()) for k in first) > 1e-3
