import os
from contextlib import contextmanager

import pytest
import torch
from fl_lightning.data import Digits
from process_tree import descendants

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


def small_spec(out_dir, name="t", algorithm=None, **overrides):
    """A small RunSpec on digits in ``out_dir``; keyword overrides replace whole sections or fields."""
    from fl_lightning.algorithms import FedAvg
    from fl_lightning.config import (DataConfig, EvalConfig, FabricConfig, FederationConfig, LocalTrainConfig,
                                     PartitionConfig)
    from fl_lightning.federation.builder import RunSpec

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
    return RunSpec(name=name, out_dir=str(out_dir), seed=0, algorithm=algorithm or FedAvg(), **sections)


@pytest.fixture
def spec_factory(tmp_path):
    """Build a small RunSpec on digits; keyword overrides replace whole sections or fields."""

    def make(name="t", algorithm=None, **overrides):
        return small_spec(tmp_path / "runs", name, algorithm, **overrides)

    return make


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """``shared_run(key, name, make_algorithm, **overrides)``: a small run (``small_spec``) fitted
    once per session under ``key`` and returned as (spec, summary), so that tests comparing
    against the same reference run (the uninterrupted run of a resume test, one rank of a
    two-rank test) share it. Its folder is read-only to the tests: copy it before changing it."""
    from fl_lightning.federation.loop import run_fit

    root = tmp_path_factory.mktemp("shared_runs")
    done = {}

    def get(key, name="t", make_algorithm=None, **overrides):
        if key not in done:
            spec = small_spec(root / key, name, make_algorithm() if make_algorithm else None, **overrides)
            done[key] = (spec, run_fit(spec))
        return done[key]

    return get


@contextmanager
def ranks_killed_after(seconds: int, what: str = "the run"):
    """Fail with TimeoutError, every process forked below this one killed, if the block has not
    ended within ``seconds`` (ranks whose collectives fall out of step wait for each other until
    gloo's 30-minute timeout; a launched script had subprocess's timeout)."""
    import signal

    def expire(signum, frame):
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise TimeoutError(f"{what} did not end within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def fit_on_ranks():
    """``fit_on_ranks(spec, seconds=300)``: ``run_fit`` for a spec whose ranks fork from this
    process (``ddp_fork``: no interpreter start, no imports) under ``ranks_killed_after``."""
    from fl_lightning.federation.loop import run_fit

    def fit(spec, seconds=300):
        with ranks_killed_after(seconds, f"the run on {spec.fabric.devices} ranks"):
            return run_fit(spec)

    return fit


@pytest.fixture(scope="session")
def cli_on_ranks():
    """``cli_on_ranks(argv, seconds=300)``: the command line's ``main(argv)`` in this process (its
    ranks, if any, fork from it) under ``ranks_killed_after``; returns the exit code."""
    from fl_lightning.cli import main

    def run(argv, seconds=300):
        with ranks_killed_after(seconds, f"fl_lightning {' '.join(argv)}"):
            return main(argv)

    return run
