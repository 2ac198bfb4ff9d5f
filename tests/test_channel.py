"""The traffic channel: bytes counted from the tensors that cross it, by direction and kind."""

import pytest
import torch

from fl_lightning.elastic.regions import Full
from fl_lightning.elastic.routing import Routed
from fl_lightning.runtime.channel import DOWN, UP, Channel
from fl_lightning.runtime.link import Uplink


def test_bytes_follow_each_tensors_own_precision():
    channel = Channel()
    channel.down("cut", torch.zeros(3, 5, dtype=torch.float32), torch.zeros(7, dtype=torch.bfloat16))
    channel.up("cut", torch.zeros(2, 2, dtype=torch.float16), torch.zeros(4, dtype=torch.int64))
    channel.up("probe", torch.zeros((), dtype=torch.float32))
    assert channel.total(DOWN) == 3 * 5 * 4 + 7 * 2
    assert channel.total(UP) == 2 * 2 * 2 + 4 * 8 + 4
    assert channel.total(UP, "cut") == 2 * 2 * 2 + 4 * 8 and channel.total(UP, "model") == 0


def test_states_and_routed_slices_count_only_what_is_sent():
    state = {"a": torch.zeros(4, 3), "b": torch.zeros(10, dtype=torch.int64), "c": torch.zeros(2, dtype=torch.float16)}
    channel = Channel()
    channel.send_state(DOWN, "model", state, ["a", "c"])
    channel.send_state(UP, "model", state)
    assert channel.total(DOWN) == 4 * 3 * 4 + 2 * 2
    assert channel.total(UP) == 4 * 3 * 4 + 10 * 8 + 2 * 2

    module = torch.nn.Linear(3, 2)  # weight 2x3 and bias 2 in float32, both routed whole
    routed = Routed(module, {k: (k, Full(v.shape)) for k, v in module.state_dict().items()})
    channel = Channel()
    channel.send_routed(DOWN, routed)
    assert channel.total(DOWN) == 4 * (2 * 3 + 2)


def test_the_row_breaks_a_direction_down_only_when_it_carried_several_kinds():
    channel = Channel()
    channel.down("model", torch.zeros(10))
    channel.up("model", torch.zeros(10))
    assert channel.metrics() == {"bytes_down": 40, "bytes_up": 40}
    channel.up("cut", torch.zeros(5))
    channel.up("cut", torch.zeros(1))
    assert channel.metrics() == {"bytes_down": 40, "bytes_up": 64, "model_bytes_up": 40, "cut_bytes_up": 24}


def test_a_client_row_carries_the_channels_figures():
    channel = Channel()
    channel.down("model", torch.zeros(3))
    channel.up("prototypes", torch.zeros(2, 4))
    row = Uplink(7, 12, 0.5, metrics={"steps": 3}, channel=channel).row()
    assert row == {"loss": 0.5, "samples": 12, "bytes_down": 12, "bytes_up": 32, "steps": 3}


def test_an_unknown_direction_is_refused():
    with pytest.raises(ValueError, match="direction"):
        Channel().count("sideways", "model", 4)
