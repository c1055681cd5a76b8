import os

import pytest
import torch

from model.unet3d import DEFAULT_FILTERS, Unet3D, weight_init_tensor_names

# A sample of the reference's state_dict keys with their shapes (from the benchmark spec).
REFERENCE_KEYS = {
    "input_block.conv1.0.weight": (32, 1, 3, 3, 3),
    "input_block.conv1.1.bias": (32,),
    "downsample.3.conv2.0.weight": (320, 320, 3, 3, 3),
    "bottleneck.conv1.0.weight": (320, 320, 3, 3, 3),
    "upsample.0.upsample_conv.0.weight": (320, 320, 2, 2, 2),
    "upsample.0.upsample_conv.0.bias": (320,),
    "upsample.0.conv1.0.weight": (320, 640, 3, 3, 3),
    "upsample.4.conv2.1.weight": (32,),
    "upsample.4.upsample_conv.0.weight": (64, 32, 2, 2, 2),
    "output.conv.weight": (3, 32, 1, 1, 1),
    "output.conv.bias": (3,),
}


@pytest.fixture(scope="module")
def full_model():
    return Unet3D(1, 3, "instancenorm", "relu")


def test_parameter_count(full_model):
    assert sum(p.numel() for p in full_model.parameters()) == 31_190_243


def test_state_dict_keys_and_shapes(full_model):
    state = full_model.state_dict()
    assert len(state) == 78
    for key, shape in REFERENCE_KEYS.items():
        assert tuple(state[key].shape) == shape, key
    # every 3x3x3 convolution is bias-free (a norm follows); transposed convs keep a bias
    for key, value in state.items():
        if key.endswith(".0.bias"):
            assert "upsample_conv" in key, key


def test_keys_independent_of_activation():
    a = Unet3D(filters=(2, 4, 4, 8, 8)).state_dict()
    b = Unet3D(activation="leaky_relu", filters=(2, 4, 4, 8, 8)).state_dict()
    assert list(a) == list(b)


@pytest.mark.parametrize("normalization", ["instancenorm", "batchnorm"])
def test_forward_shape_tiny(normalization):
    torch.manual_seed(0)
    model = Unet3D(1, 3, normalization, "leaky_relu", filters=(2, 4, 6, 8, 10))
    x = torch.randn(2, 1, 64, 96, 64)
    y = model(x)
    assert y.shape == (2, 3, 64, 96, 64)
    y.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_batchnorm_adds_running_stats():
    state = Unet3D(normalization="batchnorm", filters=(2, 4, 4, 8, 8)).state_dict()
    assert "input_block.conv1.1.running_mean" in state


def test_weight_init_names():
    names = weight_init_tensor_names()
    assert len(names) == 50 and len(set(names)) == 50
    for expected in ("input_block_0_conv", "down2_block_1_instancenorm", "up1_deconv", "output_conv",
                     "down4_block_0_conv", "up4_block_1_instancenorm"):
        assert expected in names
    assert len(weight_init_tensor_names(len(DEFAULT_FILTERS), "batchnorm")) == 50


def test_bad_choices_rejected():
    with pytest.raises(ValueError):
        Unet3D(normalization="groupnorm")
    with pytest.raises(ValueError):
        Unet3D(activation="gelu")


COPY_NODES = ("CopySlices", "AsStridedBackward0", "CloneBackward0")


def set_inplace(model: torch.nn.Module, inplace: bool) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, (torch.nn.ReLU, torch.nn.LeakyReLU)):
            module.inplace = inplace
    return model


def backward_nodes(root) -> dict:
    """Node type -> count in the autograd graph reachable from ``root`` (a ``grad_fn``)."""
    counts, seen, stack = {}, set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        counts[type(node).__name__] = counts.get(type(node).__name__, 0) + 1
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return counts


@pytest.mark.parametrize("activation", ["relu", "leaky_relu"])
def test_plain_activation_has_no_copy_nodes_and_same_gradients(activation):
    """The activations are not in place: no CopySlices nodes (the in-place write to instance
    norm's view made one per layer), and the same loss and gradients as the in-place variant."""
    from model.losses import DiceCELoss

    torch.manual_seed(0)
    model = Unet3D(1, 3, activation=activation, filters=(2, 4, 4, 8, 8))
    image = torch.randn(1, 1, 64, 32, 32)
    label = torch.randint(0, 3, (1, 1, 64, 32, 32))
    results = {}
    for inplace in (False, True):
        set_inplace(model, inplace)
        model.zero_grad(set_to_none=True)
        loss = DiceCELoss()(model(image), label)
        copies = sum(backward_nodes(loss.grad_fn).get(name, 0) for name in COPY_NODES)
        loss.backward()
        results[inplace] = (copies, loss.detach(), [p.grad.clone() for p in model.parameters()])
    assert results[False][0] == 0 and results[True][0] > 0          # the cause, and its removal
    assert torch.equal(results[False][1], results[True][1])
    assert all(torch.equal(a, b) for a, b in zip(results[False][2], results[True][2]))
    assert not any(getattr(m, "inplace", False) for m in Unet3D(1, 3, activation=activation).modules())


@pytest.mark.parametrize("levels", [2, 3, 5])
def test_shape_divisor_leaves_one_bottleneck_voxel(levels):
    """An input of ``shape_divisor(filters)`` voxels per axis reaches the bottleneck as one voxel
    (seen by a hook, not computed), and the benchmark's model has ``SHAPE_DIVISOR``, the
    multiple main.py checks --input_shape against."""
    from model.unet3d import SHAPE_DIVISOR, shape_divisor

    filters = (2,) * levels
    model = Unet3D(normalization="batchnorm", filters=filters).eval()
    seen = []
    model.bottleneck.register_forward_hook(lambda module, args, out: seen.append(out.shape[2:]))
    size = shape_divisor(filters)
    with torch.no_grad():
        out = model(torch.randn(1, 1, size, size, size))
    assert tuple(seen[0]) == (1, 1, 1) and out.shape == (1, 3, size, size, size)
    assert Unet3D().divisor == SHAPE_DIVISOR == shape_divisor(DEFAULT_FILTERS)
