"""No client waits on the device inside its training steps (the CPU proxy of
``torch.cuda.set_sync_debug_mode("error")``, ``runtime/host_syncs.py``)."""

import pytest
import torch

import fl_lightning.algorithms.client as client_module
from fl_lightning.algorithms import Feast, FedAvg, HeteroFL
from fl_lightning.config import (BudgetConfig, DataConfig, EvalConfig, FederationConfig, LocalTrainConfig,
                                 PartitionConfig)
from fl_lightning.data import Synthetic
from fl_lightning.federation.loop import run_fit
from fl_lightning.runtime.host_syncs import HostSyncs, step_windows

FEAST_MODEL = {"class_path": "fl_lightning.elastic.models.OFAResNet",
               "init_args": {"width_scale": 0.0625, "max_extra_blocks": 1, "divisor": 2}}
FEAST_DATA = DataConfig(dataset=Synthetic(num_classes=4, image_size=16, num_train=240, num_test=40),
                        val_size=24, calib_size=16)


def test_reads_of_device_values_are_counted_and_host_draws_are_not():
    t = torch.arange(6.0)
    g = torch.Generator().manual_seed(0)
    item, randint = torch.Tensor.item, torch.randint
    with HostSyncs() as syncs:
        t.sum().item()
        float(t[0])
        int(t[1])
        bool(t[2] > 1)
        t.tolist()
        t.cpu()
        t.numpy()
        drawn = torch.randint(5, (3,), generator=g)  # a host generator's draw: read on the host
        drawn.tolist()
        int(torch.randint(5, (1,), generator=g))
        syncs.active = False
        t.sum().item()  # outside a counted window
    assert syncs.total == 7
    assert all(where.split(" at ")[1].startswith("test_host_syncs.py:") for where in syncs.calls)
    assert torch.Tensor.item is item and torch.randint is randint  # restored after the block


def test_step_windows_count_inside_steps_only():
    batches = iter([torch.ones(2), torch.ones(2)])
    with HostSyncs() as syncs:
        for batch in step_windows(batches, syncs):
            batch.sum().item()   # inside a step
        torch.ones(1).item()    # after the last step
    assert syncs.total == 2


def fit_counting_syncs(monkeypatch, spec):
    """Run ``spec``, counting host syncs inside every client's training steps and in each
    client's whole round (routing, training, commit); (in steps, per client round, steps)."""
    train_locally = client_module.train_locally
    counts = {"steps": 0, "clients": 0}
    in_steps = HostSyncs()

    class Windowed:
        """The client's data, each of its batch iterators (``epoch``, ``steps``) in step windows."""

        def __init__(self, data):
            self.data = data

        def __len__(self):
            return len(self.data)

        def __getattr__(self, name):
            attr = getattr(self.data, name)
            if not callable(attr):
                return attr

            def windowed(*args, **kwargs):
                out = attr(*args, **kwargs)
                if not hasattr(out, "__next__"):
                    return out
                return (counted(batch) for batch in step_windows(out, in_steps))
            return windowed

    def counted(batch):
        counts["steps"] += 1
        return batch

    def counted_training(fabric, module, data, cfg, generator):
        return train_locally(fabric, module, Windowed(data), cfg, generator)

    monkeypatch.setattr(client_module, "train_locally", counted_training)
    whole = HostSyncs()
    whole.active = False
    algorithm = spec.algorithm
    fit_cohort, commit = type(algorithm).fit_cohort, type(algorithm).commit

    def counted_cohort(self, plan, owned):
        clients = fit_cohort(self, plan, owned)
        while True:
            whole.active = True
            try:
                task, result = next(clients)
            except StopIteration:
                return
            finally:
                whole.active = False
            counts["clients"] += 1
            yield task, result

    def counted_commit(self, *args):
        whole.active = True
        try:
            commit(self, *args)
        finally:
            whole.active = False

    monkeypatch.setattr(type(algorithm), "fit_cohort", counted_cohort)
    monkeypatch.setattr(type(algorithm), "commit", counted_commit)
    in_steps.active = False
    with in_steps, whole:
        run_fit(spec)
    return in_steps, whole, counts


def feast(spec_factory, tmp_path):
    from test_feast import small_cache

    return spec_factory(
        name="feast", algorithm=Feast(cache=small_cache(tmp_path)), data=FEAST_DATA, model=FEAST_MODEL,
        partition=PartitionConfig(method="iid", num_clients=6, budgets=BudgetConfig(b_min=5e4, b_max=2e5, b_cap=2e5)),
        train=LocalTrainConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-4, grad_clip=10.0),
        federation=FederationConfig(rounds=1, clients_per_round=3), eval=EvalConfig(every=10))


@pytest.mark.parametrize("method", ["feast", "fedavg", "heterofl"])
def test_no_host_sync_inside_client_steps(spec_factory, tmp_path, monkeypatch, method):
    """FEAST (with Mixup/CutMix and its random intermediates drawn on the host), FedAvg and
    HeteroFL, clipped, with momentum: not one read of a device value inside a step. Around the
    steps a FEAST client's round reads one value, the mean loss it reports (its commit adds
    none: the trained mass comes from the regions' shapes, where it read one value per routed
    tensor before)."""
    one_round = dict(train=LocalTrainConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9, grad_clip=10.0),
                     federation=FederationConfig(rounds=1, clients_per_round=3), eval=EvalConfig(every=10))
    spec = {"feast": lambda: feast(spec_factory, tmp_path),
            "fedavg": lambda: spec_factory(name="fedavg", algorithm=FedAvg(), **one_round),
            "heterofl": lambda: spec_factory(name="heterofl", algorithm=HeteroFL(caps=[1.0, 0.5, 0.25] * 2),
                                             **one_round)}[method]()
    in_steps, whole, counts = fit_counting_syncs(monkeypatch, spec)
    assert counts["steps"] >= 6 and counts["clients"] == 3, "the test needs several steps of several clients"
    assert in_steps.total == 0, dict(in_steps.calls)
    if method == "feast":
        assert whole.total <= counts["clients"], dict(whole.calls)
