"""The kept parts a method registers instead of writing ``state_dict``: each restores exactly
what it saved (values, dtypes, the CPU for server bookkeeping), so a resumed run continues
bit for bit (the methods' own resume tests check whole runs)."""

import torch

from fl_lightning.algorithms import FedAvg
from fl_lightning.runtime.kept_state import KeptAttributes, KeptModule, KeptRecord, KeptTensors


def test_kept_tensors_copy_in_place_and_add_what_was_created_lazily():
    held = {"w": torch.zeros(3)}
    part = KeptTensors("c/", held)
    alias = held["w"]
    part.load_state_dict({"c/w": torch.tensor([1.0, 2.0, 3.0]), "c/m": torch.ones(2), "other/w": torch.full((3,), 9.0)})
    assert alias is held["w"] and torch.equal(alias, torch.tensor([1.0, 2.0, 3.0]))  # updated in place
    assert torch.equal(held["m"], torch.ones(2))  # a lazily created entry comes back
    assert set(part.state_dict()) == {"c/w", "c/m"}


def test_boolean_masks_are_stored_as_bytes_and_come_back_as_booleans():
    mask = {"k": torch.tensor([True, False, True])}
    saved = KeptTensors("ever/", mask, stored_as=torch.uint8).state_dict()
    assert saved["ever/k"].dtype == torch.uint8
    fresh = {"k": torch.zeros(3, dtype=torch.bool)}
    KeptTensors("ever/", fresh, stored_as=torch.uint8).load_state_dict(saved)
    assert fresh["k"].dtype == torch.bool and fresh["k"].tolist() == [True, False, True]


class _Owner:
    pass


def test_kept_attributes_are_replaced_with_their_dtype_and_saved_as_copies():
    owner = _Owner()
    owner.h = torch.tensor([0.1, 0.2], dtype=torch.float64)
    part = KeptAttributes(owner, {"stats/h": "h"}, torch.float64)
    saved = part.state_dict()
    owner.h += 1.0  # a later round must not change what was saved
    assert saved["stats/h"].tolist() == [0.1, 0.2]
    part.load_state_dict({"stats/h": torch.tensor([0.5, 0.25], dtype=torch.float32)})
    assert owner.h.dtype == torch.float64 and owner.h.tolist() == [0.5, 0.25]


def test_kept_module_prefixes_its_keys_and_records_are_saved_not_loaded():
    module = torch.nn.Linear(2, 1)
    part = KeptModule("probe/", module)
    saved = part.state_dict()
    assert set(saved) == {"probe/weight", "probe/bias"}
    other = torch.nn.Linear(2, 1)
    KeptModule("probe/", other).load_state_dict({**saved, "elsewhere/weight": torch.zeros(1, 2)})
    assert torch.equal(other.weight, module.weight) and torch.equal(other.bias, module.bias)
    record = KeptRecord("macs", lambda: torch.tensor([3.0]))
    assert record.state_dict() == {"macs": torch.tensor([3.0])}
    record.load_state_dict({"macs": torch.tensor([7.0])})  # recomputed at set-up, never read back


def test_the_base_checkpoints_every_kept_part_together():
    method = FedAvg()
    method.kept = []
    held, owner = {"w": torch.zeros(2)}, _Owner()
    owner.n = torch.tensor([1, 2])
    method.keep(KeptTensors("c/", held))
    method.keep(KeptAttributes(owner, {"n": "n"}, torch.int64))
    held["w"] += 4.0
    saved = {k: v.clone() for k, v in method.state_dict().items()}
    held["w"].zero_()
    owner.n = torch.tensor([0, 0])
    method.load_state_dict(saved)
    assert held["w"].tolist() == [4.0, 4.0] and owner.n.tolist() == [1, 2]
