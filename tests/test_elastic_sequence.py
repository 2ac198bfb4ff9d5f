"""Elastic sequence layers, the Shakespeare LSTM and the split ViT."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fl_lightning.elastic.layers.sequence import (
    ElasticAttention,
    ElasticEmbedding,
    ElasticLayerNorm,
    ElasticLSTM,
    ElasticMlp,
    ElasticTransformerBlock,
    GateBlockSlice,
)
from fl_lightning.elastic.routing import load_routed_state, write_back
from fl_lightning.elastic.models import CharLSTM, ViT

ATOL = 1e-5


@pytest.fixture(autouse=True)
def _seed_and_one_thread():
    # tiny tensors: intra-op threads only add synchronisation, badly so on a busy machine
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _assert_regions_match(module: nn.Module, regions: dict) -> None:
    """Every local state key has a region whose local shape is the tensor's shape."""
    state = module.state_dict()
    assert set(state) == set(regions)
    for key, region in regions.items():
        assert tuple(state[key].shape) == tuple(region.local_shape), key


def _as_routing(regions: dict) -> dict:
    """Layer regions (same names locally and globally) as a routing map."""
    return {key: (key, region) for key, region in regions.items()}


# --------------------------------------------------------------------------- GateBlockSlice


def test_gate_block_slice_takes_leading_rows_of_every_block():
    full = torch.arange(4 * 5 * 3, dtype=torch.float).reshape(20, 3)
    region = GateBlockSlice(full.shape, (8, 2))
    local = region.gather(full)
    expected = torch.cat([full[g * 5:g * 5 + 2, :2] for g in range(4)])
    assert torch.equal(local, expected)
    assert region.numel() == 16
    assert local.data_ptr() != full.data_ptr()


def test_gate_block_slice_scatter_and_accumulate():
    full = torch.zeros(12, 4)
    region = GateBlockSlice(full.shape, (6, 3), num_blocks=3)
    region.scatter(full, torch.ones(6, 3))
    region.scatter_add(full, torch.ones(6, 3), alpha=2.0)
    region.fill_add(full, 1.0)
    covered = torch.zeros(12, 4, dtype=torch.bool)
    for g in range(3):
        covered[g * 4:g * 4 + 2, :3] = True
    assert torch.all(full[covered] == 4.0)
    assert torch.all(full[~covered] == 0.0)
    assert int(covered.sum()) == region.numel()


def test_gate_block_slice_rejects_bad_shapes():
    with pytest.raises(ValueError):
        GateBlockSlice((20, 3), (6, 3))  # 6 rows are not 4 equal blocks
    with pytest.raises(ValueError):
        GateBlockSlice((20, 3), (24, 3))


def test_gate_block_slices_are_nested():
    shape = (4 * 16, 16)
    small, large = GateBlockSlice(shape, (4 * 4, 4)), GateBlockSlice(shape, (4 * 12, 12))
    assert large.contains(small) and not small.contains(large)
    in_small, in_large = torch.zeros(shape), torch.zeros(shape)
    small.fill_add(in_small, 1.0)
    large.fill_add(in_large, 1.0)
    # every position the small slice covers is also covered by the large one
    assert torch.all(in_small <= in_large)
    assert int(in_small.sum()) == small.numel() and int(in_large.sum()) == large.numel()


# --------------------------------------------------------------------------- LSTM


def test_lstm_slice_keeps_gate_layout():
    lstm = ElasticLSTM(8, 16, num_layers=2, batch_first=True)
    small = lstm.extract(6)
    for layer in range(2):
        for name in (f"weight_ih_l{layer}", f"weight_hh_l{layer}", f"bias_ih_l{layer}", f"bias_hh_l{layer}"):
            full, local = getattr(lstm, name), getattr(small, name)
            cols = local.shape[1] if local.dim() == 2 else None
            for gate in range(4):
                want = full[gate * 16:gate * 16 + 6]
                if cols is not None:
                    want = want[:, :cols]
                assert torch.equal(local[gate * 6:(gate + 1) * 6], want), (name, gate)


