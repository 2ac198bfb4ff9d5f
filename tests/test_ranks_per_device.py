"""Several ranks on one device (``fabric.ranks_per_device``): where each rank runs, how many a
node starts, and that two ranks sharing a device give the one-rank model bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fl_lightning.config import FabricConfig
from fl_lightning.errors import ConfigError
from fl_lightning.federation.builder import shared_device_strategy
from fl_lightning.federation.machine import GB, Footprint, Launcher, Machine, place
from fl_lightning.runtime.checkpoint import load_checkpoint

SMALL = Footprint(parameters=100_000, data_bytes=10 * 2**20)
ROOT = Path(__file__).resolve().parents[1]


def test_rank_r_runs_on_device_r_over_ranks_per_device_and_reduces_through_gloo():
    strategy = shared_device_strategy(FabricConfig(accelerator="cuda", devices=2, ranks_per_device=3), 2)
    assert strategy.parallel_devices == [torch.device("cuda", d) for d in (0, 0, 0, 1, 1, 1)]
    assert strategy.process_group_backend == "gloo" and strategy._start_method == "popen"
    forked = shared_device_strategy(FabricConfig(accelerator="cpu", devices=1, ranks_per_device=2,
                                                 strategy="ddp_fork"), 1)
    assert forked.parallel_devices == [torch.device("cpu")] * 2 and forked._start_method == "fork"
    with pytest.raises(ConfigError, match="^fabric.ranks_per_device: 2 ranks per device need strategy auto or ddp, "
                                          "not deepspeed"):
        shared_device_strategy(FabricConfig(devices=1, ranks_per_device=2, strategy="deepspeed"), 1)


def test_placement_counts_ranks_per_device():
    gpus = Machine(cores=16, memory=256 * GB, gpus=2)
    auto = place(FabricConfig(accelerator="cuda", ranks_per_device=4), 10, False, SMALL, gpus)
    assert (auto.devices, auto.ranks) == (2, 8)
    assert auto.line.startswith("fit: 8 rank(s) on gpu (auto: 2 GPU(s), cohort 10; 4 ranks on each of 2 device(s)")
    few = place(FabricConfig(accelerator="cuda", ranks_per_device=4), 3, False, SMALL, gpus)
    assert (few.devices, few.ranks) == (1, 4)  # a device of 4 ranks holds the cohort of 3
    cpu = place(FabricConfig(accelerator="cpu", devices=1, ranks_per_device=2), 10, False, SMALL,
                Machine(cores=8, memory=256 * GB, gpus=0))
    assert (cpu.ranks, cpu.strategy) == (2, "ddp_fork") and cpu.line.startswith("fit: 2 rank(s) x 1 thread(s) on cpu")
    launched = Launcher("torchrun", 6, 1, "LOCAL_WORLD_SIZE")
    under = place(FabricConfig(accelerator="cuda", ranks_per_device=3), 10, False, SMALL, gpus, launcher=launched)
    assert (under.devices, under.ranks) == (2, 6)
    with pytest.raises(ConfigError, match="^fabric.ranks_per_device: 4, but torchrun started 6 rank"):
        place(FabricConfig(accelerator="cuda", ranks_per_device=4), 10, False, SMALL, gpus, launcher=launched)


def test_two_ranks_sharing_one_device_give_the_one_rank_model(tmp_path, monkeypatch, capsys, cli_on_ranks):
    """HeteroFL on digits, 3 rounds of 5 clients: nested width slices, so each rank's reduction
    sends only the blocks its round touched; the model and the method's state after 3 rounds
    equal the 1-rank run's bit for bit."""
    from fl_lightning.federation import loop, machine

    for module in (loop, machine):  # place and print as ``python -m fl_lightning`` does
        monkeypatch.setattr(module, "launched_by_command_line", lambda: True)
    config = str(ROOT / "configs" / "submodel" / "offline" / "digits" / "heterofl.yaml")
    common = ["fit", "--config", config, "--federation.rounds", "3", "--eval.every", "3",
              "--federation.clients_per_round", "5", "--train.epochs", "1", "--fabric.devices", "1",
              "--out_dir", str(tmp_path)]
    assert cli_on_ranks(common + ["--name", "one"]) == 0
    capsys.readouterr()
    assert cli_on_ranks(common + ["--name", "two", "--fabric.ranks_per_device", "2"]) == 0
    line = "fit: 2 rank(s) x 1 thread(s) on cpu (as configured; 2 ranks on each of 1 device(s)"
    assert line in capsys.readouterr().err
    a = load_checkpoint(tmp_path / "one" / "checkpoints" / "last.ckpt")
    b = load_checkpoint(tmp_path / "two" / "checkpoints" / "last.ckpt")
    for part in ("model", "algorithm"):
        assert a[part].keys() == b[part].keys()
        for key in a[part]:
            if isinstance(a[part][key], torch.Tensor):
                assert torch.equal(a[part][key], b[part][key]), (part, key)
