"""Inference-only model preparation: layout-preserving instance norm, int8 convolutions and the
fast sliding-window predictor, each against an independent oracle on tiny shapes."""
import copy
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.inference.torch_copy import (FULL_GRID, SEVEN_BIT_WEIGHTS, ChannelsLastConv3d, Int8Conv3d,
                                  LayoutPreservingInstanceNorm3d, channel_divisors,
                                  equalize_int8_inputs, int8_available, int8_grid,
                                  prepare_for_inference, quantize_uint8, uint8_codes, uint8_range)
from model.unet3d import Unet3D
from runtime.inference.predictor import PredictorOptions, build_predictor
from runtime.inference.sliding_window import sliding_window_inference

ROOT = Path(__file__).resolve().parents[1]
CL = torch.channels_last_3d
needs_int8 = pytest.mark.skipif(int8_available() is not None, reason=str(int8_available()))


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
        assert torch.equal(LayoutPreservingInstanceNorm3d(norm)(x), norm(x))


@pytest.mark.parametrize("batch", [1, 3])
def test_norm_keeps_channels_last_and_matches_definition(batch):
    norm = _norm(seed=batch)
    x = (torch.randn(batch, 5, 6, 7, 9) * 3 + 1).contiguous(memory_format=CL)
    with torch.no_grad():
        out = LayoutPreservingInstanceNorm3d(norm)(x)
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
        ours = LayoutPreservingInstanceNorm3d(norm)(x.contiguous(memory_format=CL)).detach().double()
        theirs = norm(x).detach().double()

    def relative(y):
        return float((y - oracle).abs().max() / oracle.abs().max())
    assert relative(theirs) < 1e-6
    assert relative(ours) < 2e-6, (relative(ours), relative(theirs))


def test_norm_bfloat16_stays_bfloat16_channels_last():
    norm = _norm(seed=7)
    x = (torch.randn(1, 5, 8, 8, 8) * 2 - 1).to(torch.bfloat16).contiguous(memory_format=CL)
    with torch.no_grad():
        out = LayoutPreservingInstanceNorm3d(norm)(x)
    assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=CL)
    oracle = _instance_norm_float64(x, norm.weight, norm.bias, norm.eps)
    torch.testing.assert_close(out.double(), oracle, rtol=2e-2, atol=2e-2)


def test_norm_rejects_unsupported_configurations():
    with pytest.raises(ValueError):
        LayoutPreservingInstanceNorm3d(nn.InstanceNorm3d(3, affine=False))


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
    first = ChannelsLastConv3d.from_conv(copy.deepcopy(conv)).to(memory_format=CL)
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


def test_uint8_codes_are_int_repr_without_a_copy():
    x = torch.rand(1, 3, 4, 5, 6).contiguous(memory_format=CL)
    q = torch.quantize_per_tensor(x, 0.01, 3, torch.quint8)
    codes = uint8_codes(q)
    assert codes.dtype == torch.uint8 and codes.stride() == q.stride()
    assert torch.equal(codes, q.int_repr())
    assert codes.data_ptr() == q.data_ptr()  # the same memory
    sliced = q[:, 1:]  # an offset into the storage
    assert torch.equal(uint8_codes(sliced), sliced.int_repr())


def test_uint8_range_known_answers():
    scale, zp = uint8_range(-1.0, 3.0)
    assert scale == pytest.approx(4 / 255) and zp == 64        # round(1 / (4/255)) = round(63.75)
    assert uint8_range(0.0, 2.55) == (pytest.approx(0.01), 0)  # non-negative: zero point 0
    assert uint8_range(0.5, 2.0)[1] == 0                       # range always includes 0
    assert uint8_range(-2.55, -1.0) == (pytest.approx(0.01), 255)
    assert uint8_range(0.0, 0.0) == (1.0, 0)


def test_uint8_range_seven_bit_known_answers():
    assert uint8_range(-1.0, 3.0, 127) == (pytest.approx(4 / 127), 32)  # round(31.75)
    assert uint8_range(-2.54, -1.0, 127) == (pytest.approx(0.02), 127)


@pytest.mark.parametrize("codes", [255, 127])
def test_quantize_uint8_round_trip(codes):
    x = (torch.randn(1, 3, 5, 6, 7) * 2 + 0.5).contiguous(memory_format=CL)
    q, scale, zp = quantize_uint8(x, codes)
    assert q.dtype == torch.uint8 and q.is_contiguous(memory_format=CL)
    back = (q.float() - zp) * scale
    assert float((back - x).abs().max()) <= scale / 2 + 1e-6
    assert int(q.min()) == 0 or int(q.max()) == codes          # the range is used in full
    assert int(q.max()) <= codes


def test_seven_bit_codes_never_exceed_127_at_a_rounding_tie():
    # range [-1, 1] on 127 codes: zero point round(63.5) = 64 and 1.0 -> round(63.5) + 64 = 128
    # before the clamp; 128 x 127 x 2 would overflow 16 bits again.
    q, _, zp = quantize_uint8(torch.tensor([-1.0, 0.0, 1.0]).view(1, 1, 1, 1, 3), 127)
    assert zp == 64 and int(q.max()) == 127