@pytest.mark.parametrize("hidden", [4, 9, 16])
def test_lstm_physical_equals_elastic(hidden):
    lstm = ElasticLSTM(8, 16, num_layers=2, batch_first=True)
    x = torch.randn(3, 7, 8)
    lstm.active_hidden = hidden
    out, (h_n, c_n) = lstm(x)
    ref_out, (ref_h, ref_c) = lstm.extract(hidden)(x)
    assert out.shape == (3, 7, hidden)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(h_n, ref_h, atol=ATOL, rtol=0)
    torch.testing.assert_close(c_n, ref_c, atol=ATOL, rtol=0)


def test_lstm_sliced_input_width_and_gradients_reach_only_the_slice():
    lstm = ElasticLSTM(8, 16, num_layers=2)
    lstm.active_hidden = 5
    x = torch.randn(6, 2, 3)  # sequence-first, 3 of 8 input features
    out, _ = lstm(x)
    torch.testing.assert_close(out, lstm.extract(5, input_size=3)(x)[0], atol=ATOL, rtol=0)
    out.sum().backward()
    covered = torch.zeros_like(lstm.weight_ih_l0)
    GateBlockSlice(covered.shape, (20, 3)).fill_add(covered, 1.0)
    grad = lstm.weight_ih_l0.grad
    assert torch.all(grad[covered == 0] == 0) and torch.any(grad[covered == 1] != 0)


def test_lstm_regions_route_and_write_back():
    lstm = ElasticLSTM(8, 16, num_layers=2)
    regions = lstm.regions(6)
    small = lstm.extract(6)
    _assert_regions_match(small, regions)
    routing = _as_routing(regions)
    global_state = {k: v.detach().clone() for k, v in lstm.state_dict().items()}

    # routing into a fresh module reproduces extraction
    fresh = nn.LSTM(8, 6, num_layers=2)
    load_routed_state(fresh, global_state, routing)
    for key, value in small.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)

    # writing an unchanged client back is the identity
    write_back(global_state, small.state_dict(), routing)
    for key, value in lstm.state_dict().items():
        assert torch.equal(global_state[key], value)

    # a changed client changes exactly its gate slices
    with torch.no_grad():
        for p in small.parameters():
            p.add_(1.0)
    write_back(global_state, small.state_dict(), routing)
    for key, region in regions.items():
        changed = global_state[key] != lstm.state_dict()[key]
        assert int(changed.sum()) == region.numel(), key


def test_lstm_full_width_is_nn_lstm():
    lstm = ElasticLSTM(8, 16, num_layers=2, batch_first=True)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(lstm(x)[0], nn.LSTM.forward(lstm, x)[0])


# --------------------------------------------------------------------------- small layers


def test_embedding_slices_columns_and_keeps_rows():
    emb = ElasticEmbedding(80, 8)
    tokens = torch.randint(0, 80, (4, 10))
    emb.active_dim = 5
    torch.testing.assert_close(emb(tokens), emb.extract(5)(tokens))
    assert emb.regions(5)["weight"].local_shape == (80, 5)


def test_layer_norm_physical_equals_elastic():
    norm = ElasticLayerNorm(32)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(2, 5, 20)
    torch.testing.assert_close(norm(x), norm.extract(20)(x), atol=ATOL, rtol=0)
    _assert_regions_match(norm.extract(20), norm.regions(20))


@pytest.mark.parametrize("dim,heads", [(32, 4), (24, 2), (16, 1)])
def test_attention_physical_equals_elastic(dim, heads):
    attn = ElasticAttention(32, num_heads=4)
    attn.active_heads = heads
    x = torch.randn(2, 9, dim)
    physical = attn.extract(dim, heads)
    torch.testing.assert_close(attn(x, out_features=dim), physical(x), atol=ATOL, rtol=0)
    _assert_regions_match(physical, attn.regions(dim, heads))


