"""Bad input as a new user types it: every case ends with exit status 2 and one stderr line
``error: <key>: <problem>``, no traceback, and nothing written or changed on disk.

CLI cases run ``main()`` in-process and fail before any data is loaded; checkpoints, resume
compatibility and corrupt dataset files are checked at the functions that read them.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml
import torch
import torch._dynamo  # noqa: F401  (Lightning imports it; it must see torch's own functions, not no_gpu's)
from PIL import Image
from torch import nn

from fl_lightning.cli import main, shared_parser
from fl_lightning.data import CIFAR10, CINIC10, EMNIST, DomainNet, Shakespeare, TinyImageNet
from fl_lightning.errors import ConfigError
from fl_lightning.runtime.checkpoint import load_checkpoint, load_model_state, save_checkpoint
from fl_lightning.federation.run_dir import RESUME_SAFE_KEYS, check_resume_compatible

QUICKSTART = Path(__file__).parents[1] / "configs" / "quickstart.yaml"
CNN, LSTM, OFA, VIT = (f"fl_lightning.elastic.models.{name}" for name in ("CNN", "CharLSTM", "OFAResNet", "ViT"))

CONFIG_FILES = {
    "train5.yaml": "train: 5\n",
    "empty.yaml": "",
    "comments.yaml": "# only a comment\n",
    "list.yaml": "- data\n- model\n",
    "bad.yaml": "data: {val_size: 10\n",
    "null_section.yaml": "data:\nseed: 1\n",
    "unknown_key.yaml": "federation:\n  roundz: 3\n",
    "budgets7.yaml": "partition:\n  budgets: 7\n",
    "algorithm5.yaml": "algorithm: 5\n",
    "lr_inf.yaml": "train:\n  lr: .inf\n",
    "rounds_text.yaml": "federation:\n  rounds: ten\n",
    "dup_key.yaml": "train:\n  lr: 0.1\n  epochs: 2\n  lr: 1000000.0\n",
    "dup_section.yaml": "train:\n  lr: 0.1\nseed: 1\ntrain:\n  epochs: 2\n",
    "dup_nested.yaml": "algorithm:\n  class_path: FedProx\n  init_args:\n    mu: 0.1\n    mu: 0.2\n",
}


@pytest.fixture
def inputs(tmp_path):
    """Files that bad arguments point at: configs, a binary file, a plain file, a folder."""
    folder = tmp_path / "inputs"
    folder.mkdir()
    for name, text in CONFIG_FILES.items():
        (folder / name).write_text(text)
    (folder / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    (folder / "a_file").write_text("keep me\n")
    (folder / "a_folder").mkdir()
    (folder / "loop_a").symlink_to(folder / "loop_b")
    (folder / "loop_b").symlink_to(folder / "loop_a")
    (folder / "dangling").symlink_to(folder / "nowhere")
    os.mkfifo(folder / "fifo")
    return folder


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    """Every machine looks like this 2-core CI box: no CUDA, no MPS."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def snapshot(root: Path) -> dict:
    """Every path under ``root`` with its bytes (folders as None)."""
    def content(p: Path):
        if p.is_symlink():
            return os.readlink(p)
        if p.is_fifo():
            return "fifo"
        return None if p.is_dir() else p.read_bytes()

    return {str(p.relative_to(root)): content(p) for p in sorted(root.rglob("*"))}


def fails_cleanly(argv, capsys, key: str, root: Path) -> str:
    """Run the CLI; check exit 2, one 'error: <key>:' line, no traceback, nothing written."""
    before = snapshot(root)
    code = main(argv)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, captured.err
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"error: {key}:"), lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert snapshot(root) == before, "nothing may be written or changed when the input is bad"
    return lines[0]


