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


def test_two_cut_split_method_reduces_to_splitfed_v2_and_cuts_by_parity(spec_factory):
    """The page's split method: with no smoothing and both cuts at block0 it is SplitFed V2 at
    block0 bit for bit; with two cuts each client's front is the one its parity names (its
    parameter count from the model split by hand), and the server's loss is label-smoothed
    cross-entropy (float64 by hand: (1 - e) CE + e * mean over classes of -log p)."""
    import torch.nn.functional as F

    from lightning.fabric import Fabric

    from fl_lightning.algorithms import SplitFed
    from fl_lightning.federation.loop import Federation
    from fl_lightning.federation.run_dir import RunDir

    ns = doc_namespace()
    reduced = spec_factory(name="reduced", algorithm=ns["TwoCutSplitFed"](shallow="block0", deep="block0", smoothing=0.0),
                           federation=FederationConfig(rounds=2, clients_per_round=4))
    v2 = spec_factory(name="v2", algorithm=SplitFed(cut="block0", version="v2"),
                      federation=FederationConfig(rounds=2, clients_per_round=4))
    run_fit(reduced)
    run_fit(v2)
    a, b = last_model(reduced), last_model(v2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    spec = spec_factory(name="two", algorithm=ns["TwoCutSplitFed"](smoothing=0.2),
                        federation=FederationConfig(rounds=4, clients_per_round=6))
    summary = run_fit(spec)
    model = build_global_model(spec, build_federated_data(spec.data, spec.partition, 0))
    front_params = {cut: sum(p.numel() for p in model.split(cut)[0].parameters()) for cut in ("block0", "block1")}
    assert front_params["block0"] < front_params["block1"]
    rows = [json.loads(l) for l in (Path(spec.out_dir) / "two" / "clients.jsonl").read_text().splitlines()]
    assert len(rows) == 24
    for row in rows:
        assert row["client_params"] == front_params["block1" if row["client"] % 2 else "block0"]
    assert summary["final"]["test_acc"] > 0.5  # it learns (chance: 0.1)

    one = spec_factory(name="loss", algorithm=ns["TwoCutSplitFed"](smoothing=0.2))
    fed = Federation(Fabric(accelerator="cpu", devices=1), one, RunDir(one.out_dir, one.name))
    algorithm = fed.algorithm
    plan = algorithm.plan(0)
    client = algorithm.new_client(plan.tasks[0], plan)
    _, back = algorithm.engine.server_worker.split(plan.tasks[0].cut)
    x, y = next(fed.ctx.shards[plan.tasks[0].client].steps(1, torch.Generator().manual_seed(0)))
    front, _ = algorithm.engine.client_worker.split(plan.tasks[0].cut)
    sent = client.forward(front)(x).detach()
    with torch.no_grad():
        log_p = F.log_softmax(back(sent).double(), dim=1)
        expected = (0.8 * -log_p.gather(1, y[:, None]).squeeze(1) + 0.2 * -log_p.mean(1)).mean()
        loss = client.server_loss(back, sent, y)
    assert abs(float(loss) - float(expected)) <= 1e-5 * max(1.0, float(expected))


def test_fedcm_sends_its_direction_and_at_alpha_one_is_fedavg(spec_factory):
    """The page's FedCM: at alpha 1 it is FedAvg (momentum 0) to the bit; at alpha 0.5 its
    clients receive Delta beside the model (as many bytes as the parameters, float32), and after
    round 0 Delta is (x_0 - x_1) / (lr K) by hand, K the clients' mean local steps (a Delta
    without the 1 / K, or of x_1 - x_0, would be off by a factor of K or of sign)."""
    from fl_lightning.config import LocalTrainConfig

    ns = doc_namespace()
    train = LocalTrainConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.0)
    fed = FederationConfig(rounds=2, clients_per_round=3)
    cm1 = spec_factory(name="cm1", algorithm=ns["FedCM"](alpha=1.0), train=train, federation=fed)
    avg = spec_factory(name="avg", algorithm=FedAvg(), train=train, federation=fed)
    run_fit(cm1)
    run_fit(avg)
    a, b = last_model(cm1), last_model(avg)
    assert all(torch.equal(a[k], b[k]) for k in b)

    one = spec_factory(name="cm", algorithm=ns["FedCM"](alpha=0.5), train=train,
                       federation=FederationConfig(rounds=1, clients_per_round=3))
    initial = build_global_model(one, build_federated_data(one.data, one.partition, 0)).state_dict()
    run_fit(one)
    rows = [json.loads(l) for l in (Path(one.out_dir) / "cm" / "clients.jsonl").read_text().splitlines()]
    params = {k for k, _ in build_global_model(one, build_federated_data(one.data, one.partition, 0)).named_parameters()}
    param_bytes = sum(initial[k].numel() * 4 for k in params)
    assert all(r["delta_bytes_down"] == param_bytes for r in rows)
    steps = sum(r["steps"] for r in rows) / len(rows)
    saved = load_checkpoint(Path(one.out_dir) / "cm" / "checkpoints" / "last.ckpt")
    for key in params:
        expected = (initial[key].double() - saved["model"][key].double()) / (0.05 * steps)
        assert torch.allclose(saved["algorithm"][f"delta/{key}"].double(), expected, rtol=1e-5, atol=1e-6), key
