"""What crosses the wire is what the client gets: a client's fit reads only its downlink (and, in
split learning, the server half loaded for it), and the traffic is counted from the link.

The sealed-fit check: every method kind runs two rounds twice from the same seed; in the second
run, while each client of round 1 fits, every floating-point tensor the method keeps (the global
model and every kept part: stores, control variates, prompts, harmonizer, probes, estimators) is
NaN. A client that read any of them through anything but its downlink would return NaN or a
different model, so the round's global model and client rows would differ; they must be
identical, bit for bit. (MergeSFL is left out: its server trains the whole cohort in lock-step
in its own ``fit_cohort``, no client object fits alone.)
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from fl_lightning.algorithms import FedAvg, Scaffold
from fl_lightning.config import FederationConfig, LocalTrainConfig
from fl_lightning.federation.loop import run_fit

ROOT = Path(__file__).resolve().parents[1]
PLAIN = LocalTrainConfig(steps=2, batch_size=16, lr=0.05, momentum=0.0)


def load_tool():
    spec = importlib.util.spec_from_file_location("architecture_table", ROOT / "tools" / "architecture_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL = load_tool()
ROWS = ["FedAvg", "FedProx", "Scaffold", "FedDyn", "FedOpt", "FedMut", "HeteroFL", "FjORD", "FedRolex", "HASFL", "Uniform",
        "RandomBudget", "FedBABU", "FedGH", "FedAS", "FIARSE", "Feast", "SuperFedNAS", "DeepFedNAS", "ScaleFL",
        "SplitFed (V1)", "SplitFed (V2)", "MUSplitFed", "MultiSFL", "MergeSFL", "FedSGA",
        "FedSGA (V1, additive read-out)"]


def doc_traffic() -> dict:
    """``{row: (kinds down, kinds up)}`` of docs/architecture.md's traffic table."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    body = doc[doc.index(TOOL.TRAFFIC_BEGIN) + len(TOOL.TRAFFIC_BEGIN):doc.index(TOOL.TRAFFIC_END)]
    out = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("method", "---"):
            out[cells[0]] = tuple(tuple(k for k in c.split(", ") if k not in ("", "-")) for c in cells[1:])
    return out


def nan_where_floating(state):
    return {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in state.items()}


def seal_client_fits(algorithm, sealed_rounds):
    """While a client of ``sealed_rounds`` fits, every floating-point tensor the method keeps
    (the global model's and its kept parts') is NaN."""
    make = algorithm.new_client

    def new_client(task, plan):
        client = make(task, plan)
        if plan.round_idx not in sealed_rounds:
            return client
        fit = client.fit

        def sealed(downlink):
            model = {k: v.detach().clone() for k, v in algorithm.global_state.items()}
            kept = {k: v.detach().clone() for k, v in algorithm.state_dict().items()}
            with torch.no_grad():
                for key, value in nan_where_floating(model).items():
                    algorithm.global_state[key].copy_(value)
            algorithm.load_state_dict(nan_where_floating(kept))
            try:
                return fit(downlink)
            finally:
                with torch.no_grad():
                    for key, value in model.items():
                        algorithm.global_state[key].copy_(value)
                # what the fit itself moved stays (a split round's server half carries its
                # optimizer's momentum to the next client); what it left poisoned is restored
                now = algorithm.state_dict()
                algorithm.load_state_dict({k: v if not (now[k].is_floating_point() and now[k].isnan().all()) else
                                           kept[k] for k, v in now.items()} | {k: kept[k] for k in kept if k not in now})

        client.fit = sealed
        return client

    algorithm.new_client = new_client


def two_rounds(tmp_path, name, row, sealed):
    """Rounds 0 and 1 of the tool's case ``row`` (round 1 sealed if asked): the method, the
    clients' rows of each round and the uplinks of round 1."""
    from lightning.fabric import Fabric

    from fl_lightning.federation.loop import Federation
    from fl_lightning.federation.run_dir import RunDir

    make, overrides = TOOL.traffic_cases(tmp_path)[row]
    spec = TOOL.small_spec(tmp_path / "runs", name, make(), **overrides)
    fed = Federation(Fabric(accelerator="cpu", devices=1), spec, RunDir(spec.out_dir, spec.name))
    fed._open_outputs()
    if sealed:
        seal_client_fits(fed.algorithm, {1})
    rows = [fed.run_round(0)[1]]
    uplinks = TOOL.recording_uplinks(fed.algorithm)
    rows.append(fed.run_round(1)[1])
    return fed.algorithm, rows, uplinks


@pytest.mark.parametrize("row", ROWS)
def test_a_client_reads_only_its_downlink_and_the_table_says_what_crosses(tmp_path, row):
    plain, plain_rows, uplinks = two_rounds(tmp_path, "plain", row, sealed=False)
    assert TOOL.channel_kinds(uplinks) == doc_traffic()[row], \
        "docs/architecture.md's traffic table is out of date: run python tools/architecture_table.py --write"
    if row == "MergeSFL":  # the server trains the whole cohort in lock-step: no client fits alone
        return
    sealed, sealed_rows, _ = two_rounds(tmp_path, "sealed", row, sealed=True)
    assert len(sealed_rows[1]) == 3  # every client of the sealed round was committed

    def figures(rows):
        return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]

    assert figures(sealed_rows[1]) == figures(plain_rows[1])
    for key, value in plain.global_state.items():
        assert torch.equal(sealed.global_state[key], value), key
    for key, value in plain.state_dict().items():
        assert torch.equal(sealed.state_dict()[key], value), key


def test_every_method_kind_has_a_traffic_row():
    from fl_lightning import algorithms

    kinds = {name for name in algorithms.__all__ if isinstance(getattr(algorithms, name), type)
             and issubclass(getattr(algorithms, name), algorithms.Algorithm)} - {"Algorithm", "SubmodelAlgorithm"}
    assert {row.split(" ")[0] for row in ROWS} == kinds
    assert list(doc_traffic()) == ROWS


def test_scaffold_counts_its_control_variates_on_the_wire(spec_factory):
    """SCAFFOLD's client receives c beside the model and sends delta c_i beside it: each as
    large as the model's parameters (float32), where FedAvg's link carries the model alone."""
    fed = FederationConfig(rounds=1, clients_per_round=3)
    scaffold = spec_factory(name="scaffold", algorithm=Scaffold(), train=PLAIN, federation=fed)
    fedavg = spec_factory(name="fedavg", algorithm=FedAvg(), train=PLAIN, federation=fed)
    run_fit(scaffold)
    run_fit(fedavg)

    def rows(spec):
        return [json.loads(line) for line in (Path(spec.out_dir) / spec.name / "clients.jsonl").read_text().splitlines()]

    from fl_lightning.elastic.models import build_model

    model = build_model({"class_path": "fl_lightning.elastic.models.CNN"}, 10, (1, 8, 8))
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert param_bytes < state_bytes  # batch-norm statistics cross with the model only
    for s, f in zip(rows(scaffold), rows(fedavg)):
        assert f["bytes_down"] == f["bytes_up"] == state_bytes
        assert s["model_bytes_down"] == s["model_bytes_up"] == state_bytes
        assert s["c_bytes_down"] == s["delta_c_bytes_up"] == param_bytes
        assert s["bytes_down"] == s["bytes_up"] == state_bytes + param_bytes
