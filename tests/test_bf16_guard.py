"""bf16 training's convolution gradients against float64 (an independent oracle), on the shapes
where oneDNN's AVX-512 bf16 weight-gradient kernel is wrong (2-voxel-deep inputs)."""
import pytest
import torch
from torch import nn

from runtime.levers.cpu.bf16_guard import bf16_weight_grad_ok, protect_shallow_convolutions
from runtime.levers.cpu.blocks import ShallowFloatConv3d
from model.unet3d import Unet3D


def _weight_grad(conv: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, bf16: bool) -> torch.Tensor:
    conv.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = conv(x)
    y.float().backward(grad_out)
    return conv.weight.grad.double().clone()


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 4, 4), (2, 3, 3), (4, 4, 4)])
def test_guarded_bf16_weight_gradient_matches_float64(shape):
    torch.manual_seed(0)
    conv = nn.Conv3d(32, 16, 3, padding=1, bias=False)
    x = torch.randn(2, 32, *shape)
    grad_out = torch.randn(2, 16, *shape)
    exact = nn.Conv3d(32, 16, 3, padding=1, bias=False).double()
    exact.load_state_dict(conv.state_dict())
    oracle = _weight_grad(exact, x.double(), grad_out.double(), bf16=False)
    holder = nn.Sequential(conv)
    protect_shallow_convolutions(holder)
    conv = holder[0]
    got = _weight_grad(conv, x, grad_out, bf16=True)
    error = float((got - oracle).abs().max() / oracle.abs().max())
    assert error < 0.03  # bf16's rounding: about 0.005; the faulty kernel: 0.8 to NaN


def test_the_probe_agrees_with_the_unguarded_kernel():
    """The probe says "faulty" exactly when an unguarded bf16 convolution's weight gradient on
    a 2-deep input is off (checked here on other shapes and seeds than the probe's)."""
    torch.manual_seed(1)
    conv = nn.Conv3d(32, 32, 3, padding=1, bias=False)
    x, grad_out = torch.randn(2, 32, 2, 8, 8), torch.randn(2, 32, 2, 8, 8)
    exact = nn.Conv3d(32, 32, 3, padding=1, bias=False).double()
    exact.load_state_dict(conv.state_dict())
    oracle = _weight_grad(exact, x.double(), grad_out.double(), bf16=False)
    error = (_weight_grad(conv, x, grad_out, bf16=True) - oracle).abs().max() / oracle.abs().max()
    kernel_right = bool(torch.isfinite(error)) and float(error) < 0.05
    assert kernel_right == bf16_weight_grad_ok()


def test_guard_keeps_weights_and_float32_results():
    torch.manual_seed(0)
    model = Unet3D(1, 3, normalization="batchnorm", activation="relu", filters=[2, 4, 4, 8, 8]).eval()
    x = torch.randn(1, 1, 32, 32, 64)
    with torch.no_grad():
        before = model(x)
    keys = list(model.state_dict())
    plain = sum(type(m) is nn.Conv3d for m in model.modules())
    assert plain > 10 and protect_shallow_convolutions(model) == plain
    assert not any(type(m) is nn.Conv3d for m in model.modules())
    assert isinstance(model.output.conv, ShallowFloatConv3d)
    with torch.no_grad():
        after = model(x)
    assert list(model.state_dict()) == keys
    assert torch.equal(before, after)
