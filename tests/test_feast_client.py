"""FEAST's local co-training: passes, distillation, gradient accumulation, mixing, MAC accounting."""

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import Precision

from fl_lightning.config import LocalTrainConfig
from fl_lightning.data.base import ArrayDataset
from fl_lightning.elastic.envelope import route_envelope
from fl_lightning.elastic.layers.persistent_slices import PersistentSlices
from fl_lightning.elastic.models import build_model
from fl_lightning.elastic.models.ofa_resnet import OFASpec
from fl_lightning.runtime.client_data import ClientData
from fl_lightning.runtime.local_training import train_locally
from fl_lightning.modules.feast_client import RULES, FeastClient
from fl_lightning.modules.inplace_distillation import (OperatingPoint, Pass, SandwichSampler, kd_loss,
                                                       sandwich_step, soft_targets, student_loss)
from fl_lightning.modules.mixing import AlternatingMixer, NoMix, at_least_float32, soft_cross_entropy
from fl_lightning.elastic.models import OFAResNet
from hand_counts import hooked_macs

SHAPE = (3, 8, 8)
CLASSES = 4
E_MIN, E_MAX = (0.1,) * 4, (0.25,) * 4
# Increasing in MACs; stage 3's second block (stages.2.1) is used by the largest spec only.
SPECS = [OFASpec((0, 0, 0, 0), E_MIN, (0,) * 5),
         OFASpec((0, 1, 0, 0), E_MIN, (3,) * 5),
         OFASpec((1, 1, 0, 1), E_MAX, (6,) * 5),
         OFASpec((1, 1, 1, 1), E_MAX, (9,) * 5)]
MIN, MID1, MID2, MAX = SPECS



@pytest.fixture(scope="module")
def supernet():
    """FEAST's supernet (the default construction) narrowed: same search space, 1/16 width, at
    most one extra block per stage."""
    torch.manual_seed(0)
    return build_model(OFAResNet, CLASSES, SHAPE, width_scale=0.0625, max_extra_blocks=1, divisor=2)


@pytest.fixture(scope="module")
def macs(supernet):
    """Each spec's MACs in the paper's convention, counted by hooks on its extracted module."""
    values = {s: hooked_macs(supernet.extract(s).module, SHAPE)["paper"] for s in SPECS}
    assert [values[s] for s in SPECS] == sorted(values.values())
    return values


def make_client(supernet, macs, specs=SPECS, seed=0, **kwargs):
    routed = route_envelope(supernet, specs).module
    kwargs.setdefault("mixer", NoMix())
    return FeastClient(routed, lr=0.05, variants=[(s, macs[s]) for s in specs], global_min=specs[0],
                       generator=torch.Generator().manual_seed(seed), **kwargs)


def batch(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *SHAPE, generator=g), torch.randint(CLASSES, (n,), generator=g)


class Recorder:
    """Records the active spec and the input tensor of every forward of a model."""

    def __init__(self, model):
        self.specs, self.inputs = [], []
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.specs.append(module.active_spec)
        self.inputs.append(args[0])


def grads(model):
    return {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}


def assert_grads_close(got, want, keys=None):
    for k in keys or want:
        if want[k] is None:
            assert got[k] is None or torch.count_nonzero(got[k]) == 0, k
        else:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)


# -- losses ------------------------------------------------------------------------------------

def test_soft_cross_entropy_is_the_mixed_label_loss():
    z = torch.randn(5, CLASSES)
    ya, yb, lam = torch.tensor([0, 1, 2, 3, 0]), torch.tensor([3, 3, 1, 0, 0]), 0.3
    t = lam * F.one_hot(ya, CLASSES) + (1 - lam) * F.one_hot(yb, CLASSES)
    want = lam * F.cross_entropy(z, ya) + (1 - lam) * F.cross_entropy(z, yb)  # Eq. 20
    torch.testing.assert_close(soft_cross_entropy(z, t.float()), want)
    torch.testing.assert_close(soft_cross_entropy(z, ya), F.cross_entropy(z, ya))


def test_kd_and_student_losses():
    z_t = torch.randn(5, CLASSES, requires_grad=True)
    z_s = torch.randn(5, CLASSES)
    p = soft_targets(z_t)
    assert not p.requires_grad
    torch.testing.assert_close(p, torch.softmax(z_t.detach(), -1))
    want = -(p * torch.log_softmax(z_s, -1)).sum(-1).mean()  # Eq. 21
    torch.testing.assert_close(kd_loss(z_s, p), want)
    sup, kd = torch.tensor(2.0), torch.tensor(4.0)
    assert student_loss(sup, kd, 0.5) == 3.0 and student_loss(sup, kd, 0.25) == 2.5  # Eq. 23