FIT_CASES = [
    # Fabric: names Fabric refuses, and what this machine cannot run
    (["--fabric.accelerator", "quantum"], "fabric.accelerator"),
    (["--fabric.precision", "7-bogus"], "fabric.precision"),
    (["--fabric.strategy", "bogus"], "fabric.strategy"),
    (["--fabric.accelerator", "cuda"], "fabric.accelerator"),
    (["--fabric.accelerator", "gpu"], "fabric.accelerator"),
    (["--fabric.accelerator", "mps"], "fabric.accelerator"),
    (["--fabric.accelerator", "tpu"], "fabric.accelerator"),
    (["--fabric.strategy", "fsdp"], "fabric.strategy"),
    (["--fabric.strategy", "deepspeed"], "fabric.strategy"),
    (["--fabric.devices", "0"], "fabric.devices"),
    (["--fabric.devices", "two"], "fabric.devices"),
    (["--fabric.threads_per_rank", "0"], "fabric.threads_per_rank"),
    # top-level options
    (["--seed", "-1"], "seed"),
    (["--seed", str(2**64)], "seed"),
    (["--stop_after", "-1"], "stop_after"),
    (["--stop_after", "0"], "stop_after"),
    (["--stop_after", "x"], "stop_after"),
    (["--checkpoint_every", "0"], "checkpoint_every"),
    (["--name", ""], "name"),
    (["--name", "../x"], "name"),
    (["--name", "a/../../x"], "name"),
    (["--name", "{tmp}/absolute"], "name"),
    (["--name", "."], "name"),
    (["--name", "bad\nname"], "name"),
    (["--out_dir", "{inputs}/a_file"], "out_dir"),
    (["--out_dir", "{inputs}/a_file/runs"], "out_dir"),
    (["--resume", "{tmp}/no_such.ckpt"], "resume"),
    # what the operating system would refuse, named before anything is created
    (["--name", "n" * 300], "name"),
    (["--name", "sweep/" + "n" * 256 + "/a"], "name"),
    (["--out_dir", "{tmp}/" + "d" * 256], "out_dir"),
    (["--out_dir", "{tmp}/" + "/".join(["d" * 200] * 25)], "out_dir"),
    (["--out_dir", ""], "out_dir"),
    (["--out_dir", " "], "out_dir"),
    (["--out_dir", "/proc/fl_lightning_runs"], "out_dir"),
    (["--out_dir", "/proc/self"], "out_dir"),
    (["--out_dir", "/sys/fl_lightning_runs"], "out_dir"),
    (["--out_dir", "{inputs}/loop_a"], "out_dir"),
    (["--out_dir", "{inputs}/loop_a/runs"], "out_dir"),
    (["--out_dir", "{inputs}/dangling"], "out_dir"),
    # config files
    (["--config", "{inputs}/train5.yaml"], "train"),
    (["--config", "{inputs}/binary.yaml"], "config"),
    (["--config", "{inputs}/empty.yaml"], "config"),
    (["--config", "{inputs}/comments.yaml"], "config"),
    (["--config", "{inputs}/list.yaml"], "config"),
    (["--config", "{inputs}/bad.yaml"], "config"),
    (["--config", "{inputs}/null_section.yaml"], "data"),
    (["--config", "{inputs}/unknown_key.yaml"], "federation.roundz"),
    (["--config", "{inputs}/budgets7.yaml"], "partition.budgets"),
    (["--config", "{inputs}/algorithm5.yaml"], "algorithm"),
    (["--config", "{inputs}/lr_inf.yaml"], "train.lr"),
    (["--config", "{inputs}/rounds_text.yaml"], "federation.rounds"),
    (["--config", "{inputs}/missing.yaml"], "config"),
    (["--config", "{inputs}/a_folder"], "config"),
    (["--config=" "{inputs}/empty.yaml"], "config"),
    # config files that are not regular files, or give a key twice
    (["--config", "{inputs}/dup_key.yaml"], "train.lr"),
    (["--config", "{inputs}/dup_section.yaml"], "train"),
    (["--config", "{inputs}/dup_nested.yaml"], "algorithm.init_args.mu"),
    (["--config", "/dev/zero"], "config"),
    (["--config", "/dev/null"], "config"),
    (["--config", "{inputs}/fifo"], "config"),
    (["--train", "{inputs}/fifo"], "train"),
    # numeric extremes: named by validation, never overflowing in numpy or torch
    (["--train.lr", "-inf"], "train.lr"),
    (["--train.lr", "-1e-3"], "train.lr"),
    (["--train.lr", "nan"], "train.lr"),
    (["--train.lr", "1e400"], "train.lr"),
    (["--train.momentum", "nan"], "train.momentum"),
    (["--train.batch_size", str(2**40)], "train.batch_size"),
    (["--federation.rounds", "9" * 30], "federation.rounds"),
    (["--eval.every", str(2**64)], "eval.every"),
    (["--checkpoint_every", str(2**40)], "checkpoint_every"),
    (["--partition.alpha", "1e400"], "partition.alpha"),
    (["--partition.budgets.b_max", "inf"], "partition.budgets.b_max"),
    (["--data.dataset", "{{class_path: fl_lightning.data.Synthetic, init_args: {{num_train: .inf}}}}"],
     "data.dataset.num_train"),
    (["--data.dataset", "{{class_path: fl_lightning.data.Synthetic, init_args: {{num_train: 99999999999999999999}}}}"],
     "data.dataset.num_train"),
    (["--model.width", "1e400"], "model.width"),
    (["--model.width", "1e308"], "model.width"),  # finite, but its channel counts are not
    (["--train.lr", "1e308"], "train.lr"),  # finite in float64, not in the float32 the optimizer steps in
    (["--train.weight_decay", "1e39"], "train.weight_decay"),
    (["--partition.alpha", "-1e308"], "partition.alpha"),
    (["--partition.alpha", "1e308"], "partition.alpha"),  # past float32; up to it, near-iid (test_partition)
    (["--model", "fl_lightning.elastic.models.ResNet18", "--model.channels", "[8, 16, 32]"], "model.channels"),
    (["--model", VIT, "--model.patch_size", "5"], "model.patch_size"),
    (["--fabric.num_nodes", "2"], "fabric.num_nodes"),  # no launcher started the other node
    (["--fabric.threads_per_rank", str(2**31 - 1)], "fabric.threads_per_rank"),  # OpenMP would abort
    # refused once the data is loaded, still before any rank starts or anything is written
    (["--data.calib_size", "100000"], "data.calib_size"),
    (["--data.val_size", "100000"], "data.val_size"),
    (["--data.dataset.test_fraction", "0.9999"], "data.dataset.test_fraction"),
    (["--partition.num_clients", str(2**31 - 1), "--partition.min_size", "0"], "partition.num_clients"),
    (["--model.channels", "[8, 99999999999999999999]"], "model.channels"),
    (["--algorithm", "FedProx", "--algorithm.mu", "inf"], "algorithm.mu"),
    (["--algorithm", "FedProx", "--algorithm.mu=-inf"], "algorithm.mu"),
    # models that cannot be built or would not fit in memory
    (["--model.width", "1000"], "model.width"),
    (["--model", VIT, "--model.embed_dim", "64", "--model.num_heads", "5"], "model.num_heads"),
    (["--algorithm", "Feast", "--model", OFA, "--model.width_scale", "0.1"], "model.width_scale"),
    (["--algorithm", "Feast", "--model", OFA, "--algorithm.search.segments", "[]"],
     "algorithm.search.segments"),
    (["--algorithm", "HASFL", "--algorithm.tiers", "[0.5, 0.25, 1.0]"], "algorithm.tiers"),
    (["--algorithm", "HASFL", "--algorithm.tiers", "[0.25, 0.25, 1.0]"], "algorithm.tiers"),
    (["--algorithm", "FjORD", "--algorithm.tiers", "[1.0, 0.5]"], "algorithm.tiers"),
    # values and types
    (["--federation.rounds", "ten"], "federation.rounds"),
    (["--federation.rounds", "0"], "federation.rounds"),
    (["--federation.roundz", "3"], "federation.roundz"),
    (["--train", "5"], "train"),
    (["--train.lr", "-0.1"], "train.lr"),
    (["--train.epochs", "1.5"], "train.epochs"),
    (["--data.dataset", "5"], "data.dataset"),
    (["--data.dataset", "fl_lightning.data.Synthetic", "--data.dataset.noise", "-1"], "data.dataset.noise"),
    (["--data.dataset", "fl_lightning.data.Synthetic", "--data.dataset.colour", "red"], "data.dataset.colour"),
    (["--data.options", "{{num_classes: 5}}"], "data.options"),
    (["--data.download", "maybe"], "data.download"),
    (["--data.randaugment", "[a]"], "data.randaugment"),
    (["--data.val_size", "-1"], "data.val_size"),
    (["--model", "[1]"], "model"),
    (["--partition.budgets.b_cap", "-1"], "partition.budgets.b_cap"),
    (["--partition.budgets.b_min", "0"], "partition.budgets.b_min"),
    (["--partition.budgets.b_max", "1"], "partition.budgets.b_max"),
    (["--partition.budgets.zipf_s", "-1"], "partition.budgets.zipf_s"),
    # choices
    (["--data.dataset", "fl_lightning.data.MNIST"], "data.dataset"),
    (["--data.name", "mnist"], "data.name"),
    (["--partition.method", "shards"], "partition.method"),
    (["--train.lr_schedule", "linear"], "train.lr_schedule"),
    (["--eval.test", "sometimes"], "eval.test"),
    (["--data.server_source", "test"], "data.server_source"),
    (["--algorithm", "NoSuchAlgorithm"], "algorithm"),
    (["--algorithm.mu", "0.1"], "algorithm.mu"),
    (["--algorithm", "FedProx", "--algorithm.mu", "x"], "algorithm.mu"),
    (["--algorithm", "FedProx", "--algorithm.mu", "-1"], "algorithm.mu"),
    (["--algorithm", "Scaffold", "--algorithm.server_lr", "0"], "algorithm.server_lr"),
    (["--algorithm", "FedOpt", "--algorithm.server.lr", "0"], "algorithm.server.lr"),
    (["--algorithm", "FedOpt", "--algorithm.server.name", "adamw"], "algorithm.server.name"),
    # model options
    (["--model.channels", "-1"], "model.channels"),
    (["--model.channels", "[-1, 4]"], "model.channels"),
    (["--model.width", "0"], "model.width"),
    (["--model.channels", "abc"], "model.channels"),
    (["--model.min_width", "2"], "model.min_width"),
    (["--model.depth", "3"], "model.depth"),
    (["--model", LSTM, "--model.hidden_size", "0"], "model.hidden_size"),
    # FEAST options (checked before its cache search or any data)
    *[(["--algorithm", "Feast", "--model", OFA, f"--algorithm.{k}", v], f"algorithm.{k}")
      for k, v in (("search.population", "0"), ("search.generations", "0"), ("search.mutation", "2"),
                   ("calib_batch_size", "0"), ("mixup_alpha", "-1"), ("cutmix_alpha", "-1"), ("kappa", "-1"),
                   ("kappa", "inf"), ("rho_kd", "2"), ("temperature", "0"), ("rule", "sometimes"),
                   ("mix_schedule", "often"), ("calib_transform", "none"), ("cache", "{inputs}/binary.yaml"),
                   ("cache", "{tmp}/no_cache.json"))],
    (["--algorithm", "Feast", "--model", OFA, "--algorithm.mixup_alpha", "0"], "algorithm.mix_schedule"),
]


