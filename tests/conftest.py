import os

import pytest
import torch
from fl_lightning.data import Digits

# Tests run on CPU with few threads so the suite behaves the same on 2-core CI machines.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny tensors: a second intra-op thread mostly adds waiting, and subprocess tests
    (2 ranks) would oversubscribe a 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def spec_factory(tmp_path):
    """Build a small RunSpec on digits; keyword overrides replace whole sections or fields."""
    from fl_lightning.algorithms import FedAvg
    from fl_lightning.config import (DataConfig, EvalConfig, FabricConfig, FederationConfig, LocalTrainConfig,
                                     PartitionConfig)
    from fl_lightning.federation.builder import RunSpec

    def make(name="t", algorithm=None, **overrides):
        sections = dict(
            data=DataConfig(dataset=Digits(), val_size=100),
            partition=PartitionConfig(method="dirichlet", num_clients=6, alpha=0.5),
            model={"class_path": "fl_lightning.elastic.models.CNN"},
            train=LocalTrainConfig(epochs=1, batch_size=16, lr=0.05),
            federation=FederationConfig(rounds=3, clients_per_round=3),
            eval=EvalConfig(every=1),
            # one rank, one thread (auto would give sequential-client methods every core)
            fabric=FabricConfig(accelerator="cpu", devices=1, threads_per_rank=1),
        )
        sections.update(overrides)
        return RunSpec(name=name, out_dir=str(tmp_path / "runs"), seed=0,
                       algorithm=algorithm or FedAvg(), **sections)

    return make