def _quantized_reference(conv, x, grid=FULL_GRID):
    """Int8Conv3d's arithmetic written out on ``grid``: dequantised input and weight, float64
    convolution."""
    q, scale, zp = quantize_uint8(x, grid.activation_codes)
    x_hat = (q.double() - zp) * scale
    w = conv.weight.detach().double()
    w_scale = w.abs().amax(dim=(1, 2, 3, 4)) / grid.weight_max
    w_hat = torch.round(w / w_scale.view(-1, 1, 1, 1, 1)) * w_scale.view(-1, 1, 1, 1, 1)
    bias = None if conv.bias is None else conv.bias.detach().double()
    return F.conv3d(x_hat, w_hat, bias, conv.stride, conv.padding)


@needs_int8
@pytest.mark.parametrize("stride, bias, shift", [(1, False, 0.0), (2, False, 0.7), (1, True, -0.4)])
def test_int8_conv_matches_its_quantised_arithmetic(stride, bias, shift):
    torch.manual_seed(stride)
    conv = nn.Conv3d(6, 10, 3, stride=stride, padding=1, bias=bias)
    x = torch.randn(2, 6, 9, 10, 11) + shift
    if shift == 0.0:
        x = x.relu()  # a ReLU output: zero point 0
    with torch.no_grad():
        int8_conv = Int8Conv3d(conv)  # the grid this CPU computes exactly
        out = int8_conv(x.contiguous(memory_format=CL))
        exact = _quantized_reference(conv, x, int8_conv.grid)
        plain = conv(x)
    assert int8_conv.grid == int8_grid() and int8_conv.grid in (FULL_GRID, SEVEN_BIT_WEIGHTS)
    assert out.shape == plain.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), exact, rtol=1e-4, atol=1e-4)
    assert float((out - plain).norm() / plain.norm()) < 0.03  # 7- or 8-bit quantisation error only


def _cpu_has(flag: str) -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and f" {flag} " in cpuinfo.read_text().replace("\n", " ")


_SATURATION_PROBE = """
import torch
from torch import nn
from runtime.inference.torch_copy import FULL_GRID, SEVEN_BIT_ACTIVATIONS, SEVEN_BIT_WEIGHTS, Int8Conv3d, int8_grid
from tests.test_fast_inference import _quantized_reference
torch.manual_seed(1)
conv = nn.Conv3d(6, 10, 3, padding=1, bias=False)
x = torch.randn(2, 6, 9, 10, 11).relu()
errors = []
with torch.no_grad():
    for grid in (FULL_GRID, SEVEN_BIT_WEIGHTS, SEVEN_BIT_ACTIVATIONS):
        out = Int8Conv3d(conv, grid=grid)(x.contiguous(memory_format=torch.channels_last_3d))
        errors.append(float((out.double() - _quantized_reference(conv, x, grid)).abs().max()))
print(int8_grid() == SEVEN_BIT_WEIGHTS, *errors)
"""