@pytest.mark.parametrize("args,key", FIT_CASES, ids=[" ".join(a)[:60] for a, _ in FIT_CASES])
def test_bad_fit_input_fails_with_one_line(tmp_path, inputs, capsys, args, key):
    args = [a.format(tmp=tmp_path, inputs=inputs) for a in args]
    out = tmp_path / "runs"
    fails_cleanly(["fit", "--out_dir", str(out), *args], capsys, key, tmp_path)
    assert not out.exists()


OTHER_CASES = [
    ([], "command"),
    (["fitt"], "command"),
    (["evaluate"], "run"),
    (["evaluate", "--run", "{tmp}/nowhere"], "run"),
    (["evaluate", "--run", "{inputs}", "--fabric.accelerator", "quantum"], "fabric.accelerator"),
    (["extract", "--run", "{tmp}/nowhere", "--budget", "30M"], "run"),
    (["models", "--widths", "[0]"], "widths"),
    (["models", "--num_classes", "0", "--input_shape", "[1, 8, 8]"], "num_classes"),
    (["partition", "--name", "../x", "--out_dir", "{tmp}/runs"], "name"),
    (["partition", "--out", "{inputs}/a_file"], "out"),
    (["partition", "--seed", "-1", "--out", "{tmp}/p"], "seed"),
]


@pytest.mark.parametrize("argv,key", OTHER_CASES, ids=[" ".join(a)[:60] or "no command" for a, _ in OTHER_CASES])
def test_bad_input_to_other_commands(tmp_path, inputs, capsys, argv, key):
    fails_cleanly([a.format(tmp=tmp_path, inputs=inputs) for a in argv], capsys, key, tmp_path)


