"""FedSGA's pieces on their own: prompts, harmonizer, descriptors, estimator labels, policy."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.algorithms.split.common import default_candidates
from fl_lightning.modules.harmonizer import InterfaceHarmonizer, pool_interface
from fl_lightning.modules.prompts import PromptChannel, border_order
from fl_lightning.modules.sufficiency import (DepthProbes, SufficiencyEstimator, handcrafted_score, prompt_variation,
                                              split_index, sufficiency_labels, temporal_stability)


# -- prompts ------------------------------------------------------------------------------------
def test_border_order_is_the_ring_clockwise():
    order = border_order(8, 6, 1)
    rows, cols = order // 6, order % 6
    assert len(order) == 8 * 6 - 6 * 4 and len(set(order.tolist())) == len(order)
    assert all(r in (0, 7) or c in (0, 5) for r, c in zip(rows.tolist(), cols.tolist()))
    # clockwise from the top-left corner: the top row left to right comes first
    assert order[:6].tolist() == list(range(6))
    with pytest.raises(ValueError):
        border_order(8, 8, 5)


def test_four_padding_tokens_are_the_four_sides():
    channel = PromptChannel(nn.Identity(), (3, 10, 10), num_tokens=4, band=1)
    tokens = channel.tokens(torch.arange(3 * 36, dtype=torch.float).view(3, 36))
    assert [t.shape[1] for t in tokens] == [9, 9, 9, 9]
    side = channel.order.split(9)
    rows = [set((s // 10).tolist()) for s in side]
    cols = [set((s % 10).tolist()) for s in side]
    assert rows[0] == {0} and cols[1] == {9} and rows[2] == {9} and cols[3] == {0}


def test_padding_prompt_touches_only_the_border_and_learns():
    front = nn.Conv2d(3, 2, 1)
    channel = PromptChannel(front, (3, 8, 8), num_tokens=4, band=2)
    prompt = torch.randn(channel.shape, requires_grad=True)
    x = torch.zeros(1, 3, 8, 8)
    shifted = channel.apply(nn.Identity(), prompt)(x)
    assert torch.count_nonzero(shifted[0, :, 2:6, 2:6]) == 0
    assert torch.count_nonzero(shifted[0, 0]) == 64 - 16
    channel.apply(front, prompt)(x).sum().backward()
    assert prompt.grad is not None and torch.count_nonzero(prompt.grad) > 0
    assert len(channel.token_norms(prompt.grad)) == 4


class _TokenFront(nn.Module):
    def forward(self, x, prompt_tokens=None):
        tokens = x.flatten(2).transpose(1, 2)
        return torch.cat([tokens[:, :1], prompt_tokens.expand(len(x), -1, -1), tokens[:, 1:]], dim=1)


def test_token_prompts_follow_the_front_that_takes_them():
    channel = PromptChannel(_TokenFront(), (5, 2, 2), num_tokens=3, band=1, token_dim=5)
    assert channel.token_prompts and channel.shape == (3, 5)
    out = channel.apply(_TokenFront(), torch.ones(3, 5))(torch.zeros(2, 5, 2, 2))
    assert out.shape == (2, 4 + 3, 5) and out[:, 1:4].eq(1).all()


# -- harmonizer ---------------------------------------------------------------------------------
def test_pooling_of_maps_and_tokens():
    z = torch.randn(2, 3, 4, 5)
    assert torch.allclose(pool_interface(z), z.mean(dim=(2, 3)))
    t = torch.randn(2, 7, 3)
    assert torch.allclose(pool_interface(t), t.mean(dim=1))


def test_depth_embedding_changes_the_projection():
    torch.manual_seed(0)
    h = InterfaceHarmonizer([8, 8, 8], num_classes=3, projection_dim=4)
    z = torch.randn(5, 8)
    assert not torch.allclose(h.project(z, 0), h.project(z, 2))
    with torch.no_grad():
        h.depth_embedding.weight[2].copy_(h.depth_embedding.weight[0])
    assert torch.allclose(h.project(z, 0), h.project(z, 2))


def test_narrow_interfaces_are_standardized_per_example_then_zero_padded():
    """Each example's pooled interface standardized over its own channels (biased variance,
    eps 1e-5), then zero-padded to the widest depth; the same in evaluation mode."""
    torch.manual_seed(0)
    h = InterfaceHarmonizer([2, 6], num_classes=3, projection_dim=4)
    z = torch.randn(4, 2, 3, 3) + 3.0
    pooled = pool_interface(z)
    mean = pooled.mean(1, keepdim=True)
    standard = (pooled - mean) / torch.sqrt(pooled.var(1, unbiased=False, keepdim=True) + 1e-5)
    wide = torch.cat([standard, torch.zeros(4, 4)], dim=1)
    embedding = h.depth_embedding.weight[0].expand(4, -1)
    expected = F.normalize(h.projector(torch.cat([wide, embedding], 1)), dim=1)
    # the same float32 operations up to the order of a few sums over 2-6 terms: a few ulps of
    # outputs of unit norm (~1e-7), inside 1e-6; batch statistics instead move them by ~1e-1
    assert torch.allclose(h.project(z, 0), expected, atol=1e-6)
    assert torch.allclose(h.eval().project(z, 0), expected, atol=1e-6)
    with pytest.raises(ValueError):
        h.project(torch.randn(4, 6), 0)


@pytest.mark.parametrize("head", [False, True])
def test_an_examples_harmonized_output_does_not_depend_on_its_batch(head):
    """One example's projection (and harmonized logits) alone, in a batch of its own class and
    in a batch of ten classes, in training and evaluation mode: equal in float64."""
    torch.manual_seed(3)
    h = InterfaceHarmonizer([8, 16], num_classes=10, projection_dim=6, head=head, head_bias=head).double()
    if head:
        nn.init.normal_(h.head.weight)
    example = torch.rand(1, 16, 4, 4, dtype=torch.float64) * 3
    same_class = torch.cat([example, example + 0.1 * torch.rand(7, 16, 4, 4, dtype=torch.float64)])
    ten_classes = torch.cat([example, torch.rand(9, 16, 4, 4, dtype=torch.float64) * torch.arange(
        1, 10, dtype=torch.float64)[:, None, None, None]])
    for mode in (True, False):
        h.train(mode)
        alone = h.project(example, 1)
        for batch in (same_class, ten_classes):
            assert torch.allclose(h.project(batch, 1)[:1], alone, rtol=0, atol=1e-12)
            if head:
                assert torch.allclose(h.head(h.project(batch, 1))[:1], h.head(alone), rtol=0, atol=1e-12)


def test_prototypes_aggregate_once_per_round_weighted_by_class_counts():
    """Two clients' batches with unequal class counts: the round's prototype of a class is the
    normalized mean of every projected feature of that class over both clients (the first
    round), then the EMA with the next round's mean; a class nobody sent keeps its prototype."""
    h = InterfaceHarmonizer([4], num_classes=3, projection_dim=2, tau=0.5, momentum=0.9).double()
    a = F.normalize(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 1.0]], dtype=torch.float64), dim=1)
    b = F.normalize(torch.tensor([[1.0, -1.0]], dtype=torch.float64), dim=1)
    sums_a, counts_a = h.class_sums(a, torch.tensor([0, 1, 0, 0]))
    sums_b, counts_b = h.class_sums(b, torch.tensor([0]))
    assert counts_a.tolist() == [3, 1, 0] and counts_b.tolist() == [1, 0, 0]
    h.update_prototypes(sums_a + sums_b, counts_a + counts_b)
    first0 = F.normalize((a[0] + a[2] + a[3] + b[0]) / 4, dim=0)  # 3 examples from one client, 1 from the other
    assert torch.allclose(h.prototypes[0], first0) and torch.allclose(h.prototypes[1], a[1])
    assert h.has_prototype.tolist() == [1, 1, 0]
    later = torch.tensor([[0.0, 1.0], [0.0, -1.0], [1.0, 0.0]], dtype=torch.float64)
    h.update_prototypes(*h.class_sums(later, torch.tensor([0, 0, 2])))
    assert torch.allclose(h.prototypes[0], F.normalize(0.9 * first0 + 0.1 * (later[0] + later[1]) / 2, dim=0))
    assert torch.allclose(h.prototypes[1], a[1]) and torch.allclose(h.prototypes[2], later[2])
    # the alignment loss reads only classes with a prototype
    fresh = InterfaceHarmonizer([4], num_classes=3, projection_dim=2).double()
    feats = F.normalize(torch.tensor([[0.3, 0.7]], dtype=torch.float64), dim=1).requires_grad_()
    assert fresh.alignment_loss(feats, torch.tensor([1])).detach().item() == 0.0  # the first round: no prototype yet
    h.prototypes[2] = 0.0
    h.has_prototype[2] = 0.0
    sims = torch.stack([feats[0] @ h.prototypes[0], feats[0] @ h.prototypes[1]]) / 0.5
    expected = -torch.log_softmax(sims, dim=0)[1]
    assert torch.allclose(h.alignment_loss(feats, torch.tensor([1])), expected)


