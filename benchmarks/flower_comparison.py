"""fl_lightning at its default settings against Flower's simulation engine, on the same round.

The equal-work round of ``machine_defaults.py`` (ResNet-18 at width 0.25 on the MNIST subset,
20 iid clients, 10 per round, 1 local epoch of batch 32, SGD with momentum;
``configs/split/offline/mnist_subset/resnet18_narrow/fedavg.yaml`` with those overrides), run
in the same invocation, interleaved, by

- fl_lightning: ``python -m fl_lightning fit`` at defaults (``devices: auto``), its per-round
  ``round_seconds`` (plan to aggregated global model);
- Flower 1.x: the Ray simulation engine (``flwr.simulation.start_simulation``) with 2 actors x 1
  CPU (one torch thread each), a FedAvg strategy sampling 10 of the 20 clients
  (``fraction_fit=0.5``, no evaluation), parameters exchanged as numpy arrays (the whole
  ``state_dict``, BN statistics included, as Flower's PyTorch examples do); a round is timed
  from ``configure_fit`` to the end of ``aggregate_fit``.

Both sides use the project's own RunSpec, data, partition and model builder, and every client
draws its batches with ``client_generator(seed, round, client)``. Prints the median of the
steady rounds (every round after the first) of each side and the ratio fl_lightning/Flower.

Flower is not a dependency of the project: run this from a separate virtual environment,

    python3 -m venv /work/flower_venv
    /work/flower_venv/bin/pip install -e '.[mnist]' 'flwr[simulation]>=1,<2'
    /work/flower_venv/bin/python benchmarks/flower_comparison.py [--rounds 4] [--repeats 2]

It is a measurement, not part of the tests.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _timing import median  # noqa: E402
from machine_defaults import EQUAL_WORK, NO_EVAL, RESNET, equal_work_spec, fit, ranks_of, round_seconds  # noqa: E402

from fl_lightning.data.federated import build_federated_data  # noqa: E402
from fl_lightning.federation.builder import build_global_model  # noqa: E402
from fl_lightning.runtime.client_data import ClientData  # noqa: E402
from fl_lightning.runtime.seeding import client_generator  # noqa: E402

try:
    import flwr
    import ray
    from flwr.client import NumPyClient
    from flwr.common import ndarrays_to_parameters
    from flwr.server import ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import start_simulation
except ImportError as missing:
    flwr = None
    NumPyClient = FedAvg = object  # so that the classes below can still be defined
    MISSING = missing

ACTORS = 2  # the "2 actors x 1 thread", the same cores fl_lightning's default uses

# -- Flower side -----------------------------------------------------------------------------------
# Built once per process (each Ray actor, and the driver for the initial parameters) and cached
# at module level: the client code loads the data and builds the model once, as a Flower user
# would, so that the rounds time the engine and the training, not set-up. The actors import this
# module by name (Ray passes the driver's sys.path on), so the cache survives across calls;
# a function pickled by value from __main__ would get fresh globals on every call.
_WORKER = {}


def _worker():
    if not _WORKER:
        spec = equal_work_spec(tempfile.gettempdir())
        fed = build_federated_data(spec.data, spec.partition, spec.seed)
        _WORKER.update(spec=spec, fed=fed, model=build_global_model(spec, fed))
    return _WORKER["spec"], _WORKER["fed"], _WORKER["model"]


def _ndarrays(model):
    return [value.cpu().numpy() for value in model.state_dict().values()]


class BenchClient(NumPyClient):
    def __init__(self, client: int):
        self.client = client

    def get_parameters(self, config):
        return _ndarrays(_worker()[2])

    def fit(self, parameters, config):
        torch.set_num_threads(1)  # one thread per actor (Ray also sets OMP_NUM_THREADS=1)
        setup = int(not _WORKER)  # reported, so that a steady round loading data is caught
        spec, fed, model = _worker()
        # Flower's PyTorch pattern: rebuild the state_dict from the received numpy arrays.
        model.load_state_dict(OrderedDict((k, torch.tensor(v)) for k, v in zip(model.state_dict(), parameters)))
        model.train()
        t, round_idx = spec.train, int(config["round"])
        data = ClientData(fed.bundle.train, fed.clients[self.client], t.batch_size)
        opt = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
        for _ in range(t.epochs):
            for x, y in data.epoch(client_generator(spec.seed, round_idx, self.client)):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        return _ndarrays(model), len(data), {"setups": setup}


def client_fn(context):
    return BenchClient(int(context.node_config["partition-id"])).to_client()


class TimedFedAvg(FedAvg):
    """FedAvg recording each round's seconds from configure_fit to the aggregated parameters."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seconds, self.setups, self._start = [], [], 0.0

    def configure_fit(self, server_round, parameters, client_manager):
        self._start = time.perf_counter()
        return super().configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):
        if failures:
            raise RuntimeError(f"round {server_round}: {len(failures)} client(s) failed: {failures[0]!r}")
        parameters, metrics = super().aggregate_fit(server_round, results, failures)
        self.seconds.append(time.perf_counter() - self._start)
        self.setups.append(metrics["setups"])
        return parameters, metrics