def test_error_lines_read_well(tmp_path, inputs, capsys):
    """The reason is kept in the line, not cut off after the key."""
    def line(key, *args):
        return fails_cleanly(["fit", "--out_dir", str(tmp_path / "runs"), *args], capsys, key, tmp_path)

    assert "got 'ten'" in line("federation.rounds", "--federation.rounds", "ten")
    assert "is empty" in line("config", "--config", str(inputs / "empty.yaml"))
    assert "not a YAML text file" in line("config", "--config", str(inputs / "binary.yaml"))
    assert "CUDA" in line("fabric.accelerator", "--fabric.accelerator", "cuda")
    assert "did you mean federation.rounds" in line("federation.roundz", "--federation.roundz", "3")
    assert "FedProx" in line("algorithm", "--algorithm", "Nope")


def test_existing_run_is_kept(tmp_path, capsys):
    run = tmp_path / "runs" / "x"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"keep")
    (run / "metrics.jsonl").write_text('{"round": 0}\n')
    fails_cleanly(["fit", "--name", "x", "--out_dir", str(tmp_path / "runs")], capsys, "name", tmp_path)


@pytest.fixture
def read_only(monkeypatch):
    """Make chosen paths read-only for os.access (root ignores permission bits, and CI may run as root)."""
    denied = set()
    real_access = os.access

    def access(path, mode, *args, **kwargs):
        if mode & os.W_OK and os.path.abspath(path) in denied:
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    return lambda path: denied.add(os.path.abspath(path))


def test_read_only_out_dir_fails_before_work(tmp_path, capsys, read_only):
    out = tmp_path / "runs"
    out.mkdir()
    read_only(out)
    line = fails_cleanly(["fit", "--out_dir", str(out), "--name", "x"], capsys, "out_dir", tmp_path)
    assert "not writable" in line and not (out / "x").exists()


def test_read_only_parent_of_out_dir(tmp_path, capsys, read_only):
    read_only(tmp_path)
    fails_cleanly(["fit", "--out_dir", str(tmp_path / "a" / "runs")], capsys, "out_dir", tmp_path)


def test_read_only_checkpoint_of_resumed_run(tmp_path, capsys, read_only):
    run = tmp_path / "runs" / "x"
    save_checkpoint({"model": {}, "algorithm": {}, "round": 1, "best": {"val_acc": -1.0, "round": -1}},
                    run / "checkpoints" / "last.ckpt")
    read_only(run / "checkpoints" / "last.ckpt")
    fails_cleanly(["fit", "--out_dir", str(tmp_path / "runs"), "--name", "x", "--resume", "auto"], capsys,
                  "name", tmp_path)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_out_dir_by_permissions(tmp_path, capsys):
    out = tmp_path / "runs"
    out.mkdir()
    out.chmod(0o555)
    try:
        fails_cleanly(["fit", "--out_dir", str(out)], capsys, "out_dir", tmp_path)
    finally:
        out.chmod(0o755)


# ---------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------