def test_losses_are_computed_in_at_least_float32():
    """Half-precision logits are promoted before the softmax (the loss is the float32 one of the
    promoted logits, not the half-precision one), float64 stays float64, float32 is used as it
    is; the KD temperature still divides at T = 2."""
    g = torch.Generator().manual_seed(0)
    z, t = torch.randn(5, CLASSES, generator=g), torch.softmax(torch.randn(5, CLASSES, generator=g), -1)
    for dtype in (torch.bfloat16, torch.float16):
        half = z.to(dtype)
        want = -(t * F.log_softmax(half.float(), -1)).sum(-1).mean()
        got = soft_cross_entropy(half, t)
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert soft_targets(half).dtype == torch.float32
        assert torch.equal(soft_targets(half, 2.0), torch.softmax(half.float() / 2.0, -1))
    assert soft_cross_entropy(z.double(), t).dtype == torch.float64
    assert at_least_float32(z) is z
    torch.testing.assert_close(kd_loss(z, t, 2.0), 4.0 * -(t * F.log_softmax(z / 2.0, -1)).sum(-1).mean())


def test_kd_gradient_does_not_reach_the_teacher(supernet):
    """Backpropagating a student's loss alone leaves every parameter that only the teacher
    uses without gradient: the teacher's distribution is cut from the graph."""
    model = route_envelope(supernet, [MIN, MAX]).module
    x, y = batch()
    model.set_active(MAX)
    p_hat = soft_targets(model(x))
    model.zero_grad(set_to_none=True)
    model.set_active(MIN)
    z = model(x)
    student_loss(soft_cross_entropy(z, y), kd_loss(z, p_hat), 0.5).backward()
    teacher_only = [k for k, _ in model.named_parameters() if re.match(r"stages\.\d\.1\.", k)]  # extra blocks
    assert teacher_only
    for k, p in model.named_parameters():
        if k in teacher_only:
            assert p.grad is None, k
    assert model.stem.conv.weight.grad is not None


# -- the sampler -------------------------------------------------------------------------------

def test_intermediates_lie_strictly_between_and_are_resampled_per_batch():
    points = [OperatingPoint("min", 10), OperatingPoint("tie_min", 10), OperatingPoint("a", 20),
              OperatingPoint("b", 25), OperatingPoint("tie_max", 40), OperatingPoint("max", 40)]
    # Among equal costs the order given decides: the last of the most expensive is the largest.
    sampler = SandwichSampler([points[i] for i in (3, 4, 0, 5, 2, 1)], smallest="min")
    assert sampler.smallest.key == "min" and sampler.largest.key == "max"
    assert [p.key for p in sampler.pool] == ["a", "b"]
    draws = [sampler.sample(torch.Generator().manual_seed(3)) for _ in range(2)]
    assert draws[0] == draws[1]  # a function of the generator
    g = torch.Generator().manual_seed(3)
    keys = [sampler.sample(g).intermediates[0].key for _ in range(200)]
    assert set(keys) == {"a", "b"}
    assert 60 < keys.count("a") < 140  # uniform over the two
    g = torch.Generator().manual_seed(3)
    assert keys == [sampler.sample(g).intermediates[0].key for _ in range(200)]


def test_smallest_must_be_cheapest():
    with pytest.raises(ValueError, match="costs less"):
        SandwichSampler([OperatingPoint("a", 1), OperatingPoint("b", 2)], smallest="b")
    with pytest.raises(ValueError, match="not among"):
        SandwichSampler([OperatingPoint("a", 1)], smallest="z")


def test_student_before_teacher_is_refused():
    with pytest.raises(ValueError, match="before any teacher"):
        sandwich_step([Pass(OperatingPoint("a", 1), "student")], torch.zeros(1, 2), torch.zeros(1).long(),
                      activate=lambda k: None, forward=lambda x: x, backward=lambda l: None)


# -- the client's passes -----------------------------------------------------------------------

def test_client_intermediates(supernet, macs):
    client = make_client(supernet, macs)
    assert client.smallest == MIN and client.largest == MAX
    assert client.intermediates == [MID1, MID2]


