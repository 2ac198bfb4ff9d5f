"""Several nodes: two "nodes" on localhost started by torchrun (gloo), against two ranks on one
node; a node that dies mid-round, and the restart (docs/runtime.md, Several nodes)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fl_lightning
from fl_lightning.runtime.checkpoint import load_checkpoint
from process_tree import descendants

SRC = Path(fl_lightning.__file__).parents[1]
ROUNDS = 12  # the death test's kill, right after round 0's checkpoint, lands mid-run


def fit_args(out: Path, name: str, *extra: str) -> list:
    """A small FedAvg on digits whose rounds take a fraction of a second."""
    return ["fit", "--out_dir", str(out), "--name", name, "--data.val_size", "100", "--partition.method", "iid",
            "--partition.num_clients", "4", "--partition.min_size", "1", "--federation.clients_per_round", "2",
            "--federation.rounds", str(ROUNDS), "--train.batch_size", "32", "--eval.every", "10",
            "--fabric.accelerator", "cpu", *extra]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
            "PYTHONWARNINGS": "ignore"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(rank: int, port: int, args: list) -> subprocess.Popen:
    """One "node": torchrun with one process, joining the other through 127.0.0.1:port."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "fl_lightning", *args, "--fabric.num_nodes", "2"]
    return subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def run_two_nodes(args: list, timeout: float = 240) -> list:
    port = free_port()
    nodes = [start_node(rank, port, args) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=timeout) for node in nodes]
        return [(node.returncode, *output) for node, output in zip(nodes, outputs)]
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_tree(node.pid)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it, as a node that loses power."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, cli_on_ranks):
    """The reference: the same run with two ranks on one node, forked from this process."""
    out = tmp_path_factory.mktemp("one_node")
    assert cli_on_ranks(fit_args(out, "r", "--fabric.devices", "2")) == 0
    return out / "r"


def same_model(a: Path, b: Path) -> bool:
    x, y = (load_checkpoint(p / "checkpoints" / "last.ckpt")["model"] for p in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun and /proc on Linux")


def test_two_nodes_on_localhost_match_two_ranks_on_one_node(tmp_path, one_node):
    """``devices: auto`` takes torchrun's one rank per node (on a machine where probing would
    give one per core); the two nodes share a run folder and end with the one-node model."""
    (code0, _, err0), (code1, _, err1) = run_two_nodes(fit_args(tmp_path, "r"))
    assert code0 == 0 and code1 == 0, (err0[-2000:], err1[-2000:])
    for err in (err0, err1):
        assert "fit: 1 rank(s) x 1 thread(s) on cpu (auto: torchrun started 1 rank(s) on each of 2 node(s)" in err
    assert same_model(tmp_path / "r", one_node)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary == json.loads((one_node / "summary.json").read_text())


def test_a_node_that_dies_mid_round_leaves_the_last_round_and_the_restart_resumes_exactly(tmp_path, one_node):
    """Node 1 is killed (every process) during the run: node 0 ends within seconds with one line,
    last.ckpt holds the last completed round whole, and both nodes started again with --resume
    auto finish with the uninterrupted model."""
    args = fit_args(tmp_path, "r")
    port = free_port()
    nodes = [start_node(rank, port, args) for rank in (0, 1)]
    last = tmp_path / "r" / "checkpoints" / "last.ckpt"
    try:
        deadline = time.monotonic() + 180
        while not last.exists():
            assert all(node.poll() is None for node in nodes), [node.communicate() for node in nodes]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.02)
        kill_tree(nodes[1].pid)
        killed = time.monotonic()
        _, err0 = nodes[0].communicate(timeout=120)
        waited = time.monotonic() - killed
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_tree(node.pid)
    assert nodes[0].returncode != 0 and waited < 60, err0[-2000:]
    lines = [line for line in err0.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: a rank left the run in round "), err0[-3000:]
    assert "[rank0]" not in err0, "the surviving rank ends with its line, not a traceback"
    held = load_checkpoint(last)["round"]
    assert 1 <= held < ROUNDS and f"the last checkpoint holds round {held - 1}" in lines[0]
    assert not list(last.parent.glob("*.tmp"))

    (code0, _, e0), (code1, _, e1) = run_two_nodes([*args, "--resume", "auto"])
    assert code0 == 0 and code1 == 0, (e0[-2000:], e1[-2000:])
    assert f"ready for round {held} " in e0
    assert same_model(tmp_path / "r", one_node)
    rows = [json.loads(line)["round"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(ROUNDS))
