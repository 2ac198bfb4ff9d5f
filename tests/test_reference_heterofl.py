"""HeteroFL against the authors' code (``tools/reference/heterofl.py``; provenance in
``tests/data/reference/heterofl/provenance.json``): three rounds on unequal Dirichlet shards at
rates 1, 1/2 and 1/4, the Scaler, momentum 0.9, clipping at 1, static BN with the sBN pass.

Both sides ran in float64 and ours runs in float64 here, from the stored initial model and
images (the digits' grey levels), so the tolerance is float64 rounding (``float64_bound``).
Compared after every round: each client's sub-model as sent and as trained, the global model,
and the statistics of the served model (ours: ``statistics.served``, one pass over the client
data; theirs: ``stats`` on the same batches). Only the stored figures are read."""

from dataclasses import replace

import pytest
import torch

from reference_case import (TRAIN, ServedStatisticsLog, assert_close, batch_digest, float64_bound, load, make_spec,
                            run_rounds)

from fl_lightning.elastic.models import CNN

BATCH_TERMS = 32 * 8 * 8  # the longest sums of a training step: a batch's 8x8 positions (BN, conv gradients)
SBN_TERMS = 100 * 8 * 8 * 14  # the sBN pass: 14 batches of 100 at 8x8 positions, averaged


def run_ours(case, out_dir, **options):
    from fl_lightning.algorithms.submodel import HeteroFL

    variant = {"weighting": "uniform"} if case["variant"] == "uniform" else {}
    alg = HeteroFL(caps=case["caps"], **{"bn": "sbn", "sbn_data": "train", "scaler": True, **variant, **options})
    sent, rounds = {}, case["rounds"]
    route = alg.route

    def routed(task, plan):
        out = route(task, plan)
        sent[(plan.round_idx, task.client)] = {k: v.detach().clone() for k, v in out.module.state_dict().items()}
        return out

    alg.route = routed
    spec = make_spec(out_dir, alg, clients_per_round=3, rounds=rounds,
                     train=replace(TRAIN, lr=case["lr"], momentum=case["momentum"], grad_clip=case["grad_clip"]))
    served = ServedStatisticsLog()
    run = run_rounds(spec, rounds, dtype=torch.float64, levels=case["levels"], initial=case["initial"],
                     after_round=served)
    return run, sent, served


def assert_same_case(case, run, served):
    """Our run trains the stored cohorts on the stored batches, and our sBN pass reads the
    stored batches, else the golden values are about another case."""
    sizes = {c: len(run.fed.ctx.shards[c]) for c in range(run.fed.ctx.num_clients)}
    assert sizes == case["sizes"] and len(set(sizes.values())) > 1  # unequal shards
    assert run.cohorts == case["cohorts"]
    for r, cohort in enumerate(run.cohorts):
        assert sorted(case["caps"][c] for c in cohort) == [0.25, 0.5, 1.0]
        for c in cohort:
            assert [batch_digest(x, y) for x, y in run.batches[r][c]] == case["digests"][r][c], (r, c)
    for log in served.rounds:
        assert [batch_digest(x, y) for x, y in log["batches"]] == case["sbn_digests"]


def tolerance(case, golden) -> float:
    steps = sum(max(len(d) for d in rnd.values()) for rnd in case["digests"])  # the longest chain of steps
    scale = max(float(v.abs().max()) for rnd in golden["rounds"] for part in ("global", "stats")
                for v in rnd[part].values())
    return float64_bound(steps, BATCH_TERMS, scale) + float64_bound(1, SBN_TERMS, scale)


@pytest.fixture(scope="module", params=["uniform", "samples"])
def compared(request, tmp_path_factory):
    golden = load("heterofl", f"{request.param}.pt")
    run, sent, served = run_ours(golden["case"], tmp_path_factory.mktemp(request.param))
    return golden, run, sent, served


def test_heterofl_rounds_match_the_authors_code(compared):
    """``uniform``: the authors' ``combine`` (the plain mean over the clients holding each
    position) against ours with ``weighting: uniform``; ``samples``: our default, against
    ``combine`` with each client's count replaced by its examples. Shards are unequal (111 to
    273), so the two rules give different models, and a rule weighting by client count fails
    ``samples``."""
    golden, run, sent, served = compared
    case = golden["case"]
    assert_same_case(case, run, served)
    tol = tolerance(case, golden)
    assert tol < 1e-8
    for r, (theirs, cohort) in enumerate(zip(golden["rounds"], run.cohorts)):
        for c in cohort:
            assert_close(sent[(r, c)], theirs["sent"][c], tol, f"round {r} client {c} sent")
            assert_close(run.returned[r][c], theirs["locals"][c], tol, f"round {r} client {c} trained")
        assert_close(run.globals[r], theirs["global"], tol, f"round {r} global")
        assert max(float((run.globals[r][k] - run.globals[r - 1 if r else 0][k]).abs().max())
                   for k in theirs["global"]) > 1e-3 or r == 0
    assert max(float((run.globals[-1][k].double() - run.initial[k].double()).abs().max())
               for k in golden["rounds"][-1]["global"]) > 1e-2


def test_heterofl_served_statistics_match_the_authors_sbn_pass(compared):
    """After every round, the served model's BN statistics (our sBN pass over the union of the
    client shards) equal those of the authors' ``stats`` (a tracked copy, ``momentum=None``, in
    train mode over the same batches)."""
    golden, run, sent, served = compared
    case = golden["case"]
    tol = tolerance(case, golden)
    for r, (theirs, log) in enumerate(zip(golden["rounds"], served.rounds)):
        assert_close(log["stats"], theirs["stats"], tol, f"round {r} statistics")
    # the statistics move with the model: the pass is not reading stale or initial values
    first, last = served.rounds[0]["stats"], served.rounds[-1]["stats"]
    assert max(float((first[k] - last[k]).abs().max()) for k in first) > 1e-3


def test_the_weighting_and_the_scaler_show(tmp_path):
    """What the case can see: the two rules are far apart on these shards, and ours without the
    Scaler (which only changes batch norm's epsilon by p^2, so its effect is small) leaves the
    tolerance after the first round."""
    uniform, samples = load("heterofl", "uniform.pt"), load("heterofl", "samples.pt")
    keys = list(uniform["rounds"][0]["global"])
    apart = max(float((uniform["rounds"][0]["global"][k] - samples["rounds"][0]["global"][k]).abs().max())
                for k in keys)
    assert apart > 1e-3
    case = uniform["case"]
    run, _, _ = run_ours({**case, "rounds": 1}, tmp_path, scaler=False)
    diff = max(float((run.globals[0][k].double() - uniform["rounds"][0]["global"][k].double()).abs().max())
               for k in keys)
    assert diff > 100 * tolerance(case, uniform)


def test_heterofl_extraction_matches_split_model():
    """The sub-model of a CNN of 6 and 10 channels at the paper's five rates (1 to 1/16): the
    same shapes (``ceil(rate * C)`` channels, every class kept) and the same leading slices as
    the authors' Federation.distribute."""
    from fl_lightning.elastic.models import build_model
    from fl_lightning.elastic.specs import WidthSpec

    golden = load("heterofl", "extraction.pt")
    model = build_model(CNN, 10, (1, 8, 8), channels=[6, 10])
    state = model.state_dict()
    state.update(golden["global"])
    model.load_state_dict(state)
    for rate, theirs in zip(golden["rates"], golden["sent"]):
        ours = model.extract(WidthSpec.uniform(rate, 2)).module.state_dict()
        for key, value in theirs.items():
            assert ours[key].shape == value.shape, (rate, key)
            assert torch.equal(ours[key], value), (rate, key)