class RunsCode:
    """Unpickling this would create the marker file: what a malicious checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _bad_checkpoint(kind: str, path: Path, marker: Path) -> Path:
    good = path.with_name("good.ckpt")
    save_checkpoint({"model": {"w": torch.ones(64, 64)}, "round": 3}, good)
    data = good.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "cut_short":
        path.write_bytes(data[:-30])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "random":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    elif kind == "text":
        path.write_text("model: weights\n")
    elif kind == "wrong_keys":
        save_checkpoint({"weights": {"w": torch.ones(2)}, "epoch": 3}, path)
    elif kind == "not_a_dict":
        torch.save([torch.ones(2)], path)
    elif kind == "runs_code":
        torch.save({"model": RunsCode(marker), "round": 1}, path)
    elif kind == "plain_pickle":
        path.write_bytes(pickle.dumps({"model": RunsCode(marker)}))
    elif kind == "folder":
        path.mkdir()
    elif kind == "missing":
        pass
    return path


CHECKPOINT_CASES = ["truncated", "cut_short", "empty", "random", "text", "wrong_keys", "not_a_dict", "runs_code",
                    "plain_pickle", "folder", "missing"]


@pytest.mark.parametrize("kind", CHECKPOINT_CASES)
@pytest.mark.parametrize("key", ["resume", "checkpoint"])
def test_bad_checkpoint_is_a_config_error(tmp_path, kind, key):
    marker = tmp_path / "code_ran"
    path = _bad_checkpoint(kind, tmp_path / "last.ckpt", marker)
    with pytest.raises(ConfigError) as err:
        load_checkpoint(path, key=key, required=("model", "round"))
    message = str(err.value)
    assert err.value.key == key and str(path) in message
    assert "\n" not in message and "weights_only" not in message
    assert not marker.exists(), "loading a checkpoint must never run code from it"


def test_checkpoint_that_runs_code_is_named_as_such(tmp_path):
    path = _bad_checkpoint("runs_code", tmp_path / "best.ckpt", tmp_path / "code_ran")
    with pytest.raises(ConfigError, match="could run code") as err:
        load_checkpoint(path)
    assert "io.open" in str(err.value) and "safe_globals" not in str(err.value) and "trust" not in str(err.value)


def test_config_error_survives_pickling():
    error = pickle.loads(pickle.dumps(ConfigError("data.root", "x.png: empty")))
    assert isinstance(error, ConfigError) and error.key == "data.root" and str(error) == "data.root: x.png: empty"


def test_good_checkpoint_loads(tmp_path):
    save_checkpoint({"model": {"w": torch.arange(3.0)}, "round": 2}, tmp_path / "last.ckpt")
    state = load_checkpoint(tmp_path / "last.ckpt", key="resume", required=("model", "round"))
    assert state["round"] == 2 and torch.equal(state["model"]["w"], torch.arange(3.0))


def _mlp(hidden: int, layers: int = 2) -> nn.Module:
    blocks = [nn.Linear(4, hidden), nn.ReLU()]
    for _ in range(layers - 2):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(hidden, 3))


def test_model_state_of_another_size_names_the_shapes(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_model_state(_mlp(8), _mlp(16).state_dict(), tmp_path / "best.ckpt")
    message = str(err.value)
    assert err.value.key == "checkpoint" and "different shapes" in message
    assert "0.weight (checkpoint [16, 4], model [8, 4])" in message and "\n" not in message


def test_model_state_of_another_architecture_names_keys(tmp_path):
    model = _mlp(8)
    with pytest.raises(ConfigError) as err:
        load_model_state(model, _mlp(8, layers=4).state_dict(), tmp_path / "last.ckpt", key="resume")
    message = str(err.value)
    assert err.value.key == "resume" and "unexpected" in message and "more" in message
    with pytest.raises(ConfigError, match="missing: 2.weight"):
        load_model_state(_mlp(8, layers=3), {k: v for k, v in _mlp(8, 3).state_dict().items() if k != "2.weight"},
                         tmp_path / "last.ckpt")
    with pytest.raises(ConfigError, match="not a state dict"):
        load_model_state(model, [1, 2], tmp_path / "last.ckpt")


def test_matching_model_state_loads(tmp_path):
    source, target = _mlp(8), _mlp(8)
    load_model_state(target, source.state_dict(), tmp_path / "best.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))


# ---------------------------------------------------------------------------------------
# Resuming under another configuration
# ---------------------------------------------------------------------------------------


def _resolved(*overrides: str) -> str:
    parser = shared_parser()
    cfg = parser.parse_args(["fit", "--config", str(QUICKSTART), *overrides])
    return parser.subcommand_parsers["fit"].dump(cfg.fit, skip_none=False)


REFUSED = [
    (["--seed", "1"], "seed"),
    (["--model.width_scale", "0.5"], "model.width_scale"),
    (["--model", CNN], "model.class_path"),
    (["--data.dataset", "fl_lightning.data.Digits"], "data.dataset.class_path"),
    (["--data.val_size", "200"], "data.val_size"),
    (["--partition.alpha_eff", "0.3"], "partition.alpha_eff"),
    (["--partition.budgets.b_cap", "5e6"], "partition.budgets.b_cap"),
    (["--federation.rounds", "80"], "federation.rounds"),
    (["--algorithm", "FedAvg"], "algorithm.class_path"),
    (["--algorithm.search.population", "32"], "algorithm.search.population"),
    (["--train.lr", "0.1"], "train.lr"),
]


@pytest.mark.parametrize("overrides,key", REFUSED, ids=[k for _, k in REFUSED])
def test_resume_with_another_config_is_refused(overrides, key):
    with pytest.raises(ConfigError) as err:
        check_resume_compatible(_resolved(), _resolved(*overrides))
    assert err.value.key == "resume" and key in str(err.value) and "\n" not in str(err.value)


def test_resume_may_change_where_and_how_it_runs():
    saved = _resolved()
    check_resume_compatible(saved, _resolved("--fabric.devices", "2", "--fabric.precision", "bf16-mixed",
                                             "--eval.every", "5", "--eval.test", "every", "--stop_after", "3",
                                             "--checkpoint_every", "2", "--name", "other", "--out_dir", "elsewhere",
                                             "--resume", "auto", "--data.root", "/mnt/data"))
    assert "fabric.*" in RESUME_SAFE_KEYS and "stop_after" in RESUME_SAFE_KEYS


def test_resume_refusal_lists_several_keys():
    with pytest.raises(ConfigError) as err:
        check_resume_compatible(_resolved(), _resolved("--seed", "3", "--federation.rounds", "10"))
    rounds = yaml.safe_load(QUICKSTART.read_text())["federation"]["rounds"]
    assert "seed (0 -> 3)" in str(err.value) and f"federation.rounds ({rounds} -> 10)" in str(err.value)


def test_resume_against_unreadable_saved_config():
    with pytest.raises(ConfigError) as err:
        check_resume_compatible("data: [unclosed\n", _resolved())
    assert err.value.key == "resume"


# ---------------------------------------------------------------------------------------
# Dataset folders with corrupt files: ConfigError naming data.root and the file
# ---------------------------------------------------------------------------------------


def _image(path: Path, size=32):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size, size, 3), 100, dtype=np.uint8)).save(path)


def _cinic(root: Path) -> Path:
    for split in ("train", "valid", "test"):
        for c in ("cat", "dog"):
            for i in range(2):
                _image(root / "cinic10" / split / c / f"{i}.png")
    return root / "cinic10"


def assert_names_file(err, path: Path) -> None:
    assert err.value.key == "data.root", str(err.value)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("damage", ["text", "empty", "truncated"])
def test_bad_image_in_folder_layout(tmp_path, damage):
    bad = _cinic(tmp_path) / "train" / "dog" / "1.png"
    if damage == "text":
        bad.write_text("not an image")
    elif damage == "empty":
        bad.write_bytes(b"")
    else:
        bad.write_bytes(bad.read_bytes()[:40])  # header intact, pixels cut off
    if damage == "truncated":  # found on decoding: up front with in_memory, else at first access
        with pytest.raises(ConfigError) as err:
            CINIC10(in_memory=True).load(str(tmp_path), False, True)
        assert_names_file(err, bad)
        lazy = CINIC10().load(str(tmp_path), False, True)
        with pytest.raises(ConfigError) as err:
            [lazy.train[i] for i in range(len(lazy.train))]
    else:
        with pytest.raises(ConfigError) as err:
            CINIC10().load(str(tmp_path), False, True)
    assert_names_file(err, bad)


def test_tinyimagenet_listed_image_missing(tmp_path):
    base = tmp_path / "tiny-imagenet-200"
    (base / "val" / "images").mkdir(parents=True)
    (base / "wnids.txt").write_text("n01\n")
    _image(base / "train" / "n01" / "images" / "n01_0.JPEG", 64)
    (base / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn01\t0\t0\t63\t63\n")
    with pytest.raises(ConfigError) as err:
        TinyImageNet().load(str(tmp_path), False, True)
    assert_names_file(err, base / "val" / "images" / "val_0.JPEG")
    (base / "val" / "val_annotations.txt").write_text("val_0.JPEG n01 0 0 63 63\n")  # spaces, not tabs
    with pytest.raises(ConfigError) as err:
        TinyImageNet().load(str(tmp_path), False, True)
    assert_names_file(err, base / "val" / "val_annotations.txt")


def test_domainnet_split_file_with_bad_line(tmp_path):
    base = tmp_path / "domainnet"
    _image(base / "clipart" / "cat" / "a.jpg")
    (base / "clipart_train.txt").write_text("clipart/cat/a.jpg 0\nclipart/cat/b.jpg cat\n")
    (base / "clipart_test.txt").write_text("clipart/cat/a.jpg 0\n")
    with pytest.raises(ConfigError) as err:
        DomainNet(image_size=16).load(str(tmp_path), False, True)
    assert_names_file(err, base / "clipart_train.txt")
    assert "line 2" in str(err.value)


@pytest.fixture
def no_md5(monkeypatch):
    """Fixture files cannot match the md5 of the real CIFAR release; only that check is skipped."""
    import torchvision.datasets.cifar as tv_cifar

    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *args, **kwargs: True)


def _cifar10(root: Path) -> Path:
    rng = np.random.default_rng(0)
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True)

    def batch(n):
        return {"labels": rng.integers(0, 10, n).tolist(), "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8)}

    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (base / name).write_bytes(pickle.dumps(batch(4)))
    (base / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"c{i}" for i in range(10)]}))
    return base


def test_truncated_cifar_pickle(tmp_path, no_md5):
    bad = _cifar10(tmp_path) / "data_batch_3"
    bad.write_bytes(bad.read_bytes()[:500])
    with pytest.raises(ConfigError) as err:
        CIFAR10().load(str(tmp_path), False, True)
    assert_names_file(err, bad)


def test_cifar_file_that_is_not_the_release(tmp_path):
    base = _cifar10(tmp_path)
    with pytest.raises(ConfigError) as err:
        CIFAR10().load(str(tmp_path), False, True)
    assert_names_file(err, base / "data_batch_1")
    assert "md5" in str(err.value)


def test_truncated_emnist_idx_file(tmp_path):
    raw = tmp_path / "EMNIST" / "raw"
    raw.mkdir(parents=True)
    images, labels = np.zeros((5, 28, 28), np.uint8), np.arange(5, dtype=np.uint8)
    for part in ("train", "test"):
        for kind, array in (("images-idx3-ubyte", images), ("labels-idx1-ubyte", labels)):
            header = struct.pack(">I", 0x0800 | array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
            (raw / f"emnist-byclass-{part}-{kind}").write_bytes(header + array.tobytes())
    bad = raw / "emnist-byclass-test-images-idx3-ubyte"
    bad.write_bytes(bad.read_bytes()[:-100])
    with pytest.raises(ConfigError) as err:
        EMNIST().load(str(tmp_path), False, True)
    assert_names_file(err, bad)
    assert "truncated" in str(err.value)


@pytest.mark.parametrize("content", ['{"users": ["A"], "user_data": {"A": {"x": ["ab', '[1, 2]',
                                     '{"users": ["A"], "user_data": {}}'])
def test_malformed_leaf_json(tmp_path, content):
    folder = tmp_path / "shakespeare" / "data"
    (folder / "train").mkdir(parents=True)
    (folder / "test").mkdir()
    bad = folder / "train" / "all_data_0.json"
    bad.write_text(content)
    with pytest.raises(ConfigError) as err:
        Shakespeare().load(str(tmp_path), False, True)
    assert_names_file(err, bad)


def test_fit_on_corrupt_dataset_stops_before_writing(tmp_path, capsys):
    """Through the whole command: the loader's error ends fit before the run folder exists."""
    bad = _cinic(tmp_path / "data") / "test" / "cat" / "0.png"
    bad.write_bytes(b"\x00" * 64)
    out = tmp_path / "runs"
    line = fails_cleanly(["fit", "--out_dir", str(out), "--data.dataset", "fl_lightning.data.CINIC10", "--data.root", str(tmp_path / "data"),
                          "--partition.num_clients", "2", "--partition.min_size", "0",
                          "--federation.clients_per_round", "1", "--federation.rounds", "1",
                          "--fabric.accelerator", "cpu"], capsys, "data.root", tmp_path)
    assert str(bad) in line and not out.exists()