def test_depth_probes_read_uniform_until_fitted_then_their_own_linear_classifier():
    torch.manual_seed(0)
    probes = DepthProbes({0: 3, 2: 5}, num_classes=4)
    x0, x2, y = torch.randn(40, 3), torch.randn(40, 5), torch.randint(0, 4, (40,))
    assert probes.loss(x0, y, 0) == pytest.approx(math.log(4))
    assert probes.true_class_probability(x2, y, 2) == pytest.approx(0.25)
    x0[:, 0] += 3 * y  # depth 0 separates the classes, depth 2 does not
    fit = probes.fit({0: x0, 2: x2}, y, steps=200, lr=0.05)
    for depth, x in ((0, x0), (2, x2)):
        head = probes.heads[str(depth)]
        expected = F.cross_entropy(x @ head.weight.t() + head.bias, y).detach()
        assert probes.loss(x, y, depth) == pytest.approx(float(expected), rel=1e-5)
        assert fit[f"probe{depth}_loss"] == pytest.approx(float(expected), rel=1e-5)
    assert probes.loss(x0, y, 0) < 0.5 * probes.loss(x2, y, 2)


# -- descriptors, labels, estimator, policy ------------------------------------------------------
def test_sufficiency_label_is_the_beta_rule():
    """beta = 0.05 against 1.0501 / 1.0: without the margin (or with beta applied to L(p1)
    instead of L(p_ref)) the first pair would be labelled insufficient."""
    p1 = torch.tensor([1.05, 1.0501, 0.5, 1.2, 1.1])
    ref = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    assert sufficiency_labels(p1, ref, 0.05).tolist() == [True, False, True, False, False]
    assert sufficiency_labels(p1, ref, 0.1).tolist() == [True, True, True, False, True]


