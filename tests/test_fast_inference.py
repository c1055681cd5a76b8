"""The PyTorch backend's inference copy: layout-preserving instance norm, the first convolution on
oneDNN and the fast sliding-window predictor, each against an independent oracle on tiny shapes."""
import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model.unet3d import Unet3D
from runtime.inference.predictor import PredictorOptions, build_predictor
from runtime.levers.cpu.blocks import ChannelsLastConv3d, adopt
from runtime.levers.cpu.convert import prepare_for_inference
from runtime.levers.cpu.norms import LayoutPreservingInstanceNorm3d
from runtime.inference.sliding_window import sliding_window_inference

ROOT = Path(__file__).resolve().parents[1]
CL = torch.channels_last_3d


def _norm(channels=5, seed=0):
    torch.manual_seed(seed)
    norm = nn.InstanceNorm3d(channels, affine=True)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
        norm.bias.normal_()
    return norm


def _instance_norm_float64(x, weight, bias, eps):
    """The definition, per sample and channel, in float64."""
    x = x.double()
    mean = x.mean(dim=(2, 3, 4), keepdim=True)
    var = ((x - mean) ** 2).mean(dim=(2, 3, 4), keepdim=True)
    shape = (1, -1, 1, 1, 1)
    return (x - mean) / torch.sqrt(var + eps) * weight.double().view(shape) + bias.double().view(shape)


def test_norm_ncdhw_is_bit_identical_to_instance_norm():
    norm = _norm()
    x = torch.randn(2, 5, 6, 7, 9) * 3 + 1
    with torch.no_grad():
        assert torch.equal(adopt(norm, LayoutPreservingInstanceNorm3d)(x), norm(x))


@pytest.mark.parametrize("batch", [1, 3])
def test_norm_keeps_channels_last_and_matches_definition(batch):
    norm = _norm(seed=batch)
    x = (torch.randn(batch, 5, 6, 7, 9) * 3 + 1).contiguous(memory_format=CL)
    with torch.no_grad():
        out = adopt(norm, LayoutPreservingInstanceNorm3d)(x)
    assert out.is_contiguous(memory_format=CL) and out.dtype == torch.float32
    oracle = _instance_norm_float64(x, norm.weight, norm.bias, norm.eps)
    torch.testing.assert_close(out.double(), oracle, rtol=1e-5, atol=1e-5)


def test_norm_at_window_size_is_as_accurate_as_instance_norm():
    """At a full 128³ window, where sums of 2 million float32 values per channel show their
    summation order (PyTorch's channels-last batch norm, used before: relative error 2-3e-4),
    the channels-last path must be as close to the float64 definition as nn.InstanceNorm3d is,
    also with a mean 30 times the spread (a naive E[x²] - E[x]² would lose it)."""
    norm = _norm(channels=2, seed=3)
    torch.manual_seed(3)
    x = torch.randn(1, 2, 128, 128, 128) * 3
    x[:, 1] += 90.0
    oracle = _instance_norm_float64(x, norm.weight, norm.bias, norm.eps)
    with torch.no_grad():
        ours = adopt(norm, LayoutPreservingInstanceNorm3d)(x.contiguous(memory_format=CL)).detach().double()
        theirs = norm(x).detach().double()

    def relative(y):
        return float((y - oracle).abs().max() / oracle.abs().max())
    assert relative(theirs) < 1e-6
    assert relative(ours) < 2e-6, (relative(ours), relative(theirs))


def test_norm_bfloat16_stays_bfloat16_channels_last():
    norm = _norm(seed=7)
    x = (torch.randn(1, 5, 8, 8, 8) * 2 - 1).to(torch.bfloat16).contiguous(memory_format=CL)
    with torch.no_grad():
        out = adopt(norm, LayoutPreservingInstanceNorm3d)(x)
    assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=CL)
    oracle = _instance_norm_float64(x, norm.weight, norm.bias, norm.eps)
    torch.testing.assert_close(out.double(), oracle, rtol=2e-2, atol=2e-2)