def test_attention_keeps_whole_heads():
    attn = ElasticAttention(32, num_heads=4)  # head_dim 8
    physical = attn.extract(32, 2)
    assert physical.head_dim == 8 and physical.num_heads == 2
    full = attn.qkv.weight
    for block in range(3):  # q, k, v: first two heads of each
        torch.testing.assert_close(physical.qkv.weight[block * 16:(block + 1) * 16], full[block * 32:block * 32 + 16])


def test_mlp_physical_equals_elastic():
    mlp = ElasticMlp(32, 128)
    mlp.active_hidden = 50
    x = torch.randn(2, 5, 24)
    physical = mlp.extract(24, 50)
    torch.testing.assert_close(mlp(x, out_features=24), physical(x), atol=ATOL, rtol=0)
    _assert_regions_match(physical, mlp.regions(24, 50))


def test_transformer_block_physical_equals_elastic_and_loads_timm_block():
    from timm.models.vision_transformer import Block

    block = ElasticTransformerBlock(32, num_heads=4, mlp_ratio=4.0)
    timm_block = Block(32, num_heads=4, mlp_ratio=4.0, qkv_bias=True)
    block.load_state_dict(timm_block.state_dict())
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(block(x), timm_block(x), atol=ATOL, rtol=0)

    block.set_active(num_heads=3, mlp_hidden=70)
    x = torch.randn(2, 6, 20)
    physical = block.extract(20, 3, 70)
    torch.testing.assert_close(block(x), physical(x), atol=ATOL, rtol=0)
    _assert_regions_match(physical, block.regions(20, 3, 70))


# --------------------------------------------------------------------------- Shakespeare LSTM


def _lstm_model(**kwargs):
    from fl_lightning.elastic.models import build_model

    return build_model(CharLSTM, num_classes=80, input_shape=(80,), **kwargs)


def test_shakespeare_lstm_matches_leaf_architecture():
    model = _lstm_model()
    assert isinstance(model.lstm, nn.LSTM) and model.lstm.num_layers == 2
    assert model.lstm.hidden_size == 256 and model.embedding.weight.shape == (80, 8)
    # 80*8 + (4*256*(8+256) + 2*4*256) + (4*256*512 + 2*4*256) + (256*80 + 80)
    assert sum(p.numel() for p in model.parameters()) == 819_920
    x = torch.randint(0, 80, (3, 80))
    assert model(x).shape == (3, 80)


@pytest.mark.parametrize("width", [1.0, 0.5, 0.25, 0.0625])
def test_shakespeare_lstm_extract_equals_elastic(width):
    from fl_lightning.elastic.specs import WidthSpec

    model = _lstm_model().eval()
    spec = WidthSpec.uniform(width, 1)
    routed = model.extract(spec)
    hidden = model.hidden_for(spec)
    assert routed.module.lstm.hidden_size == hidden
    x = torch.randint(0, 80, (4, 20))
    model.set_active(spec)
    torch.testing.assert_close(model(x), routed.module(x), atol=ATOL, rtol=0)
    assert set(routed.regions) == set(routed.module.state_dict()) == set(model.state_dict())
    # no tensor of the client's module shares memory with the server's
    server_ptrs = {t.data_ptr() for t in model.state_dict().values()}
    assert not server_ptrs & {t.data_ptr() for t in routed.module.state_dict().values()}


def test_shakespeare_lstm_shares_embedding_and_output_rows_in_full():
    from fl_lightning.elastic.regions import Full
    from fl_lightning.elastic.specs import WidthSpec

    model = _lstm_model()
    regions = model.regions(WidthSpec.uniform(0.25, 1))
    assert isinstance(regions["embedding.weight"][1], Full)
    assert regions["head.weight"][1].local_shape == (80, 64)  # every class, 64 of 256 inputs
    assert regions["head.bias"][1].covers_all()
    assert isinstance(regions["lstm.weight_hh_l1"][1], GateBlockSlice)


