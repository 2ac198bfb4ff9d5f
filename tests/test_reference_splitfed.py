"""SplitFed V1 and V2 against the authors' scripts (``tools/reference/splitfed.py``,
``tools/reference/splitfed_v2.py``; provenance in ``tests/data/reference/<method>/``): three
rounds on unequal Dirichlet shards, momentum 0.9, BN statistics tracked and averaged (ours with
``bn: aggregated``), in two variants: ``uniform`` (the scripts' plain-mean ``FedAvg``; ours with
``weighting: uniform``) and ``samples`` (the example-weighted mean; ours by default).

Both sides ran in float64 and ours runs in float64 here, from the stored initial model and
images, so the tolerance is float64 rounding (``float64_bound``). Compared after every round,
every floating entry (BN statistics included): V1 each client's trained front and server copy
and the global model; V2 each client's trained front, the server half after the round (it
carries across clients and rounds, with its momentum) and the global model. Integer buffers
(``num_batches_tracked``) are not compared: ours keep the global value, the scripts average
them as floats. Only the stored figures are read."""

from dataclasses import replace

import pytest
import torch

from reference_case import TRAIN, assert_close, batch_digest, float64_bound, load, make_spec, run_rounds

BATCH_TERMS = 32 * 8 * 8  # the longest sums of a step: a batch's 8x8 positions (BN, conv gradients)


def run_ours(case, out_dir, **options):
    from fl_lightning.algorithms.split.splitfed import SplitFed

    variant = {"weighting": "uniform"} if case["variant"] == "uniform" else {}
    alg = SplitFed(cut=case["cut"], version=case["version"], **{"bn": "aggregated", **variant, **options})
    spec = make_spec(out_dir, alg, clients_per_round=case["clients_per_round"], rounds=case["rounds"],
                     train=replace(TRAIN, lr=case["lr"], momentum=case["momentum"]))
    return run_rounds(spec, case["rounds"], dtype=torch.float64, levels=case["levels"], initial=case["initial"])


def floats(state, keys):
    return [k for k in keys if state[k].is_floating_point()]


def assert_same_case(case, run):
    sizes = {c: len(run.fed.ctx.shards[c]) for c in range(run.fed.ctx.num_clients)}
    assert sizes == case["sizes"] and len({sizes[c] for cohort in run.cohorts for c in cohort}) > 2
    assert run.cohorts == case["cohorts"]
    for r, cohort in enumerate(run.cohorts):
        for c in cohort:
            assert [batch_digest(x, y) for x, y in run.batches[r][c]] == case["digests"][r][c], (r, c)


def tolerance(case, golden, sequential: bool) -> float:
    """V1: a client's chain is its own steps in each round; V2: the server half's chain is
    every step of every client of every round."""
    per_round = [sum(len(d) for d in rnd.values()) if sequential else max(len(d) for d in rnd.values())
                 for rnd in case["digests"]]
    scale = max(float(v.abs().max()) for rnd in golden["rounds"] for v in rnd["global"].values()
                if v.is_floating_point())
    return float64_bound(sum(per_round), BATCH_TERMS, scale)


def halves_of(run, cut):
    from fl_lightning.elastic.split import split_keys

    front, back = split_keys(run.fed.ctx.model, cut)
    state = run.initial
    return floats(state, front), floats(state, back)


@pytest.fixture(scope="module", params=["uniform", "samples"])
def v1(request, tmp_path_factory):
    golden = load("splitfed", f"{request.param}.pt")
    return golden, run_ours(golden["case"], tmp_path_factory.mktemp(request.param))


def test_splitfed_v1_rounds_match_the_authors_code(v1):
    """Every client's front and server copy as trained (their ``Client.train`` with
    ``train_server`` per batch on a copy per client), and the global model after the averages
    of fronts and of server copies, after each of the three rounds."""
    golden, run = v1
    case = golden["case"]
    assert_same_case(case, run)
    front, back = halves_of(run, case["cut"])
    tol = tolerance(case, golden, sequential=False)
    assert tol < 1e-9
    for r, theirs in enumerate(golden["rounds"]):
        for c in run.cohorts[r]:
            returned = run.returned[r][c]
            ours = {**{k: returned["front." + k] for k in front}, **{k: returned["back." + k] for k in back}}
            assert_close(ours, {k: theirs["locals"][c][k] for k in front + back}, tol, f"round {r} client {c}")
        assert_close(run.globals[r], {k: theirs["global"][k] for k in front + back}, tol, f"round {r} global")
    assert max(float((run.globals[-1][k] - run.initial[k].double()).abs().max()) for k in front + back) > 1e-2


def test_splitfed_variants_differ_on_these_shards():
    """The plain and the example-weighted means are far apart here (shards 111 to 273), so a
    rule weighting by client count fails ``samples`` and one weighting by examples ``uniform``."""
    for method in ("splitfed", "splitfed_v2"):
        uniform, samples = load(method, "uniform.pt"), load(method, "samples.pt")
        first = uniform["rounds"][0]["global"]
        keys = [k for k, v in first.items() if v.is_floating_point()]
        assert max(float((first[k] - samples["rounds"][0]["global"][k]).abs().max()) for k in keys) > 1e-3


@pytest.fixture(scope="module", params=["uniform", "samples"])
def v2(request, tmp_path_factory):
    golden = load("splitfed_v2", f"{request.param}.pt")
    return golden, run_ours(golden["case"], tmp_path_factory.mktemp(request.param))


def test_splitfed_v2_rounds_match_the_authors_code(v2):
    """The script's V2 loop, round after round: one server half stepped on every batch of every
    client in our shuffled order (6 5 4, 5 1 2, 6 5 1), its momentum carried from client to
    client and round to round; every client's front from the round's global front; the fronts
    averaged. Compared after each round: every client's front, the server half, the global."""
    golden, run = v2
    case = golden["case"]
    assert_same_case(case, run)
    assert all(order != sorted(order) for order in run.cohorts)
    front, back = halves_of(run, case["cut"])
    tol = tolerance(case, golden, sequential=True)
    assert tol < 1e-8
    for r, theirs in enumerate(golden["rounds"]):
        for c in run.cohorts[r]:
            returned = run.returned[r][c]
            assert_close({k: returned["front." + k] for k in front}, {k: theirs["locals"][c][k] for k in front},
                         tol, f"round {r} client {c} front")
        assert_close(run.globals[r], {k: theirs["server"][k] for k in back}, tol, f"round {r} server half")
        assert_close(run.globals[r], {k: theirs["global"][k] for k in front + back}, tol, f"round {r} global")
    assert max(float((run.globals[-1][k] - run.initial[k].double()).abs().max()) for k in front + back) > 1e-2
