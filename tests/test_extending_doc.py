"""docs/extending.md's examples run as written and do what the page says."""

import json
import re
from pathlib import Path

import torch

from fl_lightning.algorithms import FedAvg, FedOpt
from fl_lightning.config import FederationConfig
from fl_lightning.data.federated import build_federated_data
from fl_lightning.federation.builder import build_global_model
from fl_lightning.runtime.checkpoint import load_checkpoint
from fl_lightning.federation.loop import run_fit
from fl_lightning.runtime.server_optimizer import ServerOptimizer

DOC = Path(__file__).parents[1] / "docs" / "extending.md"


def doc_namespace() -> dict:
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S):
        exec(compile(block, str(DOC), "exec"), namespace)
    return namespace


def last_model(spec):
    return load_checkpoint(Path(spec.out_dir) / spec.name / "checkpoints" / "last.ckpt")["model"]


def test_fedadam_is_the_shipped_fedopt_and_keeps_its_moments(spec_factory):
    ns = doc_namespace()
    avg, doc, shipped = (spec_factory(name=n, algorithm=a) for n, a in
                         (("avg", FedAvg()), ("doc", ns["FedAdam"](lr=0.01, tau=1e-3)),
                          ("shipped", FedOpt(ServerOptimizer("adam", lr=0.01, betas=(0.9, 0.99), eps=1e-3)))))
    for spec in (avg, doc, shipped):
        run_fit(spec)
    a, b, c = last_model(avg), last_model(doc), last_model(shipped)
    assert all(torch.equal(c[k], v) for k, v in b.items())
    assert any(not torch.allclose(b[k], v) for k, v in a.items() if v.is_floating_point())
    assert all(torch.isfinite(v).all() for v in b.values() if v.is_floating_point())
    params = {k for k, _ in build_global_model(avg, build_federated_data(avg.data, avg.partition, 0)).named_parameters()}
    saved = load_checkpoint(Path(doc.out_dir) / "doc" / "checkpoints" / "last.ckpt")["algorithm"]
    assert set(saved) == {f"server_opt/{k}/{m}" for k in params for m in ("step", "exp_avg", "exp_avg_sq")}


def test_fixed_widths_clients_send_their_slice(spec_factory):
    ns = doc_namespace()
    spec = spec_factory(name="widths", algorithm=ns["FixedWidths"](widths=[0.25, 0.5, 1.0]),
                        federation=FederationConfig(rounds=2, clients_per_round=6))
    summary = run_fit(spec)
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    full = sum(t.numel() * t.element_size() for t in build_global_model(spec, fed).state_dict().values())
    rows = [json.loads(l) for l in (Path(spec.out_dir) / "widths" / "clients.jsonl").read_text().splitlines()]
    by_width = {0.25: [], 0.5: [], 1.0: []}
    for row in rows:
        by_width[[0.25, 0.5, 1.0][row["client"] % 3]].append(row["bytes_down"])
    assert set(by_width[1.0]) == {full}
    assert max(by_width[0.25]) < full / 10 and max(by_width[0.5]) < full / 3
    assert summary["final"]["test_acc"] > 0.3  # it learns (chance: 0.1)


def test_the_blobs_dataset_trains_and_sizes_itself(spec_factory):
    """The page's dataset: its facts size it without loading, its bundle has the stated shape,
    and four FedAvg rounds on it learn the blobs (centres ~N(0, 4 I) in 64 dimensions, unit
    noise: the nearest centre is right for nearly every example), far above the 25% of chance."""
    from fl_lightning.config import DataConfig, FederationConfig

    blobs = doc_namespace()["Blobs"](per_class=100)
    assert blobs.footprint() == (4, (1, 8, 8), 600 * 64 * 4)
    bundle = blobs.load("data", False, True)
    assert len(bundle.train) == 320 and len(bundle.test) == 80 and bundle.train[0][0].shape == (1, 8, 8)
    spec = spec_factory(name="blobs", data=DataConfig(dataset=blobs, val_size=40),
                        federation=FederationConfig(rounds=4, clients_per_round=3))
    summary = run_fit(spec)
    assert summary["final"]["test_acc"] > 0.6
