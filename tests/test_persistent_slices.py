"""FEAST's client keeps its passes' weight slices across steps: the same training, bit for bit,
as slicing afresh in every pass, without the slices' operations in a step."""

import copy

import pytest
import torch
from torch import nn
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision

from fl_lightning.config import LocalTrainConfig
from fl_lightning.elastic.layers.leading import leading
from fl_lightning.elastic.layers.persistent_slices import PersistentSlices
from fl_lightning.elastic.models.ofa_resnet import OFASpec
from fl_lightning.modules.feast_client import FeastClient
from fl_lightning.modules.mixing import AlternatingMixer
from fl_lightning.runtime.local_training import train_locally
from hand_counts import hooked_macs
from test_dispatch import Ops
from test_feast_client import CLASSES, E_MIN, MID1, MID2, MIN, SHAPE, batch, macs, make_client, separable_shard, supernet  # noqa: F401

# An intermediate that uses stage 3's second block, which the local maximum MID2 leaves out: in
# the steps that draw MID1 instead, no pass reaches that block's parameters.
OFF_MAX = OFASpec((0, 0, 1, 0), E_MIN, (0,) * 5)
VARIANTS = [MIN, MID1, OFF_MAX, MID2]
SLICING = {"slice", "as_strided", "slice_backward"}


@pytest.fixture(scope="module")
def all_macs(supernet, macs):
    return {**macs, OFF_MAX: hooked_macs(supernet.extract(OFF_MAX).module, SHAPE)["paper"]}


def client_on_the_supernet(supernet, all_macs, kept=True, **kwargs):
    """A FEAST client on the whole supernet (not the envelope of its variants), so that some
    parameters are outside its local maximum; ``kept=False`` slices afresh in every pass."""
    client = FeastClient(copy.deepcopy(supernet), lr=0.05, momentum=0.9, weight_decay=5e-3,
                         variants=[(s, all_macs[s]) for s in VARIANTS], global_min=MIN,
                         generator=torch.Generator().manual_seed(3), **kwargs)
    if not kept:
        client.on_train_start = lambda: None
    return client


def train(client, rounds=2, steps=5, fabric=None):
    fabric = fabric or Fabric(accelerator="cpu", devices=1)
    cfg = LocalTrainConfig(steps=steps, batch_size=16, lr=0.05, momentum=0.9, weight_decay=5e-3, grad_clip=1.0)
    for r in range(rounds):
        train_locally(fabric, client, separable_shard(), cfg, torch.Generator().manual_seed(r))
    return client.model.state_dict()


def mixer():
    return AlternatingMixer(CLASSES, generator=torch.Generator().manual_seed(0))


def test_kept_slices_train_bit_for_bit_as_fresh_ones(supernet, all_macs, monkeypatch):
    """Two rounds of five steps with momentum, weight decay, clipping and Mixup/CutMix: every
    parameter, running statistic and batch counter equals the fresh-slice run's. The block only
    OFF_MAX uses is trained in some steps and skipped by SGD in the others (no gradient, so
    neither decay nor momentum moves it), as with gradients allocated afresh per step."""
    handed_out = []
    slice_ = PersistentSlices.slice
    monkeypatch.setattr(PersistentSlices, "slice", lambda self, *a: handed_out.append(a) or slice_(self, *a))
    kept = client_on_the_supernet(supernet, all_macs, mixer=mixer())
    fresh = client_on_the_supernet(supernet, all_macs, kept=False, mixer=mixer())
    got = train(kept)
    assert handed_out and kept._slices is None  # the loop opened and closed the kept slices
    calls = len(handed_out)
    want = train(fresh)
    assert len(handed_out) == calls
    intermediates = [specs[2] for _, specs in kept.schedule]
    assert MID1 in intermediates and OFF_MAX in intermediates  # both kinds of step were taken
    assert kept.schedule == fresh.schedule
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    start = supernet.state_dict()
    assert not torch.equal(got["stages.2.1.conv1.weight"], start["stages.2.1.conv1.weight"])  # trained


def test_kept_zero_gradients_would_decay_the_untrained_block(supernet, all_macs, monkeypatch):
    """The neighbouring rule, gradients zeroed in place but never dropped, lets weight decay and
    momentum move the block in steps that did not train it: the run then ends elsewhere."""
    monkeypatch.setattr(PersistentSlices, "_drop_unreached", lambda self: None)
    kept = client_on_the_supernet(supernet, all_macs, mixer=mixer())
    fresh = client_on_the_supernet(supernet, all_macs, kept=False, mixer=mixer())
    got, want = train(kept), train(fresh)
    assert not torch.equal(got["stages.2.1.conv1.weight"], want["stages.2.1.conv1.weight"])