def test_full_rule_trains_max_then_min_then_a_random_intermediate(supernet, macs):
    client = make_client(supernet, macs, seed=5)
    rec = Recorder(client.model)
    g = torch.Generator().manual_seed(5)
    expected = []
    for i in range(6):
        client.training_step(batch(seed=i), i)
        expected += [MAX, MIN, [MID1, MID2][int(torch.randint(2, (1,), generator=g))]]
        assert [p.role for p in client.last_step.passes] == ["teacher", "student", "student"]
    assert rec.specs == expected
    assert len({specs[2] for _, specs in client.schedule}) == 2  # resampled across batches
    assert client.model.active_spec == MAX  # left at the local maximum


def test_one_variant_trains_only_the_global_minimum(supernet, macs):
    client = make_client(supernet, macs, specs=[MIN])
    rec = Recorder(client.model)
    state = client.generator.get_state()
    client.training_step(batch(), 0)
    assert rec.specs == [MIN]
    assert [p.role for p in client.last_step.passes] == ["supervised"]
    assert torch.equal(client.generator.get_state(), state)


def test_two_variants_skip_the_random_pass(supernet, macs):
    client = make_client(supernet, macs, specs=[MIN, MID2])
    rec = Recorder(client.model)
    state = client.generator.get_state()
    client.training_step(batch(), 0)
    assert rec.specs == [MID2, MIN]
    assert [p.role for p in client.last_step.passes] == ["teacher", "student"]
    assert torch.equal(client.generator.get_state(), state)


@pytest.mark.parametrize("rule, specs, roles", [
    ("min_only", [MIN], ["supervised"]),
    ("max_only", [MAX], ["supervised"]),
    ("min_max", [MAX, MIN], ["supervised", "supervised"]),
    ("min_max_kd", [MAX, MIN], ["teacher", "student"]),
    ("full", [MAX, MIN, None], ["teacher", "student", "student"]),  # None: an intermediate
])
def test_ablation_rules(supernet, macs, rule, specs, roles):
    client = make_client(supernet, macs, rule=rule)
    rec = Recorder(client.model)
    x, y = batch()
    loss = client.training_step((x, y), 0)
    assert [p.role for p in client.last_step.passes] == roles
    assert len(rec.specs) == len(specs)
    for got, want in zip(rec.specs, specs):
        assert got == want if want is not None else got in (MID1, MID2)
    # The reported loss is the sum of the pass losses (Eq. 24); without KD each is plain CE.
    torch.testing.assert_close(loss, sum(p.loss for p in client.last_step.passes))
    if rule in ("min_only", "max_only", "min_max"):
        with torch.no_grad():
            want = 0.0
            for s in specs:
                client.model.set_active(s)
                want += F.cross_entropy(client.model(x), y)
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert set(RULES) == {"min_only", "max_only", "min_max", "min_max_kd", "full"}


def test_mixed_batch_is_shared_by_every_pass(supernet, macs):
    mixer = AlternatingMixer(CLASSES, generator=torch.Generator().manual_seed(0))
    client = make_client(supernet, macs, mixer=mixer)
    rec = Recorder(client.model)
    x, y = batch()
    original = x.clone()
    client.training_step((x, y), 0)
    assert len(rec.inputs) == 3 and all(t is rec.inputs[0] for t in rec.inputs)
    assert not torch.equal(rec.inputs[0], original)  # it was mixed
    assert torch.equal(x, original)  # the caller's batch was not


# -- gradients ---------------------------------------------------------------------------------

def test_gradients_accumulate_over_passes(supernet, macs):
    """One step's gradient is the sum of the gradients of L_max, L_min and L_rand computed
    separately, and the teacher-only parameters get the gradient of L_max alone."""
    client = make_client(supernet, macs, seed=11)
    model = client.model
    x, y = batch(n=8)
    mid = [MID1, MID2][int(torch.randint(2, (1,), generator=torch.Generator().manual_seed(11)))]
    client.training_step((x, y), 0)
    together = grads(model)

    def separate(spec, teacher_probs=None):
        model.zero_grad(set_to_none=True)
        model.set_active(spec)
        z = model(x)
        loss = F.cross_entropy(z, y)
        if teacher_probs is not None:
            loss = 0.5 * loss + 0.5 * -(teacher_probs * torch.log_softmax(z, -1)).sum(-1).mean()
        loss.backward()
        return grads(model), z.detach()

    g_max, z_max = separate(MAX)
    p_hat = torch.softmax(z_max, -1)
    g_min, _ = separate(MIN, p_hat)
    g_mid, _ = separate(mid, p_hat)
    zero = lambda g: torch.zeros(()) if g is None else g
    summed = {k: None if g_max[k] is None and g_min[k] is None and g_mid[k] is None
              else zero(g_max[k]) + zero(g_min[k]) + zero(g_mid[k]) for k in g_max}
    assert_grads_close(together, summed)
    teacher_only = [k for k in together if k.startswith("stages.2.1.")]
    assert teacher_only and all(together[k] is not None for k in teacher_only)
    assert_grads_close(together, g_max, teacher_only)