def flower_round_seconds(rounds: int) -> list:
    import flower_comparison as bench  # by name, so that Ray pickles the client code by reference

    spec = bench._worker()[0]
    strategy = bench.TimedFedAvg(
        fraction_fit=0.5, min_fit_clients=spec.federation.clients_per_round,
        min_available_clients=spec.partition.num_clients, fraction_evaluate=0.0, min_evaluate_clients=0,
        on_fit_config_fn=lambda server_round: {"round": server_round - 1},  # fl_lightning counts from 0
        fit_metrics_aggregation_fn=lambda metrics: {"setups": sum(m["setups"] for _, m in metrics)},
        initial_parameters=ndarrays_to_parameters(bench._ndarrays(bench._worker()[2])))
    start_simulation(client_fn=bench.client_fn, num_clients=spec.partition.num_clients,
                     config=ServerConfig(num_rounds=rounds), strategy=strategy,
                     client_resources={"num_cpus": 1, "num_gpus": 0.0},
                     ray_init_args={"num_cpus": ACTORS, "include_dashboard": False, "ignore_reinit_error": True,
                                    "log_to_driver": False, "logging_level": logging.WARNING})
    if len(strategy.seconds) != rounds:
        raise SystemExit(f"Flower finished {len(strategy.seconds)} of {rounds} rounds")
    if any(strategy.setups[1:]):  # an actor (re)built its data and model after the warm-up round
        raise SystemExit(f"Flower client set-ups per round {strategy.setups}: steady rounds are not steady")
    print(f"  Flower: client set-ups (data + model) per round {strategy.setups}", file=sys.stderr)
    return strategy.seconds


# -- both, interleaved --------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds per measurement (the first is warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating repetitions of both sides")
    args = parser.parse_args()
    if flwr is None:
        print(f"flower_comparison: Flower is not importable ({MISSING}); run it with the Flower venv, "
              "e.g. /work/flower_venv/bin/python benchmarks/flower_comparison.py", file=sys.stderr)
        sys.exit(2)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    ours, theirs, ranks = [], [], 1
    with tempfile.TemporaryDirectory() as out:
        for rep in range(args.repeats):  # interleaved, so that machine noise hits both alike
            done = fit([RESNET, *EQUAL_WORK, *NO_EVAL, "--stop_after", str(args.rounds)], out, f"default{rep}")
            ranks = ranks_of(done.stderr)
            ours += round_seconds(Path(out) / f"default{rep}")[1:]
            theirs += flower_round_seconds(args.rounds)[1:]
    mine, flower = median(ours), median(theirs)
    print(f"flwr {flwr.__version__}, ray {ray.__version__}, torch {torch.__version__}; "
          f"{args.repeats} x {args.rounds - 1} steady rounds per side")
    print("equal-work round (ResNet-18 x0.25, MNIST subset, 10 of 20 iid clients, 1 epoch of 32, momentum 0.9):")
    print(f"  fl_lightning fit at defaults ({ranks} rank(s) x 1 thread): {mine:.3f} s   "
          f"Flower simulation ({ACTORS} actors x 1 thread): {flower:.3f} s")
    print(f"  per round, fl_lightning: {' '.join(f'{s:.2f}' for s in ours)}")
    print(f"  per round, Flower:       {' '.join(f'{s:.2f}' for s in theirs)}")
    print(f"  fl_lightning/Flower ratio: {mine / flower:.3f}")


if __name__ == "__main__":
    main()
