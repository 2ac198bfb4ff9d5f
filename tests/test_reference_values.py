"""Golden values from the reference implementations (``tools/reference/``, provenance in
``tests/data/reference/<method>/provenance.json``): our implementation on the same one-round
case (the stored initial model, the stored batches) against what the reference code produced.
Nothing here reaches a network or the reference code: only the stored figures are read."""

from dataclasses import replace

import pytest
import torch

from reference_case import CNN_TERMS, VIT_TERMS, TRAIN, float32_bound, load, make_spec, max_abs_diff, run_one_round

# Tolerances: these cases' references ran in float32, so each test bounds float32 rounding over
# its case's sequential steps, longest sums and magnitudes (``float32_bound``).


def same_values(ours: torch.Tensor, stored: torch.Tensor) -> bool:
    """Equal, up to the last bits of float32 where the tensors are float: the stored case was
    made on another CPU, whose initializers and image transforms round differently (a few ulps);
    the golden comparisons' tolerances are far above that, and another case would be far off."""
    if not ours.is_floating_point():
        return torch.equal(ours, stored)
    return ours.shape == stored.shape and torch.allclose(ours.double(), stored.double(), rtol=1e-6, atol=1e-7)


def assert_same_case(case, initial, cohort, batches):
    """Our run starts from the stored model and trains on the stored batches (else the golden
    values would be about another case)."""
    assert list(cohort) == list(case["cohort"])
    for key, value in case["initial"].items():
        assert same_values(initial[key], value), key
    for client in case["cohort"]:
        ours, stored = batches[client], case["batches"][client]
        assert len(ours) >= len(stored)
        for (x, y), (xs, ys) in zip(ours, stored):
            assert same_values(x, xs) and torch.equal(y, ys)


def scale_of(state, keys) -> float:
    return max(float(state[k].abs().max()) for k in keys if state[k].is_floating_point())


def within(ours, theirs, keys, steps: int, terms: int) -> None:
    """Every key of ``theirs`` within ``float32_bound`` of ours at that tensor's own magnitude."""
    for k in keys:
        tol = float32_bound(steps, terms, float(theirs[k].abs().max()))
        diff = float((ours[k].double() - theirs[k].double()).abs().max())
        assert diff < tol, f"{k}: {diff:.3g} >= {tol:.3g}"


def float_keys(state, skip=()):
    return [k for k, v in state.items() if v.is_floating_point() and k not in skip]


# -- FedBABU -------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["authors", "pfllib"])
def test_fedbabu_round_matches_reference(tmp_path, source):
    """One round of body-only local training and aggregation. Authors' code (momentum 0.9, equal
    shards, plain mean of the state dicts): every floating entry, running statistics included.
    PFLlib (plain SGD, unequal shards, sample weights): parameters (PFLlib keeps the first
    client's buffers)."""
    from fl_lightning.algorithms.personalized.fedbabu import FedBABU

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
    within(ours, golden["global"], keys, max(len(batches[c]) for c in cohort), CNN_TERMS)
    for key in ("fc.weight", "fc.bias"):  # the head never moves
        assert torch.equal(ours[key], initial[key])


# -- FedGH ---------------------------------------------------------------------------------------
def test_fedgh_round_matches_pfllib(tmp_path):
    """Local training of the whole model from the initial body and global header, the
    prototypes (class means of the trained body's representations), and the server's header
    step on them, against PFLlib's clientGH/FedGH on a network without batch norm."""
    from fl_lightning.algorithms.personalized.fedgh import FedGH
    from fl_lightning.algorithms.personalized.head_body import class_prototypes, find_classifier

    from reference_case import VIT

    golden = load("fedgh", "pfllib.pt")
    case = golden["case"]
    spec = make_spec(tmp_path, FedGH(server_lr=case["server_lr"], server_batch_size=case["server_batch_size"]),
                     model=VIT, train=replace(TRAIN, lr=case["lr"], momentum=0.0))
    fed, initial, cohort, batches = run_one_round(spec)
    assert_same_case(case, initial, cohort, batches)
    alg, ctx = fed.algorithm, fed.ctx
    header = list(golden["header"])
    # local steps, then one server step on the prototypes
    steps = max(len(batches[c]) for c in cohort) + 1
    within(alg.global_state, golden["header"], header, steps, VIT_TERMS)
    assert max_abs_diff(alg.global_state, initial, header) > 1e-3  # the header did move
    _, classifier = find_classifier(alg.worker)
    for client in cohort:
        body = golden["bodies"][client]
        within(alg.store.states[client], body, list(body), steps, VIT_TERMS)
        alg.worker.load_state_dict({**initial, **body})
        shard = ctx.shards[client]
        prototypes, counts = class_prototypes(alg.worker, classifier, shard.dataset, shard.indices, 10,
                                              TRAIN.batch_size, batch_stats=True)
        theirs = golden["prototypes"][client]
        assert sorted(theirs) == [c for c in range(10) if counts[c] > 0]
        for c, proto in theirs.items():
            assert float((prototypes[c] - proto).abs().max()) < float32_bound(steps, VIT_TERMS, float(proto.abs().max()))