def _toy_interfaces(generator, clients=20, per_client=32, classes=10, width=16, signal=3.0):
    """Probe interfaces of ``clients`` label-skewed clients (two classes each): class means
    ``signal`` apart along their own axis at the separable depth, pure noise at the other."""
    labels = torch.stack([torch.tensor([c % classes, (c + 1) % classes])[torch.randint(0, 2, (per_client,),
                                                                                        generator=generator)]
                          for c in range(clients)])
    noise = torch.randn(clients, per_client, width, generator=generator)
    separable = noise + signal * F.one_hot(labels, width).float()
    unrelated = torch.randn(clients, per_client, width, generator=generator)
    return separable, unrelated, labels


def test_held_out_probe_labels_beat_chance_on_a_separable_task_and_tell_the_depths_apart():
    """The calibration's probes are fit on the first half of each client's probe batch and
    scored on the second half. On interfaces that separate the classes the held-out loss falls
    well below chance (ln 10 = 2.303) and below the loss of the same probe on shuffled labels;
    where p1 separates and p_ref carries nothing every client is labelled sufficient, and in the
    mirrored case none is (a probe scored on its own training rows, or one fit on other data,
    cannot tell these apart as reliably)."""
    from fl_lightning.modules.sufficiency import held_out_losses

    g = torch.Generator().manual_seed(5)
    separable, unrelated, labels = _toy_interfaces(g)
    fit, held = slice(0, 16), slice(16, None)
    for shallow, deep, expect in ((separable, unrelated, True), (unrelated, separable, False)):
        probes = DepthProbes({0: 16, 1: 16}, num_classes=10)
        probes.fit({0: shallow[:, fit].flatten(0, 1), 1: deep[:, fit].flatten(0, 1)}, labels[:, fit].flatten())
        loss_p1 = held_out_losses(probes, 0, shallow[:, held], labels[:, held])
        loss_ref = held_out_losses(probes, 1, deep[:, held], labels[:, held])
        good = loss_p1 if expect else loss_ref
        assert good.shape == (20,) and float(good.max()) < 0.6 * math.log(10)
        shuffled = labels[:, held][:, torch.randperm(16, generator=g)].roll(1, dims=0)
        assert float(good.mean()) < float(held_out_losses(probes, 0 if expect else 1,
                                                          (shallow if expect else deep)[:, held], shuffled).mean())
        assert sufficiency_labels(loss_p1, loss_ref, 0.05).all() == expect
        assert (~sufficiency_labels(loss_p1, loss_ref, 0.05)).all() == (not expect)
    # each client's loss is its own rows' mean cross-entropy (an independent computation)
    head = probes.heads["1"]
    rows, y = separable[3, held], labels[3, held]
    expected = F.cross_entropy(rows @ head.weight.t() + head.bias, y).detach()
    assert float(held_out_losses(probes, 1, separable[:, held], labels[:, held])[3]) == pytest.approx(float(expected),
                                                                                                     rel=1e-5)


