"""FedProx and SCAFFOLD against PFLlib (``tools/reference/fedprox.py``,
``tools/reference/scaffold.py``; provenance in ``tests/data/reference/<method>/``): three rounds
on unequal Dirichlet shards of 8 clients, 3 per round, the project's one-block ViT (no batch
norm), plain SGD (PFLlib's clients have no momentum).

Both sides ran in float64 and ours runs in float64 here, from the stored initial model and
images, so the tolerance is float64 rounding. FedProx (``mu`` 0.01, our default): after every
round each client's trained model and the global model (PFLlib's sample-weighted
``aggregate_parameters``). SCAFFOLD, ``uniform`` (PFLlib's ``1/|S|`` step, ours ``weighting:
uniform``) and ``samples`` (our default): after every round the global model, the server control
variate ``c`` and every cohort client's ``c_i`` (carried to its next round). Only the stored
figures are read."""

import pytest
import torch

from reference_case import (TRAIN, VIT, assert_close, batch_digest, float64_bound, load, make_spec, run_rounds,
                            unpack)

# the longest sums of a step: the ViT's 5 tokens x width 32 (MLP) per example, a batch of 32
BATCH_TERMS = 32 * 5 * 32


def run_ours(alg, case, out_dir, after_round=None):
    spec = make_spec(out_dir, alg, clients_per_round=case["clients_per_round"], rounds=case["rounds"], model=VIT,
                     train=TRAIN.__class__(**{**TRAIN.__dict__, "lr": case["lr"], "momentum": 0.0}))
    run = run_rounds(spec, case["rounds"], dtype=torch.float64, levels=case["levels"],
                     initial=unpack(case["initial"]), after_round=after_round)
    sizes = {c: len(run.fed.ctx.shards[c]) for c in range(run.fed.ctx.num_clients)}
    assert sizes == case["sizes"] and run.cohorts == case["cohorts"]
    assert len({sizes[c] for cohort in run.cohorts for c in cohort}) > 3  # unequal shards
    for r, cohort in enumerate(run.cohorts):
        for c in cohort:
            assert [batch_digest(x, y) for x, y in run.batches[r][c]] == case["digests"][r][c], (r, c)
    return run


def tolerance(case, golden) -> float:
    steps = sum(max(len(d) for d in rnd.values()) for rnd in case["digests"])
    scale = max(float(unpack(rnd["global"])[k].abs().max()) for rnd in golden["rounds"]
                for k in unpack(rnd["global"]))
    return float64_bound(steps, BATCH_TERMS, scale)


def test_fedprox_rounds_match_pfllib(tmp_path):
    """PFLlib's clientProx (``w -= lr (g + mu (w - w_global))``) and the sample-weighted
    ``aggregate_parameters``, three rounds: every trained model and the global model."""
    from fl_lightning.algorithms.fedprox import FedProx

    golden = load("fedprox", "pfllib.pt")
    case = golden["case"]
    assert FedProx().mu == case["mu"]  # our default
    run = run_ours(FedProx(), case, tmp_path)
    tol = tolerance(case, golden)
    assert tol < 1e-9
    for r, theirs in enumerate(golden["rounds"]):
        for c in run.cohorts[r]:
            assert_close(run.returned[r][c], unpack(theirs["locals"][c]), tol, f"round {r} client {c}")
        assert_close(run.globals[r], unpack(theirs["global"]), tol, f"round {r} global")
    assert max(float((run.globals[-1][k] - run.initial[k]).abs().max()) for k in run.globals[-1]) > 1e-2


@pytest.mark.parametrize("variant", ["uniform", "samples"])
def test_scaffold_rounds_match_pfllib(tmp_path, variant):
    """PFLlib's clientSCAFFOLD (corrected steps, option II ``c_i``) and the server step, three
    rounds: the global model, ``c`` and every cohort client's ``c_i`` after each round (client
    1 and 5 train again after round 0, with the ``c_i`` they kept)."""
    from fl_lightning.algorithms.scaffold import Scaffold

    golden = load("scaffold", f"{variant}.pt")
    case = golden["case"]
    states = []

    def after(r, fed):
        alg = fed.algorithm
        states.append({"c": {k: v.clone() for k, v in alg.c.items()},
                       "c_i": {cl: {k: v.clone() for k, v in alg.store.get(cl).items()} for cl in case["cohorts"][r]}})

    run = run_ours(Scaffold(**case["options"]), case, tmp_path, after_round=after)
    assert any(c in case["cohorts"][r] for r in range(1, case["rounds"]) for c in case["cohorts"][0])
    tol = tolerance(case, golden)
    assert tol < 1e-9
    for r, theirs in enumerate(golden["rounds"]):
        assert_close(run.globals[r], unpack(theirs["global"]), tol, f"round {r} global")
        # c and c_i scale as (x - y) / (K lr): their rounding is the model's divided by K lr
        k_lr = min(len(d) for d in case["digests"][r].values()) * case["lr"]
        assert_close(states[r]["c"], unpack(theirs["c"]), tol / k_lr, f"round {r} c")
        for c in run.cohorts[r]:
            assert_close(states[r]["c_i"][c], unpack(theirs["client_c"][c]), tol / k_lr, f"round {r} c_{c}")
    assert max(float(v.abs().max()) for v in states[-1]["c"].values()) > 1e-2
