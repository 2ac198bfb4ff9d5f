"""Write the sub-model study's configs: one YAML per policy and dataset.

    python tools/submodel_configs.py     # -> configs/submodel/{paper,offline}/<dataset>/<policy>.yaml

``paper/``: the protocols of Sec. 4.1 (CIFAR-10 and EMNIST with Dirichlet 0.3, Shakespeare's
20 largest roles with the 95 printable characters; 200 rounds). ``offline/``: CPU-sized
versions that run in minutes here on data that needs no network (the MNIST subset and digits
for the image tasks, the plays fetched by ``tools/fetch_shakespeare.py`` into
``data/shakespeare``).

Offline Shakespeare departs from the paper's protocol (Sec. 4.1) so that one run takes about
4 minutes on one CPU core; ``docs/results/submodel.md`` lists the same deviations:

- 60 rounds instead of 200 (HAS-FL still adapts 10 times after its 10-round warm-up);
- 20 local steps of 32 windows instead of one local epoch (about 400 steps of 64 for a role);
- lr 0.5 instead of 0.1, since at lr 0.1 the LSTM still predicts only the space after 15
  rounds of 20 steps;
- 128 hidden units per LSTM layer instead of 256 (a step costs about a third);
- the test set is every 20th test window of each role (``test_stride``, about 6,400 windows
  instead of 128,700), chosen after the roles and the temporal split, so a role's share of
  the test set is unchanged.

The 20 roles with most dialogue as 20 clients, 10 sampled per round, the nested gate-block
width slices, the caps and every policy's protocol are the paper's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from fl_lightning.tool_parser import ToolParser

POLICIES = {
    "hasfl": ("HASFL", {}),
    "hasfl_nocov": ("HASFL", {"coverage": False}),
    "heterofl": ("HeteroFL", {}),
    "fedrolex": ("FedRolex", {}),  # beyond the paper's comparison (docs/fedrolex.md)
    "fjord": ("FjORD", {}),
    "uniform": ("Uniform", {"width": 0.5}),
    "random_budget": ("RandomBudget", {"budget": 0.52}),
    "fedavg": ("FedAvg", {}),
    "fedprox": ("FedProx", {"mu": 1.0}),
    "scaffold": ("Scaffold", {}),
}

NOT_WRITTEN = {("fedrolex", "shakespeare")}
"""Policies a setting's model cannot run: the LSTM slices the leading hidden units of each gate
only, so FedRolex's rolling window refuses it (docs/fedrolex.md)."""


def policies(dataset: str) -> list:
    """The policies whose configs are written for ``dataset``."""
    return [p for p in POLICIES if (p, dataset) not in NOT_WRITTEN]


STUDY_BN = {"bn": "sbn"}
"""Every policy of the study serves its model with static BN (HeteroFL's sBN: statistics from one
pass over the union of the client shards), so no policy is scored with statistics averaged over
clients of other widths (docs/submodel.md, "Served statistics")."""

IMAGE_TRAIN = {"epochs": 5, "batch_size": 32, "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4,
               "grad_clip": 10.0, "lr_schedule": "exponential", "lr_decay": 0.995}


def section(package: str, cls: str, init_args: dict) -> dict:
    out = {"class_path": f"{package}.{cls}"}
    return {**out, "init_args": init_args} if init_args else out


def model(cls: str, **init_args) -> dict:
    return section("fl_lightning.elastic.models", cls, init_args)


def dataset(cls: str, **init_args) -> dict:
    return section("fl_lightning.data", cls, init_args)


def base(name, data, partition, model, train, rounds, eval_every, accelerator="auto"):
    return {"name": name, "seed": 0, "data": data, "partition": partition, "model": model,
            "train": train, "federation": {"rounds": rounds, "clients_per_round": 10},
            "eval": {"every": eval_every}, "fabric": {"accelerator": accelerator}}


