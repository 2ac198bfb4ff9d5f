"""The split-learning backbones: split halves at every block boundary, the state-dict keys each
half owns, ViT prompt tokens, ResNet-18 stems and pretrained weights from local files."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.elastic.models import CNN, CharLSTM, OFAResNet, ResNet18, ViT, build_model
from fl_lightning.elastic.models.vit import insert_prompts
from fl_lightning.elastic.specs import WidthSpec
from fl_lightning.elastic.split import split_keys
from fl_lightning.errors import ConfigError

# The split and the unsplit model run the same operations; in float64 any difference in the
# order of a sum stays near 1e-16 relative, far inside these bounds on any CPU.
ATOL, RTOL = 1e-10, 1e-9


def _resnet(stem: str = "cifar", side: int = 32, **kwargs) -> ResNet18:
    torch.manual_seed(0)
    return build_model(ResNet18, 10, (3, side, side), width=0.25, stem=stem, **kwargs)


def _vit(**kwargs):
    torch.manual_seed(0)
    return build_model(ViT, 10, (3, 32, 32), embed_dim=32, depth=3, num_heads=2, patch_size=4, **kwargs)


CASES = {
    "resnet18": lambda: (_resnet(), 32),
    "resnet18_tiny": lambda: (_resnet("tiny", 64), 64),
    "vit": lambda: (_vit(), 32),
}


# -- split halves ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_split_at_every_cut_equals_unsplit_forward_and_backward(case):
    # Train mode: batch norm normalises with the batch's statistics, which the split and the
    # unsplit model compute from the same batch; the ViT has no dropout at these settings.
    model, side = CASES[case]()
    model.double().train()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 3, side, side, dtype=torch.float64), torch.arange(4)
    expected = reference(x)
    F.cross_entropy(expected, y).backward()
    expected_grads = {name: p.grad for name, p in reference.named_parameters()}

    for cut in model.block_names:
        model.zero_grad(set_to_none=True)
        front, back = model.split(cut)
        z = front(x)
        zs = z.detach().requires_grad_()  # the real boundary: activation up, its gradient down
        logits = back(zs)
        F.cross_entropy(logits, y).backward()
        z.backward(zs.grad)
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)
        for name, p in model.named_parameters():
            assert p.grad is not None, f"{cut}: no gradient for {name}"
            torch.testing.assert_close(p.grad, expected_grads[name], atol=ATOL, rtol=RTOL,
                                       msg=lambda m, name=name: f"cut {cut}, {name}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_split_halves_share_the_models_tensors(case):
    model, side = CASES[case]()
    model.eval()
    x = torch.randn(2, 3, side, side)
    for cut in model.block_names:
        front, back = model.split(cut)
        torch.testing.assert_close(front(x), model.forward_until(x, cut))
        torch.testing.assert_close(back(front(x)), model.forward_from(model.forward_until(x, cut), cut))
        model_tensors = {id(t) for t in list(model.parameters()) + list(model.buffers())}
        for half in (front, back):
            assert {id(t) for t in list(half.parameters()) + list(half.buffers())} <= model_tensors


@pytest.mark.parametrize("case", CASES)
def test_split_keys_partition_the_state_dict_and_grow_with_the_cut(case):
    model, _ = CASES[case]()
    state = model.state_dict(keep_vars=True)
    previous = None
    for cut in model.block_names:
        front_keys, back_keys = split_keys(model, cut)
        assert not set(front_keys) & set(back_keys)
        assert set(front_keys) | set(back_keys) == set(state)
        front, back = model.split(cut)
        # the keys name exactly the halves' parameters
        assert {id(p) for p in back.parameters()} == {id(state[k]) for k in back_keys
                                                       if isinstance(state[k], nn.Parameter)}
        if previous is not None:
            assert set(previous) < set(front_keys)  # a deeper cut gives the client strictly more
        previous = front_keys
    assert any(k.endswith(("fc.weight", "head.weight")) for k in back_keys)


def test_cnn_and_ofa_supernet_split_by_the_default():
    from fl_lightning.elastic.models.ofa_resnet import OFASpec

    torch.manual_seed(0)
    cnn = build_model(CNN, 10, (3, 12, 12), channels=(8, 8, 8)).eval()
    ofa = build_model(OFAResNet, 10, (3, 16, 16), width_scale=0.125, max_extra_blocks=1, divisor=2).eval()
    for model, x in ((cnn, torch.randn(2, 3, 12, 12)), (ofa, torch.randn(2, 3, 16, 16))):
        for cut in model.block_names:
            front, back = model.split(cut)
            torch.testing.assert_close(back(front(x)), model(x), atol=1e-5, rtol=0)
            split_keys(model, cut)
    # a supernet at a smaller depth leaves its inactive blocks in neither half; its elastic
    # extraction (the client's reduced supernet) holds only the active ones and splits cleanly
    spec = OFASpec((1, 0, 0, 1), (0.25,) * 4, (6, 9, 4, 7, 5))
    ofa.set_active(spec)
    with pytest.raises(RuntimeError, match="stages.1.1.conv1.weight is in neither half"):
        split_keys(ofa, "stages.1.0")
    local = ofa.extract(spec, elastic=True).module
    front_keys, back_keys = split_keys(local, "stages.1.0")
    assert "stages.1.0.conv1.weight" in front_keys and "classifier.weight" in back_keys


def test_split_keys_names_a_tensor_in_neither_or_both_halves():
    model = build_model(CNN, 10, (3, 12, 12), channels=(8, 8, 8))
    front, back = model.split("block0")
    model.split = lambda cut: (front, nn.Module())
    with pytest.raises(RuntimeError, match="features.block1.conv.weight is in neither half"):
        split_keys(model, "block0")
    model.split = lambda cut: (front, nn.ModuleList([front, back]))
    with pytest.raises(RuntimeError, match="features.block0.conv.weight is in both halves"):
        split_keys(model, "block0")


def test_default_split_needs_module_blocks_and_known_cuts():
    lstm = build_model(CharLSTM, 30, (12,), hidden_size=8)
    with pytest.raises(TypeError, match="'lstm' is not an nn.Module"):
        lstm.split("embed")
    with pytest.raises(KeyError):
        _resnet().split("layer9.0")


def test_vit_split_accepts_block_names_and_counts():
    model = _vit().eval()
    x = torch.randn(2, 3, 32, 32)
    for k, name in enumerate(model.block_names, start=1):
        by_name, by_count = model.split(name), model.split(k)
        assert len(by_name[0].blocks) == len(by_count[0].blocks) == k
        torch.testing.assert_close(by_name[0](x), model.forward_until(x, name))


# -- ViT prompt tokens -------------------------------------------------------------------------

def test_insert_prompts_goes_right_after_the_class_token():
    tokens, prompts = torch.randn(2, 5, 8), torch.randn(1, 3, 8)
    out = insert_prompts(tokens, prompts)
    assert out.shape == (2, 8, 8)
    torch.testing.assert_close(out[:, 0], tokens[:, 0])
    torch.testing.assert_close(out[:, 1:4], prompts.expand(2, -1, -1))
    torch.testing.assert_close(out[:, 4:], tokens[:, 1:])
    torch.testing.assert_close(insert_prompts(tokens, prompts.expand(2, -1, -1)), out)  # per-sample prompts
    with pytest.raises(ValueError):
        insert_prompts(tokens, torch.randn(1, 3, 7))
    with pytest.raises(ValueError):
        insert_prompts(tokens, torch.randn(3, 8))


@pytest.mark.parametrize("global_pool", ["token", "avg"])
def test_vit_prompt_tokens_reach_the_server_and_get_gradients(global_pool):
    model = _vit(global_pool=global_pool).eval()
    x, m = torch.randn(2, 3, 32, 32), 5
    n = 1 + (32 // 4) ** 2  # class token + patches
    for cut in model.block_names:
        client, server = model.split(cut)
        seen = []
        handle = server.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
        prompts = torch.randn(1, m, 32, requires_grad=True)
        h = client(x, prompt_tokens=prompts)
        assert h.shape == (2, n + m, 32)
        logits = server(h)
        assert seen == [n + m] and logits.shape == (2, 10)  # the sequence the server half runs on
        logits.sum().backward()
        assert prompts.grad is not None and prompts.grad.abs().sum() > 0
        with torch.no_grad():
            other = server(client(x, prompt_tokens=torch.randn(1, m, 32)))
            plain = server(client(x))
        assert not torch.allclose(logits, other) and not torch.allclose(logits, plain)
        torch.testing.assert_close(plain, model(x))
        handle.remove()


# -- ResNet-18 stems ---------------------------------------------------------------------------

@pytest.mark.parametrize("stem, side, after_stem", [("cifar", 32, 32), ("tiny", 64, 32), ("imagenet", 64, 16)])
def test_stem_output_size_and_reduced_width_extraction(stem, side, after_stem):
    model = _resnet(stem, side).eval()
    x = torch.randn(2, 3, side, side)
    assert model.stem(x).shape == (2, 16, after_stem, after_stem)
    spec = WidthSpec((0.5, 0.25, 0.5, 0.25))
    model.set_active(spec)
    expected = model(x)
    for elastic in (False, True):
        routed = model.extract(spec, elastic=elastic)
        assert routed.module.stem_kind == stem
        assert routed.module.stem.conv.weight.shape[-1] == (7 if stem == "imagenet" else 3)
        torch.testing.assert_close(routed.module(x), expected, atol=1e-5, rtol=0)
    model.set_active(model.max_spec())


def test_bad_stem_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        build_model(ResNet18, 10, (3, 32, 32), stem="huge")
    assert err.value.key == "model.stem" and "cifar" in str(err.value)
    with pytest.raises(ConfigError):
        ResNet18(10, (3, 32, 32), stem="Tiny")


# -- pretrained weights ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torchvision_file(tmp_path_factory):
    import torchvision  # a dependency (timm needs it too)

    torch.manual_seed(1)
    source = torchvision.models.resnet18(num_classes=1000)
    path = tmp_path_factory.mktemp("weights") / "resnet18.pth"
    torch.save(source.state_dict(), path)
    return path, source.state_dict()


def _load_warning(build):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build()
    messages = [str(w.message) for w in caught if "pretrained" in str(w.message)]
    assert len(messages) == 1 and "\n" not in messages[0]
    return model, messages[0]


def test_resnet_loads_torchvision_weights_and_skips_what_does_not_fit(torchvision_file):
    path, source = torchvision_file
    model, message = _load_warning(lambda: ResNet18(10, (3, 64, 64), stem="imagenet", pretrained=str(path)))
    state = model.state_dict()
    assert torch.equal(state["stem.conv.weight"], source["conv1.weight"])
    assert torch.equal(state["layer1.0.conv1.weight"], source["layer1.0.conv1.weight"])
    assert torch.equal(state["layer3.0.shortcut.0.weight"], source["layer3.0.downsample.0.weight"])
    assert torch.equal(state["layer4.1.bn2.running_var"], source["layer4.1.bn2.running_var"])
    assert "fc.weight" in message and "fc.bias" in message and "stem.conv.weight" not in message
    assert state["fc.weight"].shape == (10, 512)

    cifar, message = _load_warning(lambda: ResNet18(10, (3, 32, 32), stem="cifar", pretrained=str(path)))
    assert "stem.conv.weight" in message and "fc.weight" in message
    assert torch.equal(cifar.state_dict()["layer2.1.conv2.weight"], source["layer2.1.conv2.weight"])
    assert torch.equal(cifar.state_dict()["stem.bn.running_mean"], source["bn1.running_mean"])


def test_resnet_pretrained_survives_build_local_without_reloading(torchvision_file, tmp_path):
    path, source = torchvision_file
    copy_path = tmp_path / "copy.pth"
    copy_path.write_bytes(path.read_bytes())
    model, _ = _load_warning(lambda: build_model(ResNet18, 10, (3, 32, 32), pretrained=str(copy_path)))
    copy_path.unlink()  # a local copy must not read the file again
    routed = model.extract(WidthSpec.uniform(0.5, 4))
    torch.testing.assert_close(routed.module.layer1[0].conv1.weight, source["layer1.0.conv1.weight"][:32, :32])


def test_pretrained_file_problems_are_config_errors(tmp_path):
    not_a_dict, text, foreign = tmp_path / "list.pth", tmp_path / "notes.txt", tmp_path / "foreign.pth"
    torch.save([torch.zeros(2)], not_a_dict)
    text.write_text("not weights\n")
    torch.save({"encoder.weight": torch.zeros(2)}, foreign)
    for path in (tmp_path / "missing.pth", not_a_dict, text, foreign):
        with pytest.raises(ConfigError) as err:
            ResNet18(10, (3, 32, 32), width=0.25, pretrained=str(path))
        assert err.value.key == "model.pretrained" and "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        _vit(pretrained=str(tmp_path / "missing.pth"))
    assert err.value.key == "model.pretrained"


def test_vit_loads_timm_weights_with_resized_position_embedding(tmp_path):
    from timm.layers import resample_abs_pos_embed
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(2)
    source = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=3, num_heads=2, num_classes=7)
    path = tmp_path / "vit.pth"
    torch.save({"state_dict": source.state_dict()}, path)
    model, message = _load_warning(lambda: _vit(pretrained=str(path)))
    assert "head.weight" in message and "head.bias" in message
    assert model.vit.pos_embed.shape == (1, 1 + 64, 32) and source.pos_embed.shape == (1, 1 + 16, 32)
    torch.testing.assert_close(model.vit.pos_embed, resample_abs_pos_embed(
        source.pos_embed, new_size=(8, 8), old_size=(4, 4), num_prefix_tokens=1))
    for key, value in source.blocks.state_dict().items():
        assert torch.equal(model.vit.blocks.state_dict()[key], value), key
    assert torch.equal(model.vit.cls_token, source.cls_token)
    assert model.vit.head.weight.shape == (10, 32)

    # same class count: the head loads too and nothing is reported
    same = VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=3, num_heads=2, num_classes=10)
    torch.save(same.state_dict(), path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = _vit(pretrained=str(path))
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(loaded.eval()(x), same.eval()(x))
    path.unlink()  # build_local rebuilds the architecture only; weights come by routing
    torch.testing.assert_close(loaded.extract(loaded.max_spec()).module(x), same(x))


def test_vit_refuses_another_architecture(tmp_path):
    import numpy as np
    from timm.models.vision_transformer import VisionTransformer

    wider = tmp_path / "wider.pth"
    torch.save(VisionTransformer(img_size=32, patch_size=4, embed_dim=48, depth=3, num_heads=2).state_dict(), wider)
    deeper = tmp_path / "deeper.pth"
    torch.save(VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=4, num_heads=2).state_dict(), deeper)
    npz = tmp_path / "other.npz"
    np.savez(npz, something=np.zeros(3))
    for path in (wider, deeper, npz):
        with pytest.raises(ConfigError) as err:
            _vit(pretrained=str(path))
        assert err.value.key == "model.pretrained" and "\n" not in str(err.value)