@needs_int8
@pytest.mark.skipif(not _cpu_has("avx2"), reason="needs an x86 CPU with AVX2 (ONEDNN_MAX_CPU_ISA=AVX2)")
def test_int8_grid_follows_the_saturating_avx2_kernel():
    """oneDNN limited to AVX2 (``ONEDNN_MAX_CPU_ISA``, honoured on any newer x86 CPU) runs the
    saturating ``vpmaddubsw`` kernel of a CPU without VNNI: the probe must choose 7-bit weights,
    the full grid must visibly break the arithmetic there, and either 7-bit grid keeps it exact."""
    proc = subprocess.run([sys.executable, "-c", _SATURATION_PROBE], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    chose_seven_bit_weights, error_full, error_weights, error_activations = proc.stdout.split()
    assert chose_seven_bit_weights == "True"
    assert float(error_full) > 0.05        # pairs saturated: what the AVX2-only CPUs computed
    assert float(error_weights) < 1e-4     # 255 x 63 x 2 fits in 16 bits: exact again
    assert float(error_activations) < 1e-4  # 127 x 127 x 2 fits too


@needs_int8
def test_int8_prepared_model_keeps_the_first_convolution_float():
    prepared = prepare_for_inference(_tiny_model(), int8=True)
    assert type(prepared.input_block.conv1[0]) is ChannelsLastConv3d  # float, oneDNN
    assert isinstance(prepared.input_block.conv2[0], Int8Conv3d)
    assert type(prepared.output.conv) is nn.Conv3d


def test_channel_divisors_known_answers():
    highs = torch.tensor([[4.0, 1.0, -2.0, 0.0], [1.0, 0.25, -1.0, 0.0]])  # (N=2, C=4)
    torch.testing.assert_close(channel_divisors(highs, strength=1.0),
                               torch.tensor([1.0, 0.25, 1e-3, 1e-3], dtype=highs.dtype))
    torch.testing.assert_close(channel_divisors(highs), torch.tensor([1.0, 0.5, 1e-3, 1e-3]))
    assert torch.equal(channel_divisors(-highs.abs()), torch.ones(4))  # nothing positive


def _imbalanced(model, factor=30.0):
    """The same function with the input block's output channel 0 made ``factor`` times larger
    (its norm scaled up, the convolutions that read it scaled down): a network whose int8
    input grid is mostly spent on one channel."""
    with torch.no_grad():
        norm = model.input_block.conv2[1]
        norm.weight[0] *= factor
        norm.bias[0] *= factor
        model.downsample[0].conv1[0].weight[:, 0] /= factor
        up = model.upsample[-1]
        up.conv1[0].weight[:, up.upsample_conv[0].out_channels] /= factor
    return model


@needs_int8
def test_int8_equalization_links_every_norm_read_only_by_int8_convolutions():
    prepared = prepare_for_inference(_tiny_model(), int8=True)
    # (2, 4, 8): 7 blocks (input, 2 down, bottleneck, 3 up) whose first norm feeds the second
    # convolution, and the outputs of the input block and the 2 down blocks (next stage + skip)
    linked = [m for m in prepared.modules() if isinstance(m, LayoutPreservingInstanceNorm3d) and m.equalize]
    assert len(linked) == 10
    assert not prepared.bottleneck.conv2[1].equalize  # read by the float transposed convolution
    assert not prepared.upsample[-1].conv2[1].equalize  # read by the float output layer
    assert equalize_int8_inputs(nn.Sequential(nn.Conv3d(2, 2, 3))) == 0
    plain = prepare_for_inference(_tiny_model(), int8=True, equalize=False)
    assert not any(getattr(m, "equalize", False) or getattr(m, "scaled_inputs", None) for m in plain.modules())


@needs_int8
def test_int8_equalization_recovers_an_imbalanced_channel():
    """Oracle: the float network. Its input block's channel 0 made 30 times larger (and the
    weights reading it 30 times smaller: the same function), the first stride-2 convolution,
    whose whole input is equalized, comes at least twice as close to float with equalization as
    with one grid for all channels (measured: 4x)."""
    model = _imbalanced(_tiny_model(5)).eval()
    x = torch.randn(2, 1, 16, 32, 32)
    equalized = prepare_for_inference(model, int8=True)
    plain = prepare_for_inference(model, int8=True, equalize=False)
    outputs = {}
    for name, net in [("float", model), ("equalized", equalized), ("plain", plain)]:
        net.downsample[0].conv1[0].register_forward_hook(
            lambda module, args, out, name=name: outputs.update({name: out.float().contiguous()}))
        with torch.no_grad():
            net(x if name == "float" else x.contiguous(memory_format=CL))

    def error(name):
        return float((outputs[name] - outputs["float"]).pow(2).mean().sqrt()
                     / outputs["float"].pow(2).mean().sqrt())
    assert error("equalized") < 0.5 * error("plain"), (error("equalized"), error("plain"))


@needs_int8
def test_int8_equalization_keeps_the_float_function():
    """With the int8 arithmetic taken out (each int8 convolution in float32 with its folded
    weight), the equalized norms and the weights multiplied back compute the float network."""
    model = _tiny_model(6).eval()
    prepared = prepare_for_inference(model, int8=True, channels_last=True)
    for m in prepared.modules():
        if isinstance(m, Int8Conv3d):
            m.forward = functools.partial(_float_fold_forward, m)
    x = torch.randn(1, 1, 16, 16, 32)
    with torch.no_grad():
        torch.testing.assert_close(prepared(x.contiguous(memory_format=CL)), model(x), rtol=1e-4, atol=1e-4)
    assert any(m.equalize and float(m.channel_scale.min()) < 1.0 for m in prepared.modules()
               if isinstance(m, LayoutPreservingInstanceNorm3d))  # the factors were not all 1


def _float_fold_forward(conv, x):
    """Int8Conv3d's forward with float arithmetic: the weight folded with the input scales."""
    factors = torch.ones(conv.float_weight.shape[1])
    for first, norm in conv.scaled_inputs:
        factors[first:first + norm.channel_scale.numel()] = norm.channel_scale
    return F.conv3d(x, conv.float_weight * factors.view(1, -1, 1, 1, 1), conv.bias, conv.stride,
                    conv.padding, conv.dilation)


@pytest.mark.slow
@pytest.mark.parametrize("sw_batch_size", [1, 3])
def test_inference_copy_predictor_in_the_sliding_window(sw_batch_size):
    model = _tiny_model(3).eval()
    image = torch.randn(1, 1, 20, 40, 33)
    with torch.no_grad():
        ref = sliding_window_inference(model, image, (16, 16, 16), 0.5)
    fast = build_predictor(model, torch.device("cpu"), PredictorOptions(channels_last=True), inference_copy=True)
    fast = sliding_window_inference(fast, image, (16, 16, 16), 0.5, sw_batch_size)
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)


def test_first_convolution_under_autocast_follows_autocast():
    conv = nn.Conv3d(1, 4, 3, padding=1)
    first = ChannelsLastConv3d.from_conv(copy.deepcopy(conv))
    x = torch.randn(1, 1, 6, 6, 6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, out = conv(x), first(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)
