"""``fabric.devices: auto`` and ``threads_per_rank: auto``: how a run is placed on a machine.

The machine is given to ``place`` as numbers (cores, available memory, GPUs), so these tests
say what every machine would get, whatever runs them. The equality of a default-devices run
with a 1-rank run is ``tests/test_federation.py::test_two_processes_match_one_process``.
"""

from __future__ import annotations

import pytest
import torch

from fl_lightning.cli import main
from fl_lightning.config import DataConfig, FabricConfig
from fl_lightning.data import Digits, Synthetic
from fl_lightning.errors import ConfigError
from fl_lightning.federation.machine import (GB, Footprint, Machine, dataset_facts, parameter_count, physical_cores,
                                             place, resolve_threads)
from fl_lightning.elastic.models import CNN

SMALL = Footprint(parameters=100_000, data_bytes=10 * 2**20)
PLENTY = 256 * GB


def machine(cores=8, memory=PLENTY, gpus=0) -> Machine:
    return Machine(cores=cores, memory=memory, gpus=gpus)


@pytest.mark.parametrize("cores,cohort,want", [(8, 10, 8), (8, 3, 3), (2, 10, 2), (1, 10, 1), (64, 1, 1)])
def test_default_is_one_rank_per_core_up_to_the_cohort(cores, cohort, want):
    placed = place(FabricConfig(accelerator="cpu"), cohort, False, SMALL, machine(cores))
    assert (placed.devices, placed.threads) == (want, 1)
    assert placed.line.startswith(f"fit: {want} rank(s) x 1 thread(s) on cpu (auto: {cores} physical core(s), "
                                  f"cohort {cohort}")
    assert placed.strategy == ("ddp_fork" if want > 1 else None)


def test_default_takes_fewer_ranks_when_memory_is_short_and_says_so():
    room = 3 * SMALL.per_rank + SMALL.per_rank // 2  # three ranks fit, four do not
    placed = place(FabricConfig(accelerator="cpu"), 10, False, SMALL, machine(8, room))
    assert placed.devices == 3
    assert "lowered to 3 by memory" in placed.line and "\n" not in placed.line