def test_leaf_json_reader_accepts_good_files(tmp_path):
    text = "To be, or not to be, that is the question: " * 6
    xs = [text[i:i + 80] for i in range(len(text) - 80)]
    ys = [text[i + 80] for i in range(len(text) - 80)]
    for split in ("train", "test"):
        folder = tmp_path / "shakespeare" / "data" / split
        folder.mkdir(parents=True)
        blob = {"users": ["A"], "user_data": {"A": {"x": xs, "y": ys}}}
        (folder / "d.json").write_text(json.dumps(blob))
    assert len(Shakespeare().load(str(tmp_path), False, True).train) == len(xs)


def test_image_damaged_past_its_header_found_in_training_leaves_no_run_folder(tmp_path, capsys):
    """Found only when the lazily loaded image is decoded, during the first round: the one-line
    error still comes, and the run folder this fit created is removed again."""
    bad = _cinic(tmp_path) / "train" / "dog" / "1.png"
    bad.write_bytes(bad.read_bytes()[:40])
    out = tmp_path / "runs"
    code = main(["fit", "--data.dataset", "fl_lightning.data.CINIC10", "--data.root", str(tmp_path), "--data.augment", "false",
                 "--partition.method", "iid", "--partition.num_clients", "2", "--partition.min_size", "1",
                 "--federation.clients_per_round", "2", "--federation.rounds", "1", "--train.batch_size", "4",
                 "--fabric.accelerator", "cpu", "--out_dir", str(out), "--name", "lazy"])
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: data.root:") and str(bad) in lines[0]
    assert not (out / "lazy").exists()