# -- compute accounting ------------------------------------------------------------------------

def test_forward_macs_follow_eq_26(supernet, macs):
    client = make_client(supernet, macs, seed=2)
    g = torch.Generator().manual_seed(2)
    want = 0
    for i, n in enumerate([4, 3, 5, 2]):
        client.training_step(batch(n=n, seed=i), i)
        mid = [MID1, MID2][int(torch.randint(2, (1,), generator=g))]
        want += n * (macs[MAX] + macs[MIN] + macs[mid])
    assert client.forward_macs() == want
    one = make_client(supernet, macs, specs=[MIN])
    two = make_client(supernet, macs, specs=[MIN, MID1], rule="min_max")
    for c in (one, two):
        c.training_step(batch(n=4), 0)
        c.training_step(batch(n=3), 1)
    assert one.forward_macs() == 7 * macs[MIN]
    assert two.forward_macs() == 7 * (macs[MIN] + macs[MID1])


# -- mixing ------------------------------------------------------------------------------------

def test_alternating_mixer_even_mixup_odd_cutmix():
    mixer = AlternatingMixer(6, schedule="alternate", generator=torch.Generator().manual_seed(0))
    x, y = torch.rand(6, 3, 8, 8), torch.arange(6)
    numpy_state = np.random.get_state()[1].copy()
    for idx in range(4):
        xm, t = mixer(x, y, idx)
        torch.testing.assert_close(t.sum(1), torch.ones(6))
        lam = t[0, 0]
        assert 0 < lam < 1 and torch.isclose(t[0, 5], 1 - lam)
        if idx % 2 == 0:  # Mixup: a convex combination of x and its flip
            torch.testing.assert_close(xm, lam * x + (1 - lam) * x.flip(0))
        else:  # CutMix: every pixel from one of the two, lam the share kept
            keep = (xm == x).all(1)
            assert torch.equal(keep | (xm == x.flip(0)).all(1), torch.ones_like(keep))
            assert torch.isclose(keep[0].float().mean(), lam)
    assert np.array_equal(np.random.get_state()[1], numpy_state)


def test_mixer_is_reproducible_and_handles_odd_batches():
    x, y = torch.rand(5, 3, 8, 8), torch.arange(5)
    runs = []
    for _ in range(2):
        mixer = AlternatingMixer(5, generator=torch.Generator().manual_seed(4))
        runs.append([mixer(x, y, i) for i in range(3)])
    for (xa, ta), (xb, tb) in zip(*runs):
        assert torch.equal(xa, xb) and torch.equal(ta, tb)
    xm, t = runs[0][0]
    assert torch.equal(xm[4], x[4]) and torch.equal(t[4], F.one_hot(torch.tensor(4), 5).float())
    assert not torch.equal(xm[:4], x[:4])
    xm, t = AlternatingMixer(5)(x[:1], y[:1])
    assert torch.equal(xm, x[:1]) and t.argmax(1).item() == 0


def test_random_schedule_uses_both_kinds():
    mixer = AlternatingMixer(4, generator=torch.Generator().manual_seed(0))
    x, y = torch.rand(4, 3, 8, 8), torch.arange(4)
    kinds = set()
    for i in range(20):
        xm, t = mixer(x, y, i)
        lam = t[0, 0]
        kinds.add("mixup" if torch.allclose(xm, lam * x + (1 - lam) * x.flip(0)) else "cutmix")
    assert kinds == {"mixup", "cutmix"}


# -- driven by the federation loop -------------------------------------------------------------