def test_norm_rejects_unsupported_configurations():
    with pytest.raises(ValueError):
        adopt(nn.InstanceNorm3d(3, affine=False), LayoutPreservingInstanceNorm3d)


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    model = Unet3D(filters=(2, 4, 8))  # two halvings: a 16³ window keeps 2³ in the bottleneck
    with torch.no_grad():  # non-trivial affine parameters in the norms
        for m in model.modules():
            if isinstance(m, nn.InstanceNorm3d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("channels_last", [False, True])
def test_prepared_model_computes_the_same_function(channels_last):
    model = _tiny_model()
    before = copy.deepcopy(model.state_dict())
    prepared = prepare_for_inference(model, channels_last=channels_last)
    assert model.training and not prepared.training
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched
    assert any(isinstance(m, nn.InstanceNorm3d) for m in model.modules())
    assert not any(isinstance(m, nn.InstanceNorm3d) for m in prepared.modules())
    assert list(prepared.state_dict()) == list(before)  # the reference's keys
    x = torch.randn(2, 1, 16, 32, 48)
    with torch.no_grad():
        expected = model.eval()(x)
        out = prepared(x.contiguous(memory_format=CL) if channels_last else x)
    if not channels_last:  # same kernels, same order: bit for bit
        assert torch.equal(out, expected)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stride", [1, 2])
def test_first_convolution_gives_channels_last_output(stride):
    """On one input channel PyTorch's own choice is im2col with an NCDHW output (below oneDNN's
    size threshold); ChannelsLastConv3d gives the same values, channels-last."""
    torch.manual_seed(stride)
    conv = nn.Conv3d(1, 6, 3, stride=stride, padding=1)
    x = torch.randn(2, 1, 9, 10, 11).contiguous(memory_format=CL)
    first = adopt(copy.deepcopy(conv), ChannelsLastConv3d).to(memory_format=CL)
    assert list(first.state_dict()) == list(conv.state_dict())
    with torch.no_grad():
        out = first(x)
    assert out.is_contiguous(memory_format=CL) and not out.is_contiguous()
    oracle = F.conv3d(x.double(), conv.weight.double(), conv.bias.double(), stride, 1)
    torch.testing.assert_close(out.double(), oracle, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # other dtypes: nn.Conv3d's own path
        assert first.to(torch.float64)(x.double()).dtype == torch.float64


def test_prepared_model_runs_channels_last_from_the_first_convolution():
    prepared = prepare_for_inference(_tiny_model())
    assert type(prepared.input_block.conv1[0]) is ChannelsLastConv3d
    seen = []
    prepared.input_block.conv1[0].register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad():
        prepared(torch.randn(1, 1, 16, 16, 16).contiguous(memory_format=CL))
    assert seen[0].is_contiguous(memory_format=CL) and not seen[0].is_contiguous()
    assert type(prepare_for_inference(_tiny_model(), channels_last=False).input_block.conv1[0]) is nn.Conv3d


@pytest.mark.slow
@pytest.mark.parametrize("sw_batch_size", [1, 3])
def test_inference_copy_predictor_in_the_sliding_window(sw_batch_size):
    model = _tiny_model(3).eval()
    image = torch.randn(1, 1, 20, 40, 33)
    with torch.no_grad():
        ref = sliding_window_inference(model, image, (16, 16, 16), 0.5)
    fast = build_predictor(prepare_for_inference(model), torch.device("cpu"), PredictorOptions(channels_last=True))
    fast = sliding_window_inference(fast, image, (16, 16, 16), 0.5, sw_batch_size)
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)


def test_first_convolution_under_autocast_follows_autocast():
    conv = nn.Conv3d(1, 4, 3, padding=1)
    first = adopt(copy.deepcopy(conv), ChannelsLastConv3d)
    x = torch.randn(1, 1, 6, 6, 6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, out = conv(x), first(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)
