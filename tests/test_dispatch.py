"""What a client step asks of the host: whole tensors used as they are, statistics views made
once, routed slices copied once, no initialiser run for a model built for its shapes, and
clipping in a handful of multi-tensor operations with Fabric's arithmetic."""

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fl_lightning.elastic.layers.conv import ElasticConv2d
from fl_lightning.elastic.layers.leading import leading
from fl_lightning.elastic.layers.norm import ElasticBatchNorm2d
from fl_lightning.elastic.regions import LeadingSlice, RollingSlice, union_numel
from fl_lightning.elastic.routing import load_routed_state
from fl_lightning.runtime.gradient_clipping import clip_gradients


class Ops(TorchDispatchMode):
    """The ATen operators run inside the block, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def graph_nodes(tensor):
    """Names of every autograd node behind ``tensor``."""
    seen, stack, names = set(), [tensor.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_a_whole_slice_is_the_tensor_itself_and_a_partial_one_its_leading_block():
    w = torch.arange(24.0).reshape(4, 3, 2)
    assert leading(w, 4, 3) is w and leading(w, 4) is w
    assert torch.equal(leading(w, 2, 3), w[:2]) and torch.equal(leading(w, 4, 1), w[:, :1])
    assert leading(w, 2, 1).data_ptr() == w.data_ptr()  # a view, no copy


def test_full_width_layers_put_no_view_between_parameter_and_gradient():
    """At full width the conv and its batch norm hand autograd their parameters themselves: no
    slice or alias node, so the backward accumulates straight into the parameter's gradient
    instead of through a zero-padded full-size tensor. At a partial width the slices remain."""
    conv, bn = ElasticConv2d(3, 8, 3), ElasticBatchNorm2d(8)
    out = bn(conv(torch.randn(2, 3, 5, 5)))
    assert not {"SliceBackward0", "AliasBackward0", "AsStridedBackward0"} & set(graph_nodes(out))
    conv.active_out = 5
    out = bn(conv(torch.randn(2, 3, 5, 5)))
    assert graph_nodes(out).count("SliceBackward0") == 3  # conv weight, bn weight and bias


def test_statistics_views_are_made_once_per_width_and_follow_a_moved_buffer():
    bn = ElasticBatchNorm2d(8).train()
    x = torch.randn(4, 5, 3, 3)
    with Ops() as first:
        bn(x)
    with Ops() as second:
        bn(x)
    assert first.names.count("slice") == 4 and second.names.count("slice") == 2  # weight, bias only
    bn.double()  # new buffers: new views of them
    x = x.double()
    bn(x)
    plain = nn.BatchNorm2d(5).double().train()
    plain.running_mean.copy_(bn.running_mean[:5])
    plain.running_var.copy_(bn.running_var[:5])
    expected = plain(x)
    torch.testing.assert_close(bn(x), expected, rtol=0, atol=0)
    torch.testing.assert_close(bn.running_mean[:5], plain.running_mean, rtol=0, atol=0)
    assert torch.all(bn.running_mean[5:] == 0)


def test_routing_copies_each_slice_once():
    full = {"w": torch.randn(6, 4), "b": torch.randn(6)}
    module = nn.Linear(3, 4)  # weight (4, 3), bias (4,)
    regions = {"weight": ("w", LeadingSlice((6, 4), (4, 3))), "bias": ("b", LeadingSlice((6,), (4,)))}
    with Ops() as ops:
        load_routed_state(module, full, regions)
    assert "clone" not in ops.names and ops.names.count("copy_") == 2
    assert torch.equal(module.weight, full["w"][:4, :3]) and torch.equal(module.bias, full["b"][:4])
    rolling = RollingSlice((6,), (4,), (3,))  # indices 4, 5, 0: the default gather-then-copy path
    local = torch.empty(3)
    rolling.read_into(local, full["b"])
    assert torch.equal(local, full["b"][[4, 5, 0]])


def test_union_of_leading_blocks_counts_each_position_once():
    """Against a mask of the union, with blocks that overlap partly, so that neither the sum of
    their sizes (20 + 18 + 12 = 50) nor the largest (20) is the answer (rows 0-1: 6 columns,
    rows 2-3: 5, rows 4-5: 3, so 12 + 10 + 6 = 28)."""
    shapes = [(4, 5), (6, 3), (2, 6)]
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for rows, cols in shapes:
        mask[:rows, :cols] = True
    assert union_numel(shapes) == int(mask.sum()) == 28
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        boxes = [tuple(int(v) for v in torch.randint(0, 5, (3,), generator=g)) for _ in range(4)]
        cube = torch.zeros(4, 4, 4, dtype=torch.bool)
        for a, b, c in boxes:
            cube[:a, :b, :c] = True
        assert union_numel(boxes) == int(cube.sum())
    assert union_numel([]) == 0 and union_numel([(), ()]) == 1


@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipping active, and a coefficient of 1
def test_clipping_is_fabrics_bit_for_bit_in_few_operations(max_norm):
    fabric = Fabric(accelerator="cpu", devices=1)
    shapes = [(7, 3), (5,), (2, 2, 3)]

    def model_with_grads():
        model = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])
        for p in model:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
        return model

    ours, theirs = model_with_grads(), model_with_grads()
    opt_ours = fabric.setup_optimizers(torch.optim.SGD(ours.parameters(), lr=0.1))
    opt_theirs = fabric.setup_optimizers(torch.optim.SGD(theirs.parameters(), lr=0.1))
    with Ops() as ops:
        clip_gradients(fabric, ours, opt_ours, max_norm)
    fabric.clip_gradients(theirs, opt_theirs, max_norm=max_norm, error_if_nonfinite=False)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad)
    assert len(ops.names) <= 8, ops.names  # not one operation or more per parameter
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ours]))
    if max_norm < 1:
        assert total == pytest.approx(max_norm, rel=1e-5)  # clipped to the bound, as a whole


def test_models_built_for_their_shapes_run_no_initialiser():
    """The placement's estimate, the memory check and FEAST's routing accounting build the
    55.7M-parameter supernet on the meta device; a watcher outside them sees every initialiser
    that is not skipped (with them, building it there took 3.7 s)."""
    from torch.overrides import TorchFunctionMode

    from fl_lightning.elastic.envelope import routed_param_count
    from fl_lightning.elastic.models.ofa_resnet import OFASpec
    from fl_lightning.federation.machine import parameter_count
    from fl_lightning.federation.memory import model_bytes, shapes_model

    class Initialisers(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.uniform_, torch.Tensor.normal_, nn.init.kaiming_uniform_):
                self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    model = {"class_path": "fl_lightning.elastic.models.OFAResNet"}
    with Initialisers() as watcher:
        count = parameter_count(model, 100, (3, 32, 32))
        supernet = shapes_model(model, 100, (3, 32, 32))
        nbytes = model_bytes(model, 100, (3, 32, 32))
        routed = routed_param_count(supernet, [OFASpec((0,) * 4, (0.1,) * 4, (0,) * 5)])
    assert watcher.seen == []
    assert sum(p.numel() for p in supernet.parameters()) == 55_682_916 and count > 55_682_916  # buffers too
    assert nbytes == sum(t.numel() * t.element_size() for t in supernet.state_dict().values())
    assert 0 < routed < 55_682_916
    with Initialisers() as watcher, torch.device("meta"):
        nn.Conv2d(3, 4, 3)  # the watcher sees an initialiser that runs
    assert watcher.seen
