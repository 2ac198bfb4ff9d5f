"""FedRolex beyond its golden case (``tests/test_reference_fedrolex.py``): the rolling window
trains every channel within one cycle, where HeteroFL's leading slice never does; its options
are refused with one line naming the key, and a model without rolling windows (the Shakespeare
LSTM) is refused before any work."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from fl_lightning.algorithms import FedRolex, HeteroFL
from fl_lightning.config import EvalConfig, FederationConfig
from fl_lightning.federation.loop import run_fit
from option_checks import option_refusal
from test_bad_input import fails_cleanly
from test_datasets import PLAY

TINY_CNN = {"class_path": "fl_lightning.elastic.models.CNN", "init_args": {"channels": [4, 8]}}


def rows(spec, name):
    return [json.loads(line) for line in (Path(spec.out_dir) / spec.name / name).read_text().splitlines()]


def never_trained(rounds: int, sizes, lengths) -> float:
    """Fraction of a tensor's positions outside every window of rounds 0..rounds-1: per dimension
    of ``sizes[d]`` channels, the ``lengths[d]`` channels from ``(-r) mod sizes[d]`` on."""
    trained = {tuple((-r + j) % size for j, size in zip(offsets, sizes))
               for r in range(rounds) for offsets in itertools.product(*(range(n) for n in lengths))}
    return 1 - len(trained) / float(np.prod(sizes))


def test_the_window_covers_every_channel_in_one_cycle(spec_factory):
    """Every client at 1/4 of a CNN with 4 and 8 channels: one channel of the first layer and two
    of the second, the window moving one channel a round. Every channel (batch-norm vectors,
    the classifier's inputs) is trained within one cycle, 4 and 8 rounds; a convolution between
    two scaled layers only ever trains the (out, in) pairs whose windows move together, here half
    of them. HeteroFL's leading quarter leaves 3/4 of the channels untrained for good."""
    caps = [0.25] * 6
    rolled = spec_factory(name="rolex", algorithm=FedRolex(caps=caps), model=TINY_CNN,
                          federation=FederationConfig(rounds=8, clients_per_round=2), eval=EvalConfig(every=8))
    run_fit(rolled)
    metrics = rows(rolled, "metrics.jsonl")
    assert [m["window_offset"] for m in metrics] == [0, -1, -2, -3, -4, -5, -6, -7]
    for r, m in enumerate(metrics):
        done = r + 1
        expected = {"features.block0.bn.weight": never_trained(done, [4], [1]),
                    "features.block0.conv.weight": never_trained(done, [4, 1], [1, 1]),
                    "features.block1.bn.weight": never_trained(done, [8], [2]),
                    "features.block1.conv.weight": never_trained(done, [8, 4], [2, 1]),
                    "fc.weight": never_trained(done, [8], [2])}
        for key, value in expected.items():
            assert m[f"never_trained/{key}"] == pytest.approx(value), (r, key)
    last = metrics[-1]
    assert last["never_trained/features.block1.bn.weight"] == 0 and last["never_trained/fc.weight"] == 0
    assert last["never_trained/features.block1.conv.weight"] == 0.5
    assert all(c["p"] == 0.25 for c in rows(rolled, "clients.jsonl"))
    leading = spec_factory(name="leading", algorithm=HeteroFL(caps=caps), model=TINY_CNN,
                           federation=FederationConfig(rounds=8, clients_per_round=2), eval=EvalConfig(every=8))
    run_fit(leading)
    assert all(m["never_trained/features.block1.bn.weight"] == 0.75 for m in rows(leading, "metrics.jsonl"))


@pytest.mark.parametrize("options,key", [
    ({"weighting": "often"}, "algorithm.weighting"),
    ({"scaler": True, "bn": "aggregated"}, "algorithm.scaler"),
    ({"scaler": True, "bn": "client"}, "algorithm.scaler"),
    ({"bn": "per_width"}, "algorithm.bn"),
    ({"sbn_data": "test"}, "algorithm.sbn_data"),
    ({"tiers": [0.5, 0.25]}, "algorithm.tiers"),
    ({"tier_probs": [1.0]}, "algorithm.tier_probs"),
    ({"caps": [1.5, 0.5]}, "algorithm.caps"),
    ({"calib_batch_size": 0}, "algorithm.calib_batch_size"),
])
def test_bad_options_are_refused_naming_the_key(options, key):
    assert option_refusal("FedRolex", **options).key == key


def test_a_model_without_rolling_windows_is_refused(tmp_path, capsys):
    """CharLSTM keeps the leading hidden units of each gate block only: FedRolex stops with one
    line naming ``model``, exit 2, nothing written."""
    (tmp_path / "shakespeare").mkdir()
    (tmp_path / "shakespeare" / "fixture_gut.txt").write_text(PLAY * 20)
    (tmp_path / "shakespeare" / "other_gut.txt").write_text(PLAY.replace("Ham.", "Oth.") * 20)
    line = fails_cleanly(["fit", "--algorithm", "FedRolex", "--model", "fl_lightning.elastic.models.CharLSTM",
                          "--model.hidden_size", "16", "--data.dataset", "fl_lightning.data.Shakespeare",
                          "--data.dataset.min_samples_per_role", "0", "--data.dataset.seq_length", "20",
                          "--data.root", str(tmp_path), "--data.val_size", "4", "--partition.method", "natural",
                          "--partition.num_clients", "2", "--federation.clients_per_round", "2",
                          "--fabric.accelerator", "cpu", "--fabric.devices", "1",
                          "--out_dir", str(tmp_path / "runs")], capsys, "model", tmp_path)
    assert "CharLSTM" in line and "rolling" in line