def test_shakespeare_lstm_write_back_and_nesting():
    from fl_lightning.elastic.specs import WidthSpec

    model = _lstm_model(hidden_size=32)
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    small, large = (model.extract(WidthSpec.uniform(w, 1)) for w in (0.25, 0.75))
    write_back(global_state, small.module.state_dict(), small.regions)
    for key, value in model.state_dict().items():
        assert torch.equal(global_state[key], value), key
    for key, (_, region) in small.regions.items():
        coverage = [torch.zeros(global_state[key].shape) for _ in range(2)]
        region.fill_add(coverage[0], 1.0)
        large.regions[key][1].fill_add(coverage[1], 1.0)
        assert torch.all(coverage[0] <= coverage[1]), key


def test_shakespeare_lstm_split_boundaries():
    model = _lstm_model(hidden_size=32).eval()
    x = torch.randint(0, 80, (2, 12))
    assert model.block_names == ["embed", "lstm"]
    for name in model.block_names:
        torch.testing.assert_close(model.forward_from(model.forward_until(x, name), name), model(x))


def test_shakespeare_lstm_refuses_rolling_regions():
    model = _lstm_model(hidden_size=32)
    with pytest.raises(ValueError):
        model.regions(model.min_spec(), kind="rolling")


# --------------------------------------------------------------------------- ViT


def _vit(**kwargs):
    from fl_lightning.elastic.models import build_model

    return build_model(ViT, num_classes=10, input_shape=(3, 32, 32), **kwargs).eval()


def test_vit_split_equals_full_forward():
    model = _vit()
    x = torch.randn(2, 3, 32, 32)
    reference = model.vit(x)  # timm's own forward
    torch.testing.assert_close(model(x), reference)
    assert model.block_names == [f"block{i}" for i in range(4)]
    for k in range(model.depth + 1):
        client, server = model.split(k)
        assert len(client.blocks) == k and len(server.blocks) == model.depth - k
        tokens = client(x)
        assert tokens.shape == (2, 65, 64)  # class token + 8x8 patches
        torch.testing.assert_close(server(tokens), reference, atol=ATOL, rtol=0)
        torch.testing.assert_close(model.forward_from(model.forward_until(x, k), k), reference,
                                   atol=ATOL, rtol=0)
    for i, name in enumerate(model.block_names):
        torch.testing.assert_close(model.forward_until(x, name), model.forward_until(x, i + 1))
        torch.testing.assert_close(model.forward_from(model.forward_until(x, name), name), reference,
                                   atol=ATOL, rtol=0)


def test_vit_split_shares_parameters():
    model = _vit()
    client, server = model.split(2)
    model_params = {id(p) for p in model.parameters()}
    halves = [id(p) for p in client.parameters()] + [id(p) for p in server.parameters()]
    assert len(halves) == len(set(halves)) and set(halves) == model_params
    server(client(torch.randn(2, 3, 32, 32))).sum().backward()
    assert model.vit.patch_embed.proj.weight.grad is not None
    assert model.vit.head.weight.grad is not None


def test_vit_full_spec_only_and_extract_copies():
    from fl_lightning.elastic.specs import WidthSpec

    model = _vit()
    assert model.max_spec() == model.min_spec()
    routed = model.extract(model.max_spec())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(routed.module(x), model(x))
    assert routed.payload_bytes() == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert model.vit.cls_token.data_ptr() != routed.module.vit.cls_token.data_ptr()
    with pytest.raises(ValueError):
        model.set_active(WidthSpec.uniform(0.5, 1))


def test_vit_variant_names_timm_architecture():
    from fl_lightning.errors import ConfigError

    with torch.device("meta"):  # ViT-B/16's shape without allocating it
        model = _vit(variant="vit_base_patch16_224")
    assert model.depth == 12 and model.embed_dim == 768
    with pytest.raises(ConfigError):
        _vit(variant="vit_gigantic")