def test_default_refuses_when_one_rank_does_not_fit():
    with pytest.raises(ConfigError) as err:
        place(FabricConfig(accelerator="cpu"), 10, False, SMALL, machine(8, SMALL.per_rank // 2))
    # no rank count helps: the error names what is too big (here 10 MB of data against 6.4 MB of
    # per-parameter state)
    assert err.value.key == "data.dataset" and "one rank needs" in str(err.value) and "\n" not in str(err.value)


def test_explicit_devices_win():
    placed = place(FabricConfig(accelerator="cpu", devices=5), 2, False, SMALL, machine(cores=2))
    assert placed.devices == 5 and "as configured" in placed.line
    one = place(FabricConfig(accelerator="cpu", devices=1, threads_per_rank=3), 10, False, SMALL, machine())
    assert (one.devices, one.threads, one.strategy) == (1, 3, None)
    # an explicit strategy is kept
    ddp = place(FabricConfig(accelerator="cpu", strategy="ddp"), 10, False, SMALL, machine(cores=4))
    assert (ddp.devices, ddp.strategy) == (4, None)
    assert ddp.apply(FabricConfig(accelerator="cpu", strategy="ddp")).strategy == "ddp"


def test_explicit_devices_that_do_not_fit_are_refused_in_one_line():
    room = 2 * SMALL.per_rank + 1
    with pytest.raises(ConfigError) as err:
        place(FabricConfig(accelerator="cpu", devices=4), 10, False, SMALL, machine(8, room))
    message = str(err.value)
    assert err.value.key == "fabric.devices" and "\n" not in message
    assert message.startswith("fabric.devices: 4 rank(s) need about") and "--fabric.devices 2 or fewer" in message


def test_sequential_methods_take_one_rank_and_every_core_whatever_devices_says():
    auto = place(FabricConfig(accelerator="cpu"), 10, True, SMALL, machine(cores=6))
    assert (auto.devices, auto.threads) == (1, 6) and "sequential-client" in auto.line
    explicit = place(FabricConfig(accelerator="cpu", devices=3), 10, True, SMALL, machine(cores=6))
    assert (explicit.devices, explicit.threads) == (3, 6)  # rank 0 trains with the same threads
    pinned = place(FabricConfig(accelerator="cpu", threads_per_rank=1), 10, True, SMALL, machine(cores=6))
    assert pinned.threads == 1
    assert resolve_threads(None, True, False, 6) is None  # null: Lightning's rule


def test_a_run_started_from_python_takes_one_rank():
    placed = place(FabricConfig(accelerator="cpu"), 10, False, SMALL, machine(8), launchable=False)
    assert placed.devices == 1 and "started from Python" in placed.line


@pytest.mark.parametrize("accelerator", ["auto", "cuda", "gpu"])
def test_default_on_a_gpu_node_is_every_visible_gpu(accelerator):
    placed = place(FabricConfig(accelerator=accelerator), 10, False, SMALL, machine(cores=32, gpus=4))
    assert (placed.devices, placed.threads, placed.strategy) == (4, 1, None) and " on gpu " in placed.line
    few = place(FabricConfig(accelerator=accelerator), 2, False, SMALL, machine(cores=32, gpus=4))
    assert few.devices == 2
    # CPU accelerator on a GPU node: cores
    assert place(FabricConfig(accelerator="cpu"), 10, False, SMALL, machine(cores=6, gpus=4)).devices == 6


def test_footprint_counts_the_model_without_building_it():
    model = {"class_path": "fl_lightning.elastic.models.CNN"}
    classes, shape, data_bytes = dataset_facts(DataConfig(dataset=Digits()))
    assert (classes, shape) == (10, (1, 8, 8)) and data_bytes == 1_797 * 64 * 4
    from fl_lightning.elastic.models import build_model

    real = build_model(CNN, classes, shape)
    assert parameter_count(model, classes, shape) == sum(t.numel() for t in real.state_dict().values())
    synthetic = DataConfig(dataset=Synthetic(image_size=16, channels=3, num_train=100,
                                             num_test=20, num_classes=7))
    assert dataset_facts(synthetic) == (7, (3, 16, 16), 120 * 3 * 16 * 16 * 4)


def test_physical_cores_is_at_most_the_cpus_this_process_may_use():
    import os

    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))