def test_a_step_after_the_first_makes_no_slice(supernet, macs):
    """With one intermediate the passes' slices repeat: from the second step on a step
    dispatches no slice, view or zero-padded slice gradient, and adds the batch counters in at
    most one operation per pass count; slicing afresh makes them in every pass."""
    counts = {}
    for kept in (True, False):
        client = make_client(supernet, macs, specs=[MIN, MID1, MID2])
        optimizer = client.configure_optimizers()
        if kept:
            client.on_train_start()
        for step in range(3):
            client.optimizer_zero_grad(0, step, optimizer)
            with Ops() as ops:
                client.training_step(batch(seed=step), step)
            optimizer.step()
        client.on_train_end()
        counts[kept] = ops.names
    assert not SLICING & set(counts[True])
    assert counts[False].count("slice_backward") > 0 and len(counts[True]) < len(counts[False])
    # Gradients: per pass one multi-tensor addition for the dense kept gradients and one for
    # the strided slices (3 passes x 2), never one per tensor as autograd's accumulation makes
    # them; counters: at most one addition per pass count (3).
    assert counts[True].count("add_") == 0 and counts[False].count("add_") > 0
    assert 3 <= counts[True].count("_foreach_add_") <= 3 * 2 + 3


def test_kept_slices_backpropagate_the_scaled_loss_under_float16(supernet, all_macs):
    """Under float16 mixed precision Fabric's gradient scaler multiplies the loss before
    backward and its optimizer step divides the gradients again: the kept slices' own backward
    scales as Fabric's does, so the run equals the fresh-slice run bit for bit. Without the
    scale (the neighbouring mistake) the gradients are divided without having been multiplied
    and the run ends elsewhere."""
    def fabric():
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        scaler.scale(torch.ones(()))  # the scale exists before any loss is scaled
        return Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])

    kept = client_on_the_supernet(supernet, all_macs)
    fresh = client_on_the_supernet(supernet, all_macs, kept=False)
    got, want = train(kept, rounds=1, fabric=fabric()), train(fresh, rounds=1, fabric=fabric())
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    unscaled = client_on_the_supernet(supernet, all_macs)
    unscaled._scaled = lambda loss: loss
    wrong = train(unscaled, rounds=1, fabric=fabric())
    assert not torch.equal(wrong["stages.0.0.conv1.weight"], want["stages.0.0.conv1.weight"])


def test_kept_slices_train_bit_for_bit_as_fresh_ones_under_bfloat16(supernet, all_macs):
    """Under bfloat16 autocast the kept slices' gradients are the float32 parameters' own, as
    autograd's accumulation makes them: one round equals the fresh-slice run bit for bit."""
    def fabric():
        return Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")

    kept = client_on_the_supernet(supernet, all_macs, mixer=mixer())
    fresh = client_on_the_supernet(supernet, all_macs, kept=False, mixer=mixer())
    got, want = train(kept, rounds=1, fabric=fabric()), train(fresh, rounds=1, fabric=fabric())
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


class _Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))


def _three_reaches(weight, x):
    """A loss that reaches ``weight`` whole, at 2 rows and at 1 row, with other gradients each."""
    whole, two, one = leading(weight, 4, 3), leading(weight, 2, 3), leading(weight, 1, 3)
    return (x @ whole.T).sum() + (x @ two.T).pow(2).sum() + (x @ one.T).pow(3).sum()


def test_a_parameter_reached_several_times_in_one_pass(monkeypatch):
    """A pass that reaches one parameter whole and at two partial widths: its gradient is the
    sum of the three (autograd's, in float64 up to rounding), added by three multi-tensor calls
    none of which adds into overlapping memory (a GPU's multi-tensor kernel would race)."""
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reference = _Shared()
    _three_reaches(reference.weight, x).backward()

    model = _Shared()
    slices = PersistentSlices(model)
    calls = []
    foreach_add_ = torch._foreach_add_

    def spy(sinks, addends, *args, **kwargs):
        if isinstance(addends, (list, tuple)):
            calls.append([sink.untyped_storage().data_ptr() for sink in sinks])
        return foreach_add_(sinks, addends, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_add_", spy)
    with slices.step():
        slices.backward(_three_reaches(model.weight, x))
    slices.close()
    torch.testing.assert_close(model.weight.grad, reference.weight.grad, rtol=1e-12, atol=1e-12)
    assert len(calls) == 3 and all(len(set(storages)) == len(storages) for storages in calls)