def test_prompt_variation_by_hand():
    before = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])]
    after = [torch.tensor([1.0, 1.0]), torch.tensor([0.0, 2.0])]
    grads = torch.tensor([1.0, 3.0])
    delta0 = 1.0 / (1.0 + math.sqrt(2.0))
    w0 = 1.0 / (1.0 + 9.0)  # g^(1/tau) with tau = 0.5 -> g^2
    assert prompt_variation(before, after, grads, tau=0.5) == pytest.approx(w0 * delta0)
    fresh = prompt_variation([torch.zeros(2)], [torch.ones(2)], torch.ones(1), tau=0.5)
    assert fresh == pytest.approx(1.0)


def test_prompt_variation_stays_in_the_unit_interval_for_fresh_tokens():
    # zero-initialised tokens give every delta exactly 1; uneven weights used to round the sum past 1
    generator = torch.Generator().manual_seed(0)
    for n in (3, 5, 7, 12, 24):
        for _ in range(50):
            grads = torch.rand(n, generator=generator) * 5
            after = [torch.randn(8, generator=generator) for _ in range(n)]
            value = prompt_variation([torch.zeros(8)] * n, after, grads, tau=0.5)
            assert 0.0 <= value <= 1.0 and value == pytest.approx(1.0, abs=1e-9)


def test_temporal_stability():
    a = torch.randn(4, 3)
    assert temporal_stability(a, None) == 0.0
    assert temporal_stability(a, 2 * a) == pytest.approx(1.0, abs=1e-6)
    assert temporal_stability(a, -a) == pytest.approx(-1.0, abs=1e-6)


def test_policy_is_monotone_and_respects_budgets():
    rs = [i / 50 for i in range(51)]
    for rho in (0.0, 0.1, 0.5):
        ks = [split_index(r, 4, rho) for r in rs]
        assert ks == sorted(ks, reverse=True) and ks[0] == 3 and set(ks) <= {0, 1, 2, 3}
    for r in rs:
        assert split_index(r, 4, 0.1) <= split_index(r, 4, 0.3)
        assert split_index(r, 4, 0.1, deepest_affordable=1) <= 1
    # rho = 0.1, K = 3: the shallowest needs r > 0.85, the middle r > 0.35
    assert split_index(0.86, 3, 0.1) == 0 and split_index(0.84, 3, 0.1) == 1
    assert split_index(0.36, 3, 0.1) == 1 and split_index(0.34, 3, 0.1) == 2


def test_handcrafted_score_range():
    assert handcrafted_score(torch.tensor([1.0, 1.0, 0.0])) == pytest.approx(1.0)
    assert handcrafted_score(torch.tensor([0.0, -1.0, 1.0])) == pytest.approx(0.0)


def test_estimator_learns_a_separable_labelling():
    torch.manual_seed(0)
    x = torch.rand(64, 3)
    y = (x[:, 0] > 0.5).float()
    gamma = SufficiencyEstimator()
    assert not gamma.trained.item()
    fit = gamma.fit(x, y, steps=300, lr=0.05)
    assert fit["accuracy"] >= 0.9 and gamma.trained.item()
    assert gamma.probability(torch.tensor([0.9, 0.5, 0.5])) > 0.5 > gamma.probability(torch.tensor([0.1, 0.5, 0.5]))


def test_default_candidates():
    resnet = ["stem"] + [f"layer{s}.{i}" for s in range(1, 5) for i in range(2)]
    assert default_candidates(resnet) == ["layer1.1", "layer2.1", "layer3.1"]
    vit = [f"block{i}" for i in range(12)]
    assert default_candidates(vit) == ["block2", "block5", "block8"]
    assert default_candidates([f"block{i}" for i in range(4)]) == ["block0", "block1", "block2"]