def test_fabric_options_parse_auto_and_refuse_bad_values_in_one_line(tmp_path, capsys):
    from fl_lightning.cli import shared_parser

    parser = shared_parser()
    cfg = parser.parse_args(["fit"])
    assert cfg.fit.fabric.devices == "auto" and cfg.fit.fabric.threads_per_rank == "auto"
    cfg = parser.parse_args(["fit", "--fabric.devices", "3", "--fabric.threads_per_rank", "2"])
    assert cfg.fit.fabric.devices == 3 and cfg.fit.fabric.threads_per_rank == 2
    for args, key in ((["--fabric.devices", "0"], "fabric.devices"), (["--fabric.devices", "most"], "fabric.devices"),
                      (["--fabric.threads_per_rank", "-1"], "fabric.threads_per_rank")):
        assert main(["fit", "--out_dir", str(tmp_path / "runs"), *args]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: {key}:"), lines
    assert not (tmp_path / "runs").exists()


def test_set_threads_follows_the_rule(spec_factory):
    """In a rank: auto is 1 thread for client-parallel methods, every core for sequential ones."""
    from lightning.fabric import Fabric

    from fl_lightning.federation.builder import set_threads

    fabric = Fabric(accelerator="cpu", devices=1)
    before = torch.get_num_threads()
    try:
        set_threads(fabric, FabricConfig(accelerator="cpu"), sequential=True)
        assert torch.get_num_threads() == physical_cores()
        set_threads(fabric, FabricConfig(accelerator="cpu"), sequential=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("cores,threads,want", [(2, 2, 1), (8, 2, 4), (8, 3, 2), (2, 1, 2), (16, 4, 4)])
def test_auto_fits_ranks_times_threads_to_the_cores_and_says_so(cores, threads, want):
    """``--fabric.threads_per_rank 2`` on 2 cores took 2 ranks x 2 threads (15 times slower than
    one rank of two): auto now divides the cores by the threads."""
    placed = place(FabricConfig(accelerator="cpu", threads_per_rank=threads), 10, False, SMALL, machine(cores))
    assert (placed.devices, placed.threads) == (want, threads)
    assert placed.devices * placed.threads <= cores and "oversubscribed" not in placed.line
    if threads > 1:
        assert f"auto: {cores} physical core(s) / {threads} thread(s) per rank, cohort 10" in placed.line


def test_an_explicit_oversubscribed_placement_is_named_in_its_line():
    placed = place(FabricConfig(accelerator="cpu", devices=2, threads_per_rank=2), 10, False, SMALL, machine(2))
    assert (placed.devices, placed.threads) == (2, 2)
    assert "as configured; oversubscribed: 4 threads on 2 physical core(s)" in placed.line
    fits = place(FabricConfig(accelerator="cpu", devices=2, threads_per_rank=1), 10, False, SMALL, machine(2))
    assert "oversubscribed" not in fits.line
    # sequential-client methods compute on rank 0 only: its threads take the cores, the rest wait
    sequential = place(FabricConfig(accelerator="cpu", devices=3), 10, True, SMALL, machine(2))
    assert "oversubscribed" not in sequential.line


TORCHRUN = {"TORCHELASTIC_RUN_ID": "job", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"}
SRUN = {"SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NAME": "fl"}


@pytest.mark.parametrize("environ,want", [
    (TORCHRUN, ("torchrun", 1, 2)),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "12"}, ("torchrun", 4, 3)),
    (SRUN, ("srun", 4, 2)),
    ({k: v for k, v in SRUN.items() if k != "SLURM_NTASKS_PER_NODE"}, ("srun", 4, 2)),
    ({**SRUN, "SLURM_JOB_NAME": "interactive"}, None),  # an allocation used by hand, as Lightning reads it
    ({"LOCAL_RANK": "0"}, None),
])
def test_the_launcher_is_read_from_its_environment(environ, want):
    from fl_lightning.federation.machine import Launcher

    found = Launcher.of(environ)
    assert (found.name, found.ranks_per_node, found.nodes) == want if want else found is None


def test_auto_under_a_launcher_takes_its_rank_count_on_every_node():
    """Every node gets the launcher's count, whatever its own cores or GPUs (probing each node
    could make them disagree); devices or num_nodes that contradict the launcher are refused."""
    from fl_lightning.federation.machine import Launcher

    launcher = Launcher.of(TORCHRUN)
    for node in (machine(cores=2), machine(cores=64), machine(cores=8, gpus=4)):
        placed = place(FabricConfig(accelerator="cpu", num_nodes=2), 10, False, SMALL, node, launcher=launcher)
        assert (placed.devices, placed.strategy) == (1, None)  # never forked: torchrun started the ranks
        assert "auto: torchrun started 1 rank(s) on each of 2 node(s) (LOCAL_WORLD_SIZE)" in placed.line
    srun = place(FabricConfig(accelerator="cpu", num_nodes=2), 10, False, SMALL, machine(2), launcher=Launcher.of(SRUN))
    assert srun.devices == 4 and "srun started 4 rank(s)" in srun.line and "oversubscribed" in srun.line
    for fabric, key in ((FabricConfig(accelerator="cpu", num_nodes=1), "fabric.num_nodes"),
                        (FabricConfig(accelerator="cpu", num_nodes=2, devices=2), "fabric.devices")):
        with pytest.raises(ConfigError) as err:
            place(fabric, 10, False, SMALL, machine(8), launcher=launcher)
        assert err.value.key == key and "torchrun started 1 rank(s) on each of 2 node(s)" in str(err.value)


# -- the memory estimate (federation/memory.py) ------------------------------------------------

def test_saved_activations_count_each_kept_tensor_once_and_no_weights():
    """Linear(5, 7) - ReLU - Linear(7, 3) at batch 4 keeps its input (4 x 5 floats) and the ReLU's
    output (4 x 7), which the second layer also keeps: 80 + 112 = 192 bytes. Counting the
    second keeping again would give 304, counting the (transposed) weights 416."""
    from fl_lightning.federation.memory import saved_activation_bytes

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    assert saved_activation_bytes(model, None, (5,), 4) == 4 * 5 * 4 + 4 * 7 * 4 == 192
    assert saved_activation_bytes(model, None, (5,), 8) == 384  # linear in the batch


def test_the_estimate_is_the_sum_of_what_a_rank_holds():
    """A dense CNN on digits: data, the model, a float64 value per weight, the worker's weights,
    gradients and momentum, and its activations, each counted here from the built model."""
    from fl_lightning.algorithms import FedAvg
    from fl_lightning.federation.memory import ACTIVATION_RESIDENT, RANK_BASE_BYTES, saved_activation_bytes

    data = DataConfig(dataset=Digits())
    footprint = Footprint.of({"class_path": "fl_lightning.elastic.models.CNN"}, data, 16, FedAvg())
    real = CNN(10, (1, 8, 8))
    weights = sum(p.numel() for p in real.parameters())
    floats = sum(t.numel() for t in real.state_dict().values() if t.is_floating_point())
    buffers = sum(b.numel() * b.element_size() for b in real.buffers())
    with torch.device("meta"):
        meta = CNN(10, (1, 8, 8))
    activations = saved_activation_bytes(meta, meta.max_spec(), (1, 8, 8), 16)
    assert activations > 16 * 64 * 4  # more than the input alone
    expected = (RANK_BASE_BYTES + 1_797 * 64 * 4 + (4 * weights + buffers) + 8 * floats + (3 * 4 * weights + buffers)
                + int(ACTIVATION_RESIDENT * activations))
    assert footprint.per_rank == expected
    assert Footprint.of({"class_path": "fl_lightning.elastic.models.CNN"}, data).per_rank < expected  # no activations


def test_feast_estimates_its_largest_envelope_and_costliest_variant(tmp_path):
    """FEAST routes a client at most the envelope of its cached variants and trains its costliest
    variant at most: the estimate holds three times that envelope's weights, not the supernet's."""
    from test_feast import MODEL, small_cache

    from fl_lightning.algorithms import Feast
    from fl_lightning.elastic.envelope import envelope, routed_param_count
    from fl_lightning.elastic.models.base import shapes_only
    from fl_lightning.elastic.search.cache import VariantCache
    from fl_lightning.federation.memory import Holdings, saved_activation_bytes, shapes_model

    path = small_cache(tmp_path)
    built = shapes_model(MODEL, 4, (3, 16, 16))
    specs = VariantCache.load(path).specs
    holdings = Holdings.of(built, 0, (3, 16, 16), 8, Feast(cache=path))
    envelope_weights = routed_param_count(built, specs)
    assert envelope_weights < sum(p.numel() for p in built.parameters()), "the test needs a smaller envelope"
    with shapes_only():
        routed = built.build_local(envelope(specs, built.max_expansion), elastic=True)
    assert holdings.client == 3 * 4 * envelope_weights + sum(b.numel() * b.element_size() for b in routed.buffers())
    assert holdings.activations == saved_activation_bytes(built, specs[-1], (3, 16, 16), 8)
    assert Holdings.of(built, 0, (3, 16, 16), 8, Feast(cache=path, routing=False)).client > holdings.client


@pytest.mark.parametrize("options,key", [({"width": 1000.0}, "model.width"),
                                         ({"channels": [8, 16, 32], "width": 1000.0}, "model.width"),
                                         ({"channels": [8, 16, 99999]}, "model.channels"),
                                         ({}, "model")])
def test_a_model_too_large_is_blamed_on_the_option_that_makes_it_so(options, key):
    """The option whose default shrinks the model most; ``channels`` smaller than its default is
    not the one to blame for a width of 1000."""
    from fl_lightning.federation.memory import inflating_option

    assert inflating_option({"class_path": "fl_lightning.elastic.models.CNN", "init_args": options}, 10,
                            (1, 8, 8)) == key