def test_model_that_would_not_fit_in_memory_names_the_figure(tmp_path, capsys, monkeypatch):
    from fl_lightning.federation import memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 10**6)
    line = fails_cleanly(["fit", "--out_dir", str(tmp_path / "runs"), "--fabric.accelerator", "cpu"], capsys,
                         "model", tmp_path)
    assert "MB of weights" in line and "1.0 MB free on cpu" in line


def test_negative_value_after_a_space_is_read_as_a_value(tmp_path, capsys):
    line = fails_cleanly(["fit", "--out_dir", str(tmp_path / "runs"), "--train.lr", "-inf"], capsys, "train.lr",
                         tmp_path)
    assert "must be a finite number > 0, got -inf" in line and "command" not in line


def test_duplicate_key_names_the_file_and_lines(tmp_path, inputs, capsys):
    line = fails_cleanly(["fit", "--out_dir", str(tmp_path / "runs"), "--config", str(inputs / "dup_key.yaml")],
                         capsys, "train.lr", tmp_path)
    assert str(inputs / "dup_key.yaml") in line and "lines 2 and 4" in line


# ---------------------------------------------------------------------------------------
# Classes of values rather than cases: a null written in YAML, floats past float32
# ---------------------------------------------------------------------------------------


def _options_needing_a_value():
    """(yaml text, key) for every option of fit's config sections and of every model and
    algorithm class whose type is a number or choice that is not Optional: a YAML null there
    must be refused naming the key."""
    import dataclasses
    import inspect
    import typing

    import fl_lightning.algorithms as algorithms
    import fl_lightning.elastic.models as models
    from fl_lightning.cli.schema import default, options

    def optional(hint) -> bool:
        return type(None) in typing.get_args(hint)

    cases = []

    def walk(prefix, cls, nest):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.default_factory):
                walk(f"{prefix}.{f.name}", f.default_factory, lambda v, n=f.name: nest({n: v}))
            elif not optional(hints[f.name]):
                cases.append((yaml.safe_dump(nest({f.name: None})), f"{prefix}.{f.name}"))

    for option in options("fit"):
        if dataclasses.is_dataclass(default(option)):
            walk(option.name, option.default_factory, lambda v, n=option.name: {n: v})
        elif option.name in ("seed", "checkpoint_every", "name", "out_dir"):
            cases.append((yaml.safe_dump({option.name: None}), option.name))
    from fl_lightning.elastic.models.base import ElasticModel

    for section, module, base in (("model", models, ElasticModel), ("algorithm", algorithms, algorithms.Algorithm)):
        for name in module.__all__:
            cls = getattr(module, name)
            if not inspect.isclass(cls) or not issubclass(cls, base) or inspect.isabstract(cls):
                continue
            try:
                hints = typing.get_type_hints(cls.__init__)
            except Exception:
                continue
            for option, param in inspect.signature(cls.__init__).parameters.items():
                hint = hints.get(option)
                if option in ("self", "num_classes", "input_shape") or hint is None or optional(hint):
                    continue
                if param.default is inspect.Parameter.empty or getattr(hint, "wanted", None) is None:
                    continue  # number types only (they carry their range as ``wanted``)
                given = {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": {option: None}}
                cases.append((yaml.safe_dump({section: given}), f"{section}.{option}"))
    return cases


NULL_CASES = _options_needing_a_value()


def test_null_cases_cover_the_sections_models_and_algorithms():
    keys = {key for _, key in NULL_CASES}
    assert {"train.lr", "seed", "partition.budgets.b_min", "model.width", "algorithm.mu", "fabric.devices",
            "data.val_size", "federation.rounds", "name"} <= keys
    assert len(keys) > 60


@pytest.mark.parametrize("text,key", NULL_CASES, ids=[k for _, k in NULL_CASES])
def test_yaml_null_is_refused_for_every_option_that_needs_a_value(tmp_path, text, key):
    """``lr: null`` in a config file is refused by the option's type, as on the command line,
    before anything runs (jsonargparse's unset sentinel: an unset option is not a null one)."""
    from fl_lightning.cli import parse_command

    config = tmp_path / "null.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError) as err:
        parse_command(["fit", "--config", str(config)])
    assert err.value.key == key and "None" in str(err.value) and "\n" not in str(err.value)


def test_yaml_null_stays_allowed_where_it_means_none(tmp_path):
    from fl_lightning.cli import parse_command

    config = tmp_path / "nulls.yaml"
    config.write_text("train: {steps: null, grad_clip: null}\npartition: {alpha_eff: null}\n"
                      "fabric: {threads_per_rank: null}\nresume: null\nstop_after: null\nmodel: null\n")
    _, args, resolved = parse_command(["fit", "--config", str(config)])
    assert args.train.steps is None and args.fabric.threads_per_rank is None and args.resume is None
    assert "Unset" not in resolved and "UNSET" not in resolved


def test_lr_null_in_a_config_stops_before_the_run_folder(tmp_path, capsys):
    config = tmp_path / "lr_null.yaml"
    config.write_text((Path(__file__).parents[1] / "configs" / "fedavg_digits.yaml").read_text()
                      .replace("lr: 0.05", "lr: null"))
    line = fails_cleanly(["fit", "--config", str(config), "--out_dir", str(tmp_path / "runs")], capsys,
                         "train.lr", tmp_path)
    assert "got None" in line


@pytest.mark.parametrize("text,ok", [("3.4e38", True), ("-3.4e38", True), ("3.5e38", False), ("1e308", False),
                                     ("-1e39", False), ("1e-300", True)])
def test_every_float_option_stays_within_float32(text, ok):
    """One rule in the number types: a float option past float32's largest value (what the
    tensors it meets hold) is refused, whatever its own range."""
    from fl_lightning.option_types import OutOfRange, Range, parse_number

    for span in (Range(), Range(low=-1e300), Range(low=0.0, low_open=True)):
        if not span.holds(float(text)):
            continue
        if ok:
            assert parse_number(float, span, "a number", text) == float(text)
        else:
            with pytest.raises(OutOfRange, match="float32"):
                parse_number(float, span, "a number", text)


# ---------------------------------------------------------------------------------------
# Refusals that need the data or the supernet name the option the user set
# ---------------------------------------------------------------------------------------


def _quickstart_fit(tmp_path, *args) -> list:
    """The quick start on one rank (in this process), searching its cache instead of loading it."""
    return ["fit", "--config", str(QUICKSTART), "--out_dir", str(tmp_path / "runs"), "--fabric.devices", "1",
            "--algorithm.init_args.cache", "null", *args]


# The quick start's narrowed supernet costs 69.9K to 8.89M MACs (paper convention); its clients'
# budgets start at b_min = 200K.
SEARCH_REFUSALS = [
    (["--algorithm.search.segments", "[[20e6, 30e6, 2, 0.4]]"], "algorithm.search.segments[0]",
     "its targets 20M to 30M MACs lie beyond the supernet"),
    (["--algorithm.search.segments", "[[5e5, 4e6, 3, 0.25], [1e3, 2e3, 1, 0.4]]"], "algorithm.search.segments[1]",
     "its target 2K MACs lies beyond the supernet"),
    (["--algorithm.search.segments", "[[1e6, 4e6, 2, 0.3]]"], "algorithm.search.segments",
     "the lowest target, 1M MACs, is above the smallest client budget 200K MACs"),
    (["--partition.budgets.b_min", "5e4", "--partition.gamma", "0"], "partition.budgets.b_min",
     "the smallest client budget, 50K MACs, affords no subnet"),
]


@pytest.mark.parametrize("args,key,says", SEARCH_REFUSALS, ids=[k + str(i) for i, (_, k, _) in enumerate(SEARCH_REFUSALS)])
def test_a_searched_cache_is_refused_before_the_search(tmp_path, capsys, monkeypatch, args, key, says):
    """Segments beyond the supernet's MACs, or a cache that would not reach the poorest client,
    are refused from the supernet's smallest and largest subnets, before any target is searched."""
    import fl_lightning.elastic.search.cache as cache_module

    def no_search(*_, **__):
        raise AssertionError("the cache was searched before the refusal")

    monkeypatch.setattr(cache_module, "build_cache", no_search)
    line = fails_cleanly(_quickstart_fit(tmp_path, *args), capsys, key, tmp_path)
    assert says in line and "0.0M" not in line


def test_server_splits_that_leave_the_clients_too_little_name_the_split(tmp_path, capsys):
    """Digits holds 1438 training examples (1797 less its 20% test split, 359); 20 clients with
    min_size 10 need 200, so at most 1238 may be held by the server."""
    def line(key, *args):
        return fails_cleanly(["fit", "--out_dir", str(tmp_path / "runs"), *args], capsys, key, tmp_path)

    assert "1437 server-held examples leave 1 of the 1438 training examples for the clients, who need 200 " \
           "(20 clients x min_size 10); at most 1238 fit" in line("data.val_size", "--data.val_size", "1437")
    assert "val_size 1000 + calib_size 437 server-held examples leave 1 of the 1438" in \
        line("data.calib_size", "--data.val_size", "1000", "--data.calib_size", "437")
    # without server splits the dataset itself is too small: the client count is what was set
    assert "2000 clients" in line("partition.num_clients", "--partition.num_clients", "2000",
                                  "--partition.min_size", "0", "--federation.clients_per_round", "2")


@pytest.mark.parametrize("value,text", [(1000, "1K"), (23_400, "23.4K"), (200_000, "200K"), (999_999, "1M"),
                                        (4_462_000, "4.46M"), (596e6, "596M"), (1.5e9, "1.5G"), (512, "512"),
                                        (0, "0")])
def test_counts_show_small_budgets(value, text):
    """A budget of 1,000 MACs printed as ``{:.1f}M`` read "0.0M"; three significant digits with
    the largest prefix that keeps the figure >= 1 show it (999,999 rounds up to 1M, not 1e+03K)."""
    from fl_lightning.units import count, macs

    assert count(value) == text and macs(value) == f"{text} MACs"
