"""How far our implementation is from each multi-round golden case, and the test's tolerance.

    PYTHONPATH=src OMP_NUM_THREADS=1 python tools/reference/distances.py

Runs our side of every float64 case exactly as its test does (the tests' own helpers) and prints,
per case, the largest absolute difference over every compared entry of every round, beside the
tolerance the test derives (``reference_case.float64_bound``). Reads only the stored files.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from reference_case import load, unpack  # noqa: E402


def worst(pairs) -> float:
    out = 0.0
    for ours, theirs in pairs:
        for key, value in theirs.items():
            if value.is_floating_point() and value.numel():
                out = max(out, float((ours[key].double() - value.double()).abs().max()))
    return out


def heterofl():
    import test_reference_heterofl as t

    for variant in ("uniform", "samples"):
        g = load("heterofl", f"{variant}.pt")
        run, sent, served = t.run_ours(g["case"], tempfile.mkdtemp())
        rounds = list(enumerate(g["rounds"]))
        models = worst([(run.returned[r][c], th["locals"][c]) for r, th in rounds for c in run.cohorts[r]]
                       + [(run.globals[r], th["global"]) for r, th in rounds])
        stats = worst([(served.rounds[r]["stats"], th["stats"]) for r, th in rounds])
        yield f"HeteroFL {variant}", {"models": models, "sBN statistics": stats}, t.tolerance(g["case"], g)


def splitfed():
    import test_reference_splitfed as t

    for method, version in (("splitfed", "v1"), ("splitfed_v2", "v2")):
        for variant in ("uniform", "samples"):
            g = load(method, f"{variant}.pt")
            run = t.run_ours(g["case"], tempfile.mkdtemp())
            front, back = t.halves_of(run, g["case"]["cut"])
            rounds = list(enumerate(g["rounds"]))
            fronts = worst([({k: run.returned[r][c]["front." + k] for k in front},
                             {k: th["locals"][c][k] for k in front}) for r, th in rounds for c in run.cohorts[r]])
            globals_ = worst([(run.globals[r], {k: th["global"][k] for k in front + back}) for r, th in rounds])
            tol = t.tolerance(g["case"], g, sequential=version == "v2")
            yield f"SplitFed {version} {variant}", {"fronts": fronts, "global": globals_}, tol


def fjord():
    import test_reference_fjord as t
    from reference_case import float64_bound, make_spec, run_rounds, TRAIN
    from dataclasses import replace
    from fl_lightning.algorithms.submodel import FjORD

    for form in ("round", "step", "step_kd"):
        g = load("fjord", f"{form}.pt")
        case = g["case"]
        alg = FjORD(caps=case["caps"], tiers=case["tiers"], **case["options"])
        train = replace(TRAIN, lr=case["lr"], momentum=case["momentum"], weight_decay=case["weight_decay"])
        spec = make_spec(tempfile.mkdtemp(), alg, clients_per_round=3, rounds=case["rounds"], train=train,
                         model={"class_path": "fl_lightning.elastic.models.CNN",
                                "init_args": {"channels": case["channels"]}})
        run = run_rounds(spec, case["rounds"], dtype=torch.float64, levels=case["levels"], initial=case["initial"])
        rounds = list(enumerate(g["rounds"]))
        models = worst([(run.returned[r][c], {k: th["locals"][c][k] for k in t.PARAMS})
                        for r, th in rounds for c in run.cohorts[r]]
                       + [(run.globals[r], {k: th["global"][k] for k in t.PARAMS}) for r, th in rounds])
        stats = worst([(run.globals[r], {k: th["global"][k] for k in t.STATS}) for r, th in rounds])
        steps = sum(max(len(case["digests"][r][c]) for c in run.cohorts[r]) for r in range(case["rounds"]))
        scale = max(float(v.abs().max()) for rnd in g["rounds"] for v in rnd["global"].values())
        yield f"FjORD {form}", {"models": models, "served statistics": stats}, float64_bound(steps, t.BATCH_TERMS, scale)


def fiarse():
    import test_reference_fiarse as t
    from reference_case import float64_bound

    for variant in ("authors_rule", "defaults"):
        g = load("fiarse", f"{variant}.pt")
        run = t.run_ours(g["case"], tempfile.mkdtemp())
        rounds = list(enumerate(g["rounds"]))
        models = worst([(run.returned[r][c], th["locals"][c]) for r, th in rounds for c in run.cohorts[r]]
                       + [(run.globals[r], th["global"]) for r, th in rounds])
        case = g["case"]
        steps = sum(max(len(case["digests"][r][c]) for c in run.cohorts[r]) for r in range(case["rounds"]))
        scale = max(float(v.abs().max()) for rnd in g["rounds"] for v in rnd["global"].values())
        yield f"FIARSE {variant}", {"models": models}, float64_bound(steps, t.BATCH_TERMS, scale)


def fedprox_scaffold():
    import test_reference_fedprox_scaffold as t
    from fl_lightning.algorithms.fedprox import FedProx
    from fl_lightning.algorithms.scaffold import Scaffold

    g = load("fedprox", "pfllib.pt")
    run = t.run_ours(FedProx(), g["case"], tempfile.mkdtemp())
    rounds = list(enumerate(g["rounds"]))
    models = worst([(run.returned[r][c], unpack(th["locals"][c])) for r, th in rounds for c in run.cohorts[r]]
                   + [(run.globals[r], unpack(th["global"])) for r, th in rounds])
    yield "FedProx", {"models": models}, t.tolerance(g["case"], g)
    for variant in ("uniform", "samples"):
        g = load("scaffold", f"{variant}.pt")
        cs = []
        run = t.run_ours(Scaffold(**g["case"]["options"]), g["case"], tempfile.mkdtemp(),
                         after_round=lambda r, fed: cs.append({k: v.clone() for k, v in fed.algorithm.c.items()}))
        rounds = list(enumerate(g["rounds"]))
        yield (f"SCAFFOLD {variant}", {"global": worst([(run.globals[r], unpack(th["global"])) for r, th in rounds]),
                                        "c": worst([(cs[r], unpack(th["c"])) for r, th in rounds])},
               t.tolerance(g["case"], g))


def multisfl():
    import test_reference_multisfl as t
    from reference_case import float64_bound, make_spec, run_rounds, TRAIN
    from fl_lightning.algorithms.split.multisfl import MultiSFL

    for variant in ("replay", "no_replay"):
        g = load("multisfl", f"{variant}.pt")
        case = g["case"]
        branches = []
        spec = make_spec(tempfile.mkdtemp(), MultiSFL(bn="aggregated", **case["options"]), rounds=case["rounds"],
                         train=TRAIN.__class__(**{**TRAIN.__dict__, "lr": case["lr"], "momentum": case["momentum"]}))
        run = run_rounds(spec, case["rounds"], dtype=torch.float64, levels=case["levels"], initial=case["initial"],
                         after_round=lambda r, fed: branches.append([{k: v.clone() for k, v in b.items()}
                                                                        for b in fed.algorithm.branches]))
        rounds = list(enumerate(g["rounds"]))
        master = worst([(run.globals[r], th["master"]) for r, th in rounds])
        branch = worst([(branches[r][b], th["branches"][b]) for r, th in rounds for b in range(len(th["branches"]))])
        steps = sum(max(len(case["digests"][r][c]) for c in run.cohorts[r]) for r in range(case["rounds"]))
        scale = max(float(v.abs().max()) for rnd in g["rounds"] for v in rnd["master"].values()
                    if v.is_floating_point())
        yield f"MultiSFL {variant}", {"master": master, "branches": branch}, float64_bound(steps, t.BATCH_TERMS, scale)


def main():
    torch.set_num_threads(1)
    for cases in (heterofl, fjord, fiarse, splitfed, multisfl, fedprox_scaffold):
        for name, distances, tol in cases():
            shown = ", ".join(f"{k} {v:.1e}" for k, v in distances.items())
            print(f"{name}: {shown}; tolerance {tol:.1e}")


if __name__ == "__main__":
    main()