SETTINGS = {
    ("paper", "cifar10"): base("cifar10", {"dataset": dataset("CIFAR10"), "download": True, "val_size": 2000},
                               {"method": "dirichlet", "num_clients": 20, "alpha": 0.3},
                               model("CNN", channels=[64, 128, 256]), IMAGE_TRAIN, 200, 5),
    ("paper", "emnist"): base("emnist", {"dataset": dataset("EMNIST"), "download": True, "val_size": 5000},
                              {"method": "dirichlet", "num_clients": 20, "alpha": 0.3},
                              model("CNN", channels=[64, 128, 256]), {**IMAGE_TRAIN, "epochs": 1}, 200, 5),
    ("paper", "shakespeare"): base("shakespeare", {"dataset": dataset("Shakespeare", source="plays", max_roles=20,
                                                                      vocabulary="printable"),
                                                   "val_size": 2000},
                                   {"method": "natural", "num_clients": 20}, model("CharLSTM"),
                                   {**IMAGE_TRAIN, "epochs": 1, "batch_size": 64, "lr": 0.1, "grad_clip": 5.0}, 200, 10),
    ("offline", "mnist_subset"): base("mnist_subset", {"dataset": dataset("MNISTSubset"), "val_size": 500},
                                      {"method": "dirichlet", "num_clients": 20, "alpha": 0.3},
                                      model("CNN", channels=[16, 32, 64]),
                                      {**IMAGE_TRAIN, "epochs": 1, "lr": 0.05}, 20, 5, "cpu"),
    ("offline", "digits"): base("digits", {"dataset": dataset("Digits"), "val_size": 150},
                                {"method": "dirichlet", "num_clients": 20, "alpha": 0.3},
                                model("CNN"), {**IMAGE_TRAIN, "epochs": 2, "batch_size": 16, "lr": 0.05}, 30, 5, "cpu"),
    # CPU-sized Shakespeare: deviations from the paper in the module docstring
    ("offline", "shakespeare"): base("shakespeare", {"dataset": dataset("Shakespeare", source="plays", max_roles=20,
                                                                        vocabulary="printable", test_stride=20),
                                                     "root": "data",
                                                     "val_size": 1000},
                                     {"method": "natural", "num_clients": 20},
                                     model("CharLSTM", hidden_size=128),
                                     {**IMAGE_TRAIN, "epochs": 1, "steps": 20, "batch_size": 32, "lr": 0.5,
                                      "grad_clip": 5.0, "momentum": 0.9}, 60, 5, "cpu"),
}

OFFLINE_POLICIES = ("hasfl", "hasfl_nocov", "heterofl", "fedrolex", "fjord", "uniform", "random_budget", "fedavg", "fedprox", "scaffold")
HEADER = ("# Sub-model study (papers/hasfl-capacity-confounds-coverage.md), {where}: {policy} on {dataset}.\n"
          "# Written by tools/submodel_configs.py; run several seeds with tools/submodel_sweep.py.\n")


def config_for(where, dataset, policy):
    cfg = copy.deepcopy(SETTINGS[(where, dataset)])
    cls, args = POLICIES[policy]
    cfg["name"] = f"{policy}_{dataset}" + ("" if where == "paper" else "_offline")
    # one population-correct served-statistics protocol for every policy (docs/submodel.md)
    cfg["algorithm"] = {"class_path": f"fl_lightning.algorithms.{cls}", "init_args": {**args, **STUDY_BN}}
    if policy == "scaffold":  # vanilla SGD (Sec. 4.1)
        cfg["train"].update({"momentum": 0.0, "weight_decay": 0.0})
    return cfg


def main(out="configs/submodel"):
    written = 0
    for (where, dataset) in SETTINGS:
        for policy in policies(dataset):
            path = Path(out) / where / dataset / f"{policy}.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            text = HEADER.format(where=where, policy=policy, dataset=dataset)
            path.write_text(text + yaml.safe_dump(config_for(where, dataset, policy), sort_keys=False))
            written += 1
    print(f"{written} configs under {out}")


if __name__ == "__main__":
    ToolParser(description=__doc__.splitlines()[0]).parse_args()  # no options: refuse stray ones
    main()