# -- FedAS ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["authors", "pfllib"])
def test_fedas_round_matches_reference(tmp_path, source):
    """Alignment of the global body to the client's prototypes, local training, Fisher trace and
    the Fisher-weighted aggregate, against the authors' clientAS/FedAS (one client per round)
    and PFLlib's (two), on a network without batch norm."""
    from fl_lightning.algorithms.personalized.fedas import FedAS

    from reference_case import VIT

    golden = load("fedas", f"{source}.pt")
    case = golden["case"]
    spec = make_spec(tmp_path, FedAS(), model=VIT, train=replace(TRAIN, lr=case["lr"], momentum=0.0),
                     clients_per_round=len(case["cohort"]))
    fed, initial, cohort, batches = run_one_round(spec)
    assert_same_case(case, initial, cohort, batches)
    for client in cohort:  # the alignment batches too
        for (x, y), (xs, ys) in zip(batches[(client, 16)], case["align_batches"][client]):
            assert same_values(x, xs[:len(x)]) and torch.equal(y, ys[:len(y)])
    alg = fed.algorithm
    fisher = {row["client"]: row["fisher_trace"] for row in fed.client_rows}
    keys = list(golden["global"])
    # alignment steps, local steps, the Fisher pass (a relative error) and the weighted mean
    steps = max(len(batches[(c, 16)]) + len(batches[c]) for c in cohort) + 2
    for client in cohort:
        assert fisher[client] == pytest.approx(golden["fisher"][client], rel=float32_bound(steps, VIT_TERMS, 1.0))
        local = golden["locals"][client]
        within(alg.store.states[client], local, list(local), steps, VIT_TERMS)
    within(alg.global_state, golden["global"], keys, steps, VIT_TERMS)
    assert max_abs_diff(alg.global_state, initial, keys) > 1e-3


# -- FedMut --------------------------------------------------------------------------------------
def test_fedmut_round_and_mutations_match_the_authors_code(tmp_path):
    """Round 0 (local training from the initial model, the plain mean) and the models sent in
    round 1 against the authors' LocalUpdate_FedMut/Aggregation/mutation_spread. The signs come
    from different generators, so per tensor each of our two clients must hold one of the
    authors' two mutated values (``w_g + 4 g`` or ``w_g - 4 g``), and not the same one."""
    from fl_lightning.algorithms.fedmut import FedMut

    golden = load("fedmut", "authors.pt")
    case = golden["case"]
    spec = make_spec(tmp_path, FedMut(alpha=case["alpha"], mutate_buffers=True))
    fed, initial, cohort, batches = run_one_round(spec)
    assert_same_case(case, initial, cohort, batches)
    alg = fed.algorithm
    keys = float_keys(alg.global_state)
    plus, minus = golden["mutated"]
    # the local steps; the mutation w_g +- alpha g adds one step
    steps = max(len(batches[c]) for c in cohort) + 1
    within(alg.global_state, golden["global"], keys, steps, CNN_TERMS)
    plan = alg.plan(1)
    assert len(plan.tasks) == 2
    sent = []
    for task in plan.tasks:
        sent.append({k: v.clone() for k, v in alg.route(task, plan).module.state_dict().items()})
    for key in keys:
        picks = []
        for state in sent:
            d = [float((state[key] - ref[key]).abs().max()) for ref in (plus, minus)]
            assert min(d) < float32_bound(steps, CNN_TERMS, max(scale_of(plus, [key]), scale_of(minus, [key]))), key
            picks.append(d.index(min(d)))
        assert sorted(picks) == [0, 1], key  # balanced: one client each way
        assert float((plus[key] - minus[key]).abs().max()) > 0 or key.endswith("num_batches_tracked")


# -- ScaleFL -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kd_active", [True, False])
def test_scalefl_objective_matches_the_authors_kdloss(kd_active):
    """The client objective of three exits and its gradients with respect to every exit's
    logits (the teacher not detached), against the authors' KDLoss and train.py weighting."""
    from fl_lightning.modules.scalefl_client import scalefl_loss

    golden = load("scalefl", "authors.pt")
    logits = [z.clone().requires_grad_() for z in golden["logits"]]
    loss = scalefl_loss(logits, golden["target"], golden["gamma"], golden["temperature"], kd_active=kd_active)
    loss.backward()
    expected = golden["results"][kd_active]
    # one evaluation: softmaxes and sums over a batch's logits of every exit
    terms = sum(z.numel() for z in golden["logits"])
    tol = float32_bound(1, terms, max(float(z.abs().max()) for z in golden["logits"]))
    assert abs(float(loss.detach()) - float(expected["loss"])) < tol
    for z, g in zip(logits, expected["grads"]):
        assert float((z.grad - g).abs().max()) < tol


# -- MultiSFL (its rounds: tests/test_reference_multisfl.py) -----------------------------------------
def test_multisfl_replay_requirement_matches_select_helpers():
    """The examples of each class the assistants must provide (``max(C, floor(budget n))``
    shared over the classes below the mean of the branch statistic by their deficit, rounded
    down) and what the greedy pass over the other clients provides, against the authors'
    selectHelpers (their candidate order is Python's shuffle, ours a seeded permutation: the
    per-class totals do not depend on it while the supply suffices)."""
    from fl_lightning.algorithms.split.multisfl import choose_assistants, replay_requirement

    replay = load("multisfl", "authors.pt")["replay"]
    need = replay_requirement(replay["distribution"], replay["client_examples"], replay["budget"])
    assert need.tolist() == replay["provided"].tolist()
    assert int(need.sum()) > 0
    chosen = choose_assistants(need, replay["counts"], replay["client"], torch.Generator().manual_seed(0))
    assert sum(give for _, give in chosen).tolist() == replay["provided"].tolist()
    assert all(helper != replay["client"] for helper, _ in chosen)
