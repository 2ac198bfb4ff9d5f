"""From config to a federated dataset: load, carve server-held splits, partition."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

from fl_lightning.config import DataConfig, PartitionConfig
from fl_lightning.data.base import DatasetBundle
from fl_lightning.data.budgets import zipf_budgets
from fl_lightning.data.partition import (alpha_data_for, clients_need, make_partition, natural_partition,
                                         validate_partition_params)
from fl_lightning.data.splits import carve_server_splits, groups_to_pool, label_matched_shards, to_dataset_indices
from fl_lightning.errors import ConfigError


@dataclass
class FederatedData:
    """A dataset split between clients and the server.

    ``clients[i]`` holds dataset indices (into ``bundle.train``) of client i's shard;
    ``val`` and ``calib`` are server-held indices carved out of the training pool before
    partitioning; the test set is ``bundle.test``.
    """

    bundle: DatasetBundle
    clients: List[torch.Tensor]
    val: torch.Tensor
    calib: torch.Tensor
    budgets: Optional[torch.Tensor]
    server: Optional[Dataset] = None
    """Dataset that ``val`` and ``calib`` index (default: the training pool, unaugmented)."""
    client_groups: Optional[torch.Tensor] = None
    """With a natural partition: the group (e.g. Shakespeare role) each client is."""
    seed: int = 0
    _client_shards: dict = field(default_factory=dict, repr=False)

    def split(self, name: str) -> Tuple[Dataset, Optional[torch.Tensor]]:
        """(dataset, indices) of a server-side split: 'test', 'val' or 'calib'."""
        if name == "test":
            return self.bundle.test, None
        server = self.server if self.server is not None else self.bundle.train_eval
        return server, {"val": self.val, "calib": self.calib}[name]

    def client_shards(self, name: str) -> Tuple[Dataset, List[torch.Tensor]]:
        """(dataset, per-client indices) of a split shared among the clients, each client's share
        its own test data: with a natural partition whose dataset has natural test groups
        (Shakespeare's roles), the client's group; otherwise a share whose label mix is the
        client's training mix (:func:`label_matched_shards`). A pure function of the data, the
        partition and the seed; computed once per split."""
        if name not in self._client_shards:
            dataset, indices = self.split(name)
            test_groups = self.bundle.extras.get("test_groups")
            if name == "test" and self.client_groups is not None and test_groups is not None:
                shards = [torch.as_tensor(test_groups[int(g)], dtype=torch.long) for g in self.client_groups]
            else:
                targets = torch.as_tensor(dataset.targets, dtype=torch.long)
                if targets.dim() != 1:
                    raise ConfigError("eval.client_test", "own needs one class label per example or a natural "
                                                          "partition of a dataset with test groups; use global")
                if indices is None:
                    indices = torch.arange(len(targets))
                train_targets = self.bundle.train_targets
                local = label_matched_shards(targets[indices], [train_targets[c] for c in self.clients], self.seed)
                shards = [indices[positions] for positions in local]
            self._client_shards[name] = (dataset, shards)
        return self._client_shards[name]

    def calibration_set(self, transform: str = "train") -> Tuple[Dataset, torch.Tensor]:
        """(dataset, indices) of the BN-calibration split seen through the ``train`` transform
        (the image-level training augmentation, RandAugment included) or the ``eval`` one."""
        dataset, indices = self.split("calib")
        if transform == "eval":
            return dataset, indices
        if self.server is None:  # carved out of the training pool: the training view of it
            return self.bundle.train, indices
        if not hasattr(dataset, "with_transform"):
            raise ConfigError("data.server_source", "this dataset cannot show its validation split through the "
                                                    "training transform; calibrate with the eval transform")
        return dataset.with_transform(getattr(self.bundle.train, "transform", None)), indices

    def state_dict(self) -> dict:
        """The partition as saved with a run (a pure function of config and seed)."""
        out = {f"client/{i}": idx for i, idx in enumerate(self.clients)}
        out.update({"val": self.val, "calib": self.calib})
        if self.budgets is not None:
            out["budgets"] = self.budgets
        return out


def client_budgets(partition: PartitionConfig, seed: int) -> torch.Tensor:
    """Every client's MAC budget (FEAST Supp. A), a pure function of the config and seed."""
    b = partition.budgets
    return zipf_budgets(partition.num_clients, seed, s=b.zipf_s, b_min=b.b_min, b_max=b.b_max)


def with_randaugment(dataset: Dataset, num_ops: int, magnitude: int) -> Dataset:
    """The dataset seen through RandAugment(num_ops, magnitude) and then its own transform."""
    stored = getattr(dataset, "data", None)
    if not hasattr(dataset, "with_transform") or (stored is not None and stored.dtype != torch.uint8):
        raise ConfigError("data.randaugment", "needs a dataset of uint8 images (cifar, cinic10, tinyimagenet, domainnet)")
    steps = [v2.RandAugment(num_ops=num_ops, magnitude=magnitude)]
    if dataset.transform is not None:
        steps.append(dataset.transform)
    return dataset.with_transform(v2.Compose(steps))


def check_server_splits(data: DataConfig, available: int, what: str, room: int, room_for: str = "one") -> None:
    """``val_size + calib_size`` examples fit in ``available`` with ``room`` to spare (the
    clients' pool; ``room_for`` says why that many); the ConfigError names the size that does
    not fit: val_size when it alone does not, else calib_size."""
    most = available - room
    if data.val_size + data.calib_size <= most:
        return
    key = "data.val_size" if data.val_size > most or data.calib_size == 0 else "data.calib_size"
    given = f"val_size {data.val_size} + calib_size {data.calib_size}" if data.calib_size else f"{data.val_size}"
    left = available - data.val_size - data.calib_size
    if room and left >= 0:
        raise ConfigError(key, f"{given} server-held examples leave {left} of the {available} {what} for the "
                               f"clients, who need {room_for}; at most {most} fit")
    spare = f" and leave {room_for} for the clients" if room else ""
    raise ConfigError(key, f"{given} server-held examples, but the dataset has {available} {what}; "
                           f"at most {most} fit{spare}")


def _server_pool(data: DataConfig, partition: PartitionConfig, bundle: DatasetBundle, seed: int):
    """(client pool indices, val indices, calib indices, dataset the server splits index)."""
    if data.server_source == "valid":
        valid = bundle.extras.get("valid")
        if valid is None:
            raise ConfigError("data.server_source", f"{bundle.name} has no separate validation split")
        valid_targets = torch.as_tensor(valid.targets, dtype=torch.long)
        check_server_splits(data, len(valid_targets), "validation examples (server_source valid)", room=0)
        rest, val, calib = carve_server_splits(valid_targets, data.val_size, data.calib_size, seed)
        return torch.arange(len(bundle.train_targets)), val, calib, valid
    targets = bundle.train_targets
    need = 1 if partition.method == "natural" else clients_need(partition.num_clients, partition.min_size)
    if need > len(targets):  # too few examples even without server splits: partition.num_clients is refused
        need = 1
    room_for = f"{need} ({partition.num_clients} clients x min_size {partition.min_size})" if need > 1 else "one"
    check_server_splits(data, len(targets), "training examples", room=need, room_for=room_for)
    pool, val, calib = carve_server_splits(targets, data.val_size, data.calib_size, seed)
    return pool, val, calib, None


def build_federated_data(data: DataConfig, partition: PartitionConfig, seed: int,
                         bundle: Optional[DatasetBundle] = None) -> FederatedData:
    if bundle is None:
        bundle = data.source().load(data.root, data.download, data.augment)
    if data.randaugment:
        bundle.train = with_randaugment(bundle.train, *data.randaugment)
    targets = bundle.train_targets
    pool, val, calib, server = _server_pool(data, partition, bundle, seed)
    groups = None
    if partition.method == "natural":
        if bundle.groups is None:
            raise ConfigError("partition.method", f"natural needs a dataset with natural groups; {bundle.name} has none")
        groups = groups_to_pool(bundle.groups, pool)
        validate_partition_params("natural", None, partition.num_clients, num_groups=len(groups))
    else:  # before anything is sized by the client count (the budgets)
        validate_partition_params(partition.method, len(pool), partition.num_clients, alpha=partition.alpha,
                                  gamma=partition.gamma, min_size=partition.min_size)
    budgets = client_budgets(partition, seed)
    alpha = partition.alpha
    if partition.alpha_eff is not None:
        alpha = alpha_data_for(partition.alpha_eff, len(pool), bundle.num_classes, partition.num_clients)
    shards = make_partition(partition.method, targets[pool], partition.num_clients, seed,
                            alpha=alpha, gamma=partition.gamma, budgets=budgets,
                            groups=groups, min_size=partition.min_size, b_cap=partition.budgets.b_cap)
    clients = to_dataset_indices(shards, pool)
    client_groups = None
    if partition.method == "natural":  # which group each client is (the same draw as the partition's)
        client_groups = natural_partition(groups, partition.num_clients, seed, partition.min_size).group_ids
    return FederatedData(bundle, clients, val, calib, budgets, server, client_groups, seed)
