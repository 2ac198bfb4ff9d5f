"""Client-side evaluation: each client's test shard has its training label mix, and the
evaluation phase scores a personalized method's client models on those shards (or on the whole
split), checked against accuracies counted by hand."""

import numpy as np
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from fl_lightning.data.base import ArrayDataset, DatasetBundle
from fl_lightning.data.federated import FederatedData
from fl_lightning.data.splits import label_matched_shards
from fl_lightning.errors import ConfigError
from fl_lightning.runtime.evaluation import ClientModels, EvaluationPhase


def test_each_class_is_shared_in_proportion_to_the_clients_training_counts():
    rng = np.random.default_rng(3)
    split = torch.as_tensor(rng.integers(0, 5, size=400))
    # class 4 is held by nobody; class 0 only by client 2
    held = [torch.tensor([1] * 30 + [2] * 10), torch.tensor([1] * 10 + [3] * 7), torch.tensor([0] * 5 + [2] * 30)]
    shards = label_matched_shards(split, held, seed=0)
    given = torch.cat(shards)
    assert len(torch.unique(given)) == len(given)  # disjoint
    expected = torch.nonzero(split != 4).flatten()
    assert torch.equal(torch.sort(given).values, expected)  # every example of a held class, once
    for k in range(4):
        total = int((split == k).sum())
        weights = np.array([int((h == k).sum()) for h in held], dtype=float)
        for client, shard in enumerate(shards):
            got = int((split[shard] == k).sum())
            exact = total * weights[client] / weights.sum()
            assert np.floor(exact) <= got <= np.ceil(exact), (k, client, got, exact)


def test_the_shards_are_a_function_of_the_seed():
    split = torch.arange(100) % 3
    held = [torch.tensor([0, 1, 2]), torch.tensor([0, 1])]
    assert all(torch.equal(a, b) for a, b in zip(label_matched_shards(split, held, 7),
                                                   label_matched_shards(split, held, 7)))
    assert not all(torch.equal(a, b) for a, b in zip(label_matched_shards(split, held, 7),
                                                       label_matched_shards(split, held, 8)))


class Constant(nn.Module):
    """Predicts one class whatever the input (logits favour ``label``)."""

    def __init__(self, label: int, num_classes: int = 3):
        super().__init__()
        self.logits = torch.full((num_classes,), -1.0)
        self.logits[label] = 1.0

    def forward(self, x):
        return self.logits.expand(len(x), -1)


class Personalized:
    """A method whose global model predicts class 0 and whose client c predicts class c."""

    def __init__(self, clients):
        self.clients = clients

    def evaluate(self, split, batch_size):
        return {"acc": -1.0, "loss": -1.0}

    def client_models(self, split):
        return ClientModels(self.clients, lambda c: Constant(c))


def federated(train_y, test_y, clients) -> FederatedData:
    train = ArrayDataset(torch.zeros(len(train_y), 2), torch.as_tensor(train_y))
    test = ArrayDataset(torch.zeros(len(test_y), 2), torch.as_tensor(test_y))
    bundle = DatasetBundle("toy", train, train, test, train.targets, 3, (2,))
    return FederatedData(bundle, [torch.as_tensor(c) for c in clients], torch.zeros(0, dtype=torch.long),
                         torch.zeros(0, dtype=torch.long), None)


def test_the_phase_scores_each_client_model_on_its_own_shard_or_on_the_whole_split():
    # client 0 trains on classes 0 and 1 (3:1), client 1 on class 1, client 2 on class 2
    train_y = [0, 0, 0, 1, 1, 1, 2, 2]
    data = federated(train_y, [0] * 6 + [1] * 5 + [2] * 4, [[0, 1, 2, 3], [4, 5], [6, 7]])
    fabric = Fabric(accelerator="cpu", devices=1)
    own = EvaluationPhase(fabric, Personalized([0, 1, 2]), data, batch_size=4)("test")
    dataset, shards = data.client_shards("test")
    by_hand = [float((dataset.targets[s] == c).float().mean()) for c, s in enumerate(shards)]
    # class 1's five examples go 1:2 to clients 0 and 1; client 0 gets all of class 0
    assert [len(s) for s in shards] == [6 + 2, 3, 4]
    assert own["acc"] == pytest.approx(sum(by_hand) / 3, rel=1e-12)
    assert own["acc"] == pytest.approx((6 / 8 + 1 + 1) / 3, rel=1e-12)
    assert own["clients"] == 3 and own["global_acc"] == -1.0
    whole = EvaluationPhase(fabric, Personalized([0, 1, 2]), data, batch_size=4, client_test="global")("test")
    assert whole["acc"] == pytest.approx((6 / 15 + 5 / 15 + 4 / 15) / 3, rel=1e-12)
    loss_of = lambda c, y: float(nn.functional.cross_entropy(Constant(c)(torch.zeros(1, 2)), torch.tensor([y])))  # noqa: E731
    assert whole["loss"] == pytest.approx(
        sum(sum(n * loss_of(c, y) for y, n in ((0, 6), (1, 5), (2, 4))) / 15 for c in range(3)) / 3, rel=1e-6)


def test_a_client_with_an_empty_shard_is_left_out_of_the_mean():
    data = federated([0, 0, 1], [0, 0, 0], [[0, 1], [2]])  # nobody's test data is class 1
    out = EvaluationPhase(Fabric(accelerator="cpu", devices=1), Personalized([0, 1]), data, 8)("test")
    assert out["clients"] == 1 and out["acc"] == 1.0


def test_natural_clients_are_scored_on_their_own_groups_test_data():
    data = federated([0, 1, 2, 0], [0, 1, 1, 2, 2, 2], [[0, 1], [2, 3]])
    data.bundle.extras["test_groups"] = [[0, 1], [2], [3, 4, 5]]
    data.client_groups = torch.tensor([2, 0])
    _, shards = data.client_shards("test")
    assert [s.tolist() for s in shards] == [[3, 4, 5], [0, 1]]


def test_sequence_targets_without_groups_are_refused_with_the_key():
    data = federated([0, 1], [0, 1], [[0], [1]])
    data.bundle.test.targets = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ConfigError, match="eval.client_test"):
        data.client_shards("test")