def separable_shard(n=64, seed=0):
    """Four classes, each a fixed random pattern plus noise: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(CLASSES, *SHAPE, generator=g)
    y = torch.arange(n) % CLASSES
    x = patterns[y] + 0.3 * torch.randn(n, *SHAPE, generator=g)
    return ClientData(ArrayDataset(x, y), torch.arange(n), batch_size=16)


def clean_losses(client, data):
    """Cross-entropy of the local maximum and the global minimum on the unmixed shard."""
    x, y = data.dataset.data, data.dataset.targets
    out = []
    with torch.no_grad():
        for spec in (MAX, MIN):
            client.model.set_active(spec)
            out.append(F.cross_entropy(client.model(x), y).item())
    client.model.set_active(MAX)
    return out


def test_train_client_with_fabric_backpropagates_every_pass(supernet, macs):
    """Local training hands the module ``fabric``; every pass is then backpropagated through the
    kept slices (Fabric's backward is autograd on the loss here), and a few rounds of local
    steps (FEAST's rule and mixing) reduce the loss."""
    fabric = Fabric(accelerator="cpu", devices=1)
    data = separable_shard()
    cfg = LocalTrainConfig(steps=6, batch_size=16, lr=0.05, momentum=0.9, grad_clip=10.0)
    client = make_client(supernet, macs, mixer=AlternatingMixer(CLASSES, generator=torch.Generator().manual_seed(0)))
    calls, through_fabric = [], []
    backward = PersistentSlices.backward
    fabric.backward = lambda loss, *a, **k: through_fabric.append(loss)
    client_backward = lambda slices, loss: (calls.append(loss.detach()), backward(slices, loss))
    before = clean_losses(client, data)
    losses = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PersistentSlices, "backward", client_backward)
        for r in range(3):
            result = train_locally(fabric, client, data, cfg, torch.Generator().manual_seed(r))
            losses.append(result.loss)
    assert client.fabric is None  # released after local training
    assert len(calls) == 3 * 6 * 3 and not through_fabric  # three passes per step
    assert max(losses[1:]) < losses[0]  # mean mixed-label training loss per round (noisy: mixing)
    after = clean_losses(client, data)
    assert after[0] < 0.5 * before[0] and after[1] < before[1]
    x, y = data.dataset.data, data.dataset.targets
    with torch.no_grad():
        client.model.set_active(MAX)
        assert (client.model(x).argmax(1) == y).float().mean() >= 0.9  # chance: 0.25
    assert client.forward_macs() == sum(n * sum(macs[s] for s in specs) for n, specs in client.schedule)


def test_a_precision_plugin_with_its_own_backward_keeps_fabric_backward(supernet, macs):
    """Where Fabric's backward is more than autograd on the loss (here a precision plugin that
    overrides it), the client slices afresh and every pass goes through ``fabric.backward``."""
    class OwnBackward(Precision):
        def backward(self, tensor, model, *args, **kwargs):
            tensor.backward(*args, **kwargs)

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[OwnBackward()])
    calls = []
    backward = fabric.backward
    fabric.backward = lambda loss, *a, **k: (calls.append(loss.detach()), backward(loss, *a, **k))
    client = make_client(supernet, macs)
    cfg = LocalTrainConfig(steps=2, batch_size=16, lr=0.05, momentum=0.9)
    train_locally(fabric, client, separable_shard(), cfg, torch.Generator().manual_seed(0))
    assert len(calls) == 3 * 2


def test_multi_tensor_sgd_takes_the_per_tensor_steps_bit_for_bit(supernet, macs):
    """FEAST's client updates every parameter in one multi-tensor SGD call; three steps with
    momentum and weight decay (the first creates the momentum buffers) leave every parameter
    as per-tensor SGD does. Plain SGD without momentum, the neighbouring update, ends elsewhere."""
    client = make_client(supernet, macs)
    foreach = client.configure_optimizers()
    assert foreach.defaults["foreach"] is True
    twin = make_client(supernet, macs)
    twin.load_state_dict(client.state_dict())
    per_tensor = torch.optim.SGD(twin.model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2, foreach=False)
    client.momentum, client.weight_decay = 0.9, 1e-2
    foreach = client.configure_optimizers()
    plain = make_client(supernet, macs)
    plain.load_state_dict(client.state_dict())
    no_momentum = torch.optim.SGD(plain.model.parameters(), lr=0.05, weight_decay=1e-2)
    for step in range(3):
        x, y = batch(seed=step)
        for module, optimizer in ((client, foreach), (twin, per_tensor), (plain, no_momentum)):
            optimizer.zero_grad(set_to_none=True)
            module.training_step((x, y), step)
            optimizer.step()
    state, twin_state = client.model.state_dict(), twin.model.state_dict()
    assert all(torch.equal(state[k], twin_state[k]) for k in state)
    assert not all(torch.equal(state[k], v) for k, v in plain.model.state_dict().items())


def test_trained_variants_are_those_of_the_schedule(supernet, macs):
    client = make_client(supernet, macs)
    for step in range(4):
        client.training_step(batch(seed=step), step)
    assert client.trained_variants() == {spec for _, specs in client.schedule for spec in specs}
    assert {MIN, MAX} <= client.trained_variants() <= set(SPECS)
