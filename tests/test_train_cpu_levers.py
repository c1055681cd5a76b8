"""The CPU training levers of issue 33 compute the benchmark's function.

- the fused, layout-preserving instance norm + activation, the plain formula and the one
  with its own backward (statistics per depth slice, combined), equals ``nn.InstanceNorm3d``
  followed by the reference's activation (values and gradients: float32 tightly, bf16 within its
  precision), also where the slices' means differ widely, and returns channels-last;
- a :class:`model.layers.ConvBlock` is ``nn.Sequential`` bit for bit (the default fp32 path is
  the reference's: tests/test_mlcommons_reference.py checks it against the real code), with the
  same state_dict;
- the transposed convolution as one GEMM equals ``F.conv_transpose3d`` (float64: values and
  gradients) and returns channels-last; only channels-last CPU training uses it;
- a channels-last network with fused norms and GEMM transposed convolutions gives the NCDHW
  network's logits and gradients; so does one with the concatenations split and the widest
  blocks in NCDHW (float64), and float32 training puts exactly the 320-filter blocks there;
- ``--amp`` trains in bf16 only where the CPU has native bf16 dot products (the flags and
  ``ONEDNN_MAX_CPU_ISA``), else in float32, and says so;
- the compiled norms (marked ``slow``: torch.compile takes tens of seconds on two cores) equal
  the eager ones.
"""
import copy
import dataclasses

import pytest
import torch
from torch import nn

from model.layers import ConvBlock, UpsampleBlock, conv_block
from model.losses import DiceCELoss
from model.unet3d import DEFAULT_FILTERS, Unet3D
from runtime import build
from runtime.arguments import Config
from runtime.levers.cpu import convert
from runtime.levers.cpu.blocks import (FastConvBlock, FastUpsampleBlock, adopt, conv_of_concatenation, fuse_norms,
                                       gemm_transposed_convolutions, split_concatenations, split_upsample_block,
                                       transposed_conv_as_gemm, widest_blocks_in_ncdhw)
from runtime.levers.cpu.isa import native_bf16
from runtime.levers.cpu.norms import NORM_ACTIVATION_KERNELS, FusedNormActivation, instance_norm_activation

CL = torch.channels_last_3d
FILTERS = (2, 4, 4, 8, 8)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def reference_norm_act(x, norm, activation):
    return activation(norm(x))


def norm_and_input(channels=6, shape=(2, 6, 5, 7, 4), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    norm = nn.InstanceNorm3d(channels, affine=True)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(channels, generator=g))
        norm.bias.copy_(torch.randn(channels, generator=g))
    # channels with their own offsets and scales, as conv outputs have
    x = (torch.randn(shape, generator=g) * torch.rand(1, channels, 1, 1, 1, generator=g) * 3
         + torch.randn(1, channels, 1, 1, 1, generator=g) * 2)
    return norm, x.to(dtype)


FUSED_NORMS = {"plain": instance_norm_activation, "own_backward": FusedNormActivation()}


@pytest.mark.parametrize("fused", FUSED_NORMS)
@pytest.mark.parametrize("activation", [nn.ReLU(), nn.LeakyReLU(0.01)])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("slices_apart", [False, True])
def test_fused_norm_activation_equals_the_modules_fp32(fused, activation, channels_last, slices_apart):
    """``slices_apart``: each depth slice with its own offset (up to 40 standard deviations), so
    that FusedNormActivation's combination of per-slice statistics carries the variance."""
    function = FUSED_NORMS[fused]
    norm, x = norm_and_input()
    if slices_apart:
        x = x + 40 * torch.randn(1, 1, x.shape[2], 1, 1, generator=torch.Generator().manual_seed(5))
    if channels_last:
        x = x.contiguous(memory_format=CL)
    grad = torch.randn_like(x)
    x0 = x.clone().requires_grad_()
    x1 = x.clone().requires_grad_()
    y0 = reference_norm_act(x0, norm, activation)
    y0.backward(grad)
    ref = {"x": x0.grad, "weight": norm.weight.grad.clone(), "bias": norm.bias.grad.clone()}
    norm.zero_grad()
    slope = 0.0 if type(activation) is nn.ReLU else 0.01
    y1 = function(x1, norm.weight, norm.bias, norm.eps, slope)
    y1.backward(grad)
    assert y1.dtype == torch.float32 and y1.is_contiguous(memory_format=CL)  # from either layout
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x1.grad, ref["x"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(norm.weight.grad, ref["weight"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(norm.bias.grad, ref["bias"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fused", FUSED_NORMS)
def test_fused_norm_activation_bf16_within_bf16_precision(fused):
    """A bf16 channels-last input (a bf16 convolution's output): bf16 out, channels-last, within
    bf16's rounding of the float32 norm of the same bf16 values."""
    function = FUSED_NORMS[fused]
    norm, x = norm_and_input(shape=(2, 6, 8, 8, 8), dtype=torch.bfloat16)
    x = x.contiguous(memory_format=CL)
    y = function(x, norm.weight, norm.bias, norm.eps, 0.0)
    exact = torch.relu(norm(x.float()))
    assert y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=CL)
    assert rel_err(y, exact) < 1e-2
    assert (y.float() - exact).abs().max() <= 2 ** -7 * exact.abs().max() + 1e-6


@pytest.mark.parametrize("normalization, activation", [("instancenorm", "relu"), ("instancenorm", "leaky_relu"),
                                                       ("batchnorm", "relu")])
def test_conv_block_is_sequential_bit_for_bit_by_default(normalization, activation):
    torch.manual_seed(0)
    block = conv_block(3, 5, normalization, activation)
    plain = nn.Sequential(*copy.deepcopy(list(block)))
    assert isinstance(block, ConvBlock) and isinstance(block, nn.Sequential)
    assert type(block).forward is nn.Sequential.forward  # no forward of its own: no lever in model/
    assert list(block.state_dict()) == list(plain.state_dict())
    x = torch.randn(2, 3, 6, 6, 6)
    assert torch.equal(block(x), plain(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(block(x), plain(x))


def test_default_network_has_no_fused_norm():
    assert not any(isinstance(m, (FastConvBlock, FastUpsampleBlock)) for m in Unet3D(1, 3, filters=FILTERS).modules())


def test_first_convolution_output_becomes_channels_last():
    """A one-channel input is both layouts; oneDNN gives its convolution an NCDHW output. The
    fused norm makes it channels-last, so that the rest of the network runs channels-last."""
    torch.manual_seed(0)
    block = conv_block(1, 4, "instancenorm", "relu").to(memory_format=CL)
    x = torch.randn(1, 1, 8, 8, 8).contiguous(memory_format=CL)
    assert not block[0](x).is_contiguous(memory_format=CL)
    expected = nn.Sequential(*list(block))(x)
    block = adopt(block, FastConvBlock, norm_activation=instance_norm_activation)
    got = block(x)
    assert got.is_contiguous(memory_format=CL)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_conv_block_takes_the_fused_norm_for_instance_norm_only():
    torch.manual_seed(0)
    block = conv_block(3, 5, "instancenorm", "leaky_relu").to(memory_format=CL)
    calls = []

    def fused(*args):
        calls.append(args[3:])
        return instance_norm_activation(*args)

    x = torch.randn(2, 3, 6, 6, 6)
    expected = nn.Sequential(*list(block))(x)
    block = adopt(block, FastConvBlock, norm_activation=fused)
    got = block(x.contiguous(memory_format=CL))
    assert calls == [(1e-5, 0.01)]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # batch norm blocks keep their modules (running statistics)
    bn = adopt(conv_block(3, 5, "batchnorm", "relu").to(memory_format=CL), FastConvBlock, norm_activation=fused)
    bn(x.contiguous(memory_format=CL))
    assert len(calls) == 1


def forward_backward(model, image, label):
    model.zero_grad(set_to_none=True)
    logits = model(image)
    loss = DiceCELoss()(logits, label)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_channels_last_network_with_fused_norms_equals_ncdhw_fp32():
    torch.manual_seed(0)
    plain = Unet3D(1, 3, filters=FILTERS, activation="leaky_relu")
    fast = copy.deepcopy(plain).to(memory_format=CL)
    assert fuse_norms(fast, instance_norm_activation) == 2 + 2 * 5 + 2 * 5
    assert gemm_transposed_convolutions(fast) == 5
    assert fast.state_dict().keys() == plain.state_dict().keys()
    g = torch.Generator().manual_seed(1)
    image = torch.randn(2, 1, 64, 64, 32, generator=g)
    label = torch.randint(0, 3, (2, 1, 64, 64, 32), generator=g, dtype=torch.uint8)
    logits0, loss0, grads0 = forward_backward(plain, image, label)
    logits1, loss1, grads1 = forward_backward(fast, image.contiguous(memory_format=CL), label)
    assert rel_err(logits1, logits0) < 1e-5
    assert abs(float(loss1 - loss0)) < 1e-5
    # the oracle: the same network in float64; the fused float32 network is as close to it as the
    # modules' float32 network (float32 summation orders differ; the U-Net's backward amplifies)
    _, _, exact = forward_backward(copy.deepcopy(plain).double(), image.double(), label)
    flat0, flat1, flat64 = (torch.cat([g.flatten() for g in grads.values()]) for grads in (grads0, grads1, exact))
    assert rel_err(flat1, flat64) < 2 * rel_err(flat0, flat64) + 1e-6
    assert rel_err(flat1, flat0) < 1e-3


def test_fused_norm_relu_is_relu_exactly():
    """The fused norm's ReLU (``where(y > 0, y, 0)``) gives F.relu's values (+0, not -0) and
    gradient bit for bit, also where the normalised value is exactly 0 (a constant channel with no
    bias: ReLU's gradient there is 0, where a clamp's would be 1)."""
    norm, x = norm_and_input(shape=(1, 6, 4, 4, 4))
    with torch.no_grad():
        norm.bias[0] = 0.0
        x[:, 0] = 1.5
    grad = torch.randn_like(x)
    results = []
    for function in (lambda *a: instance_norm_activation(*a, 0.0), lambda *a: torch.relu(_plain_norm(*a))):
        xi = x.clone().requires_grad_()
        weight = norm.weight.detach().clone().requires_grad_()
        y = function(xi, weight, norm.bias.detach(), norm.eps)
        y.backward(grad)
        results.append((y, xi.grad, weight.grad))
    assert (results[0][0][:, 0] == 0).all() and (results[0][0] > 0).any()
    assert results[1][2][0] == 0                      # no gradient through the exact zeros
    for mine, relu in zip(*results):
        assert torch.equal(mine, relu) and torch.equal(mine.signbit(), relu.signbit())


def _plain_norm(x, weight, bias, eps):
    """The fused function's normalisation before its activation, written out (float32)."""
    var, mean = torch.var_mean(x.float(), dim=(2, 3, 4), keepdim=True, correction=0)
    return (x.float() - mean) * (torch.rsqrt(var + eps) * weight.view(1, -1, 1, 1, 1)) + bias.view(1, -1, 1, 1, 1)


@pytest.mark.parametrize("layout", [CL, torch.contiguous_format])
def test_transposed_conv_as_gemm_equals_conv_transpose3d(layout):
    """The oracle is PyTorch's own transposed convolution, in float64: values and the gradients of
    input, weight and bias; the output is channels-last whatever the input's layout."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 3, 4, 5, generator=g, dtype=torch.float64).contiguous(memory_format=layout)
    weight = torch.randn(6, 5, 2, 2, 2, generator=g, dtype=torch.float64)
    bias = torch.randn(5, generator=g, dtype=torch.float64)
    grad = torch.randn(2, 5, 6, 8, 10, generator=g, dtype=torch.float64)
    results = []
    for function in (lambda *a: torch.nn.functional.conv_transpose3d(*a, stride=2), transposed_conv_as_gemm):
        inputs = [t.clone().requires_grad_() for t in (x, weight, bias)]
        y = function(*inputs)
        y.backward(grad)
        results.append((y, *(t.grad for t in inputs)))
    assert results[1][0].shape == (2, 5, 6, 8, 10) and results[1][0].is_contiguous(memory_format=CL)
    for mine, oracle in zip(results[1], results[0]):
        torch.testing.assert_close(mine, oracle, rtol=1e-12, atol=1e-12)
    # a wrong block order (i and k swapped) is caught: the test can fail
    swapped = transposed_conv_as_gemm(x, weight.transpose(2, 4), bias)
    assert not torch.allclose(swapped, results[0][0])


def test_transposed_conv_as_gemm_in_bf16_autocast():
    g = torch.Generator().manual_seed(4)
    block = UpsampleBlock(8, 4, "instancenorm", "relu")
    x = torch.randn(1, 8, 4, 4, 4, generator=g).contiguous(memory_format=CL)
    transposed = block.upsample_conv[0]
    exact = transposed(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = transposed_conv_as_gemm(x, transposed.weight, transposed.bias)
    assert y.dtype == torch.bfloat16 and rel_err(y, exact) < 2e-2


def test_transposed_as_gemm_only_for_channels_last_cpu_training():
    cpu = torch.device("cpu")
    for cfg, device, count in ((train_config(), cpu, 0), (train_config(channels_last=True), torch.device("meta"), 0),
                               (train_config(channels_last=True), cpu, 5),
                               (train_config(channels_last=True, normalization="batchnorm"), cpu, 5)):
        model = Unet3D(1, 3, normalization=cfg.normalization, filters=FILTERS)
        levers = apply_as_resolved(model, cfg, device, convert.GEMM_TRANSPOSED)
        assert (convert.GEMM_TRANSPOSED in levers) is bool(count)
        assert [getattr(m, "transposed_as_gemm", False) for m in model.modules()
                if isinstance(m, UpsampleBlock)] == [bool(count)] * 5


@pytest.mark.parametrize("bias", [True, False])
def test_conv_of_concatenation_equals_the_convolution_of_the_concatenated_tensor(bias):
    """The oracle is ``conv3d`` of ``torch.cat`` in float64: values and the gradients of both
    parts, the weight and the bias."""
    g = torch.Generator().manual_seed(5)
    conv = nn.Conv3d(8, 4, 3, padding=1, bias=bias).double()
    parts = [torch.randn(2, c, 3, 4, 5, generator=g, dtype=torch.float64).contiguous(memory_format=CL) for c in (3, 5)]
    grad = torch.randn(2, 4, 3, 4, 5, generator=g, dtype=torch.float64)
    results = []
    for function in (lambda a, b: conv(torch.cat((a, b), dim=1)), lambda a, b: conv_of_concatenation(conv, (a, b))):
        conv.zero_grad()
        inputs = [t.clone().requires_grad_() for t in parts]
        function(*inputs).backward(grad)
        results.append([function(*parts), *(t.grad for t in inputs)] + [p.grad.clone() for p in conv.parameters()])
    for mine, oracle in zip(results[1], results[0]):
        torch.testing.assert_close(mine, oracle, rtol=1e-12, atol=1e-12)
    # the parts in the wrong order are caught (the test can fail); parts of the wrong width are refused
    assert not torch.allclose(conv_of_concatenation(conv, parts[::-1]), results[0][0])
    with pytest.raises(ValueError, match="parts of 6 channels for a 8-channel"):
        conv_of_concatenation(conv, (parts[0], parts[0]))


def test_upsample_block_with_split_concatenation_equals_the_module_path(monkeypatch):
    """Float64, the whole block forward and backward (transposed convolution as GEMM, both
    convolution blocks with their norms): the same values and gradients as the default path,
    which concatenates and the split path does not."""
    concatenations = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: concatenations.append(1) or real_cat(*a, **k))
    g = torch.Generator().manual_seed(6)
    block = UpsampleBlock(8, 4, "instancenorm", "relu").double()
    x = torch.randn(2, 8, 3, 3, 3, generator=g, dtype=torch.float64).contiguous(memory_format=CL)
    skip = torch.randn(2, 4, 6, 6, 6, generator=g, dtype=torch.float64).contiguous(memory_format=CL)
    grad = torch.randn(2, 4, 6, 6, 6, generator=g, dtype=torch.float64)
    results = []
    fast = split_upsample_block(block)
    fast.transposed_as_gemm = True
    for split, module in ((False, block), (True, fast)):
        module.zero_grad()
        inputs = [t.clone().requires_grad_() for t in (x, skip)]
        concatenations.clear()
        y = module(*inputs)
        y.backward(grad)
        assert len(concatenations) == (0 if split else 1)
        results.append([y, *(t.grad for t in inputs)] + [p.grad.clone() for p in module.parameters()])
    for mine, oracle in zip(results[1], results[0]):
        torch.testing.assert_close(mine, oracle, rtol=1e-10, atol=1e-10)


def test_conv_of_concatenation_keeps_the_bf16_guard():
    """A guarded convolution over 2-deep parts runs each part in float32 outside autocast (the
    faulty bf16 weight-gradient kernel avoided), deeper parts in bf16."""
    from runtime.levers.cpu.bf16_guard import protect_shallow_convolutions

    holder = nn.Sequential(nn.Conv3d(8, 4, 3, padding=1, bias=False))
    protect_shallow_convolutions(holder)
    conv = holder[0]
    for depth, dtype in ((2, torch.float32), (4, torch.bfloat16)):
        parts = (torch.randn(1, 4, depth, 4, 4), torch.randn(1, 4, depth, 4, 4))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert conv_of_concatenation(conv, parts).dtype == dtype
            assert conv(torch.cat(parts, dim=1)).dtype == dtype


def test_split_concatenation_only_for_float32_channels_last_cpu_training(capsys):
    cpu = torch.device("cpu")
    for cfg, device, count in ((train_config(), cpu, 0), (train_config(channels_last=True), torch.device("meta"), 0),
                               (train_config(channels_last=True, amp=True, amp_dtype="bf16"), cpu, 0),
                               (dataclasses.replace(train_config(channels_last=True), exec_mode="evaluate"), cpu, 0),
                               (train_config(channels_last=True), cpu, 5)):
        model = Unet3D(1, 3, filters=FILTERS)
        levers = apply_as_resolved(model, cfg, device, convert.SPLIT_CONCATENATION, say=True)
        assert (convert.SPLIT_CONCATENATION in levers) is bool(count)
        assert [getattr(m, "split_concatenation", False) for m in model.modules()
                if isinstance(m, UpsampleBlock)] == [bool(count)] * 5
    assert capsys.readouterr().out.count("\n") == 1


def test_channels_last_network_with_split_concatenations_and_widest_blocks_in_ncdhw_equals_ncdhw():
    """Float64, the whole network forward and backward as float32 channels-last CPU training lays
    it out (GEMM transposed convolutions, split concatenations, the widest blocks in NCDHW; the
    norms as modules, since the fused one computes in float32): the NCDHW network's logits and
    every gradient (float64 convolutions return NCDHW whatever they read: the layouts themselves
    are checked in float32 below)."""
    torch.manual_seed(0)
    plain = Unet3D(1, 3, filters=FILTERS).double()
    fast = copy.deepcopy(plain).to(memory_format=CL)
    gemm_transposed_convolutions(fast)
    split_concatenations(fast)
    chosen = len(widest_blocks_in_ncdhw(fast))
    blocks = {name: m for name, m in fast.named_modules() if isinstance(m, ConvBlock)}
    assert chosen == sum(b[0].out_channels == max(FILTERS) for b in blocks.values()) > 0
    for name, block in blocks.items():
        ncdhw = getattr(block, "ncdhw", False)
        assert block[0].weight.is_contiguous(memory_format=torch.contiguous_format if ncdhw else CL), name
    g = torch.Generator().manual_seed(1)
    image = torch.randn(2, 1, 64, 64, 32, generator=g, dtype=torch.float64)
    label = torch.randint(0, 3, (2, 1, 64, 64, 32), generator=g, dtype=torch.uint8)
    logits0, loss0, grads0 = forward_backward(plain, image, label)
    logits1, loss1, grads1 = forward_backward(fast, image.contiguous(memory_format=CL), label)
    torch.testing.assert_close(logits1, logits0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(loss1, loss0, rtol=1e-12, atol=1e-12)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-9, atol=1e-11, msg=name)


def test_ncdhw_block_reads_ncdhw_in_a_channels_last_network():
    """Float32: a block in NCDHW gives its convolution an NCDHW input and weight (the parts of a
    concatenation concatenated) and computes what the channels-last block computes."""
    g = torch.Generator().manual_seed(2)
    block = adopt(conv_block(8, 4, "instancenorm", "relu").to(memory_format=CL), FastConvBlock)
    parts = tuple(torch.randn(2, 4, 6, 5, 4, generator=g).contiguous(memory_format=CL) for _ in range(2))
    seen = []
    block[0].register_forward_hook(lambda m, i, o: seen.append(
        (i[0].is_contiguous(), o.is_contiguous(memory_format=CL), m.weight.is_contiguous())))
    expected = block(torch.cat(parts, dim=1))
    block.set_ncdhw(True)
    got = block(parts)
    assert seen == [(False, True, False), (True, False, True)]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_set_ncdhw_moves_the_weight_and_back():
    block = adopt(conv_block(4, 8, "instancenorm", "relu").to(memory_format=CL), FastConvBlock)
    weight = block[0].weight
    block.set_ncdhw(True)
    assert block.ncdhw and block[0].weight is weight and weight.is_contiguous()
    block.set_ncdhw(False)
    assert not block.ncdhw and weight.is_contiguous(memory_format=CL) and not weight.is_contiguous()


def test_widest_blocks_in_ncdhw_only_for_float32_channels_last_cpu_training(capsys):
    """The known answer for the benchmark's network: the six convolutions with 320 filters (the
    last downsampling level, the bottleneck, the first upsampling level), nothing else; only in
    float32 channels-last CPU training."""
    cpu = torch.device("cpu")
    widest = ["downsample.3.conv1", "downsample.3.conv2", "bottleneck.conv1", "bottleneck.conv2",
              "upsample.0.conv1", "upsample.0.conv2"]
    for cfg, device, expected in ((train_config(), cpu, []), (train_config(channels_last=True), torch.device("meta"), []),
                                  (train_config(channels_last=True, amp=True, amp_dtype="bf16"), cpu, []),
                                  (dataclasses.replace(train_config(channels_last=True), exec_mode="evaluate"), cpu, []),
                                  (train_config(channels_last=True), cpu, widest)):
        with torch.device("meta"):
            model = Unet3D().to(memory_format=CL)
        levers = apply_as_resolved(model, cfg, device, convert.WIDEST_NCDHW, say=True, filters=DEFAULT_FILTERS)
        assert (convert.WIDEST_NCDHW in levers) is bool(expected)
        ncdhw = [n for n, m in model.named_modules() if isinstance(m, ConvBlock) and getattr(m, "ncdhw", False)]
        assert ncdhw == expected
        for name, m in model.named_modules():
            if isinstance(m, ConvBlock) and m[0].in_channels > 1:
                assert m[0].weight.is_contiguous(memory_format=torch.contiguous_format if name in ncdhw else CL), name
    assert capsys.readouterr().out == ("channels-last float32: the 6 convolutions with 320 filters (the deepest "
                                       "levels) in NCDHW\n")


# ---------------------------------------------------------------------------- CPU precision


@pytest.mark.parametrize("flags, cap, native", [
    ({"avx2", "avx512f", "avx512_bf16"}, "", True),
    ({"avx2", "amx_bf16", "amx_tile"}, "", True),
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX2", False),
    ({"avx2", "avx512f", "avx512_bf16"}, "avx512_core", False),
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX512_CORE_BF16", True),
    ({"avx2", "fma", "avx512f", "avx512_vnni"}, "", False),
    ({"avx2", "fma"}, "", False),
    (set(), "", False),
])
def test_native_bf16_from_flags_and_the_onednn_cap(flags, cap, native):
    got, why = native_bf16(flags, cap)
    assert got is native and why and "\n" not in why
    if cap and not native and flags & {"avx512_bf16"}:
        assert cap in why


def train_config(**changes):
    return dataclasses.replace(Config(loader="synthetic", exec_mode="train"), **changes)


def apply_as_resolved(model, cfg, device, lever, say=False, filters=FILTERS):
    """The levers ``runtime.resolve`` chooses for ``cfg`` on ``device`` (its AMP type as given);
    ``lever`` applied to ``model`` (and its line said) when among them. Returns the names."""
    levers = convert.choose_levers(cfg.mode.trains, device.type, cfg.channels_last, cfg.amp_dtype if cfg.amp else None,
                                   cfg.normalization, cfg.compile, filters)
    for chosen in levers:
        if chosen.name == lever and chosen.applied:
            if say:
                print(chosen.why)
            convert.apply_levers(model, (lever,), cfg.compile)
    return [chosen.name for chosen in levers if chosen.applied]


@pytest.mark.parametrize("native", [True, False])
def test_amp_trains_in_bf16_only_with_native_bf16(monkeypatch, capsys, native):
    from runtime import resolve

    monkeypatch.setattr(resolve, "native_bf16", lambda: (native, "because"))
    cfg = train_config(amp=True, amp_dtype="bf16")
    amp, _, precision = resolve.decide_amp(cfg.amp, cfg.amp_dtype, cfg.int8, cfg.mode.trains, torch.device("cpu"))
    assert capsys.readouterr().out == ""  # pure: the run says the line once the plan is built
    line = precision.why
    assert amp is native and line.count("\n") == 0 and "because" in line
    assert ("float32" in line) is not native
    assert resolve.trains_bf16_on_cpu(cfg.mode.trains, cfg.amp, "bf16", torch.device("cpu"))
    # fp32 runs, other devices and evaluation are not touched (nothing said)
    for cfg, device in ((train_config(), "cpu"), (train_config(amp=True, amp_dtype="bf16"), "meta"),
                        (dataclasses.replace(cfg, exec_mode="evaluate"), "cpu")):
        amp, amp_dtype, decision = resolve.decide_amp(cfg.amp, cfg.amp_dtype, cfg.int8, cfg.mode.trains,
                                                      torch.device(device))
        assert amp is cfg.amp and amp_dtype == cfg.amp_dtype and decision.why == "", (cfg, device, decision)
        assert not resolve.trains_bf16_on_cpu(cfg.mode.trains, cfg.amp, "bf16", torch.device(device))
    assert capsys.readouterr().out == ""


def test_fused_norms_only_for_channels_last_cpu_instance_norm(monkeypatch):
    monkeypatch.setattr(convert, "compile_function", lambda function, **kwargs: ("compiled", function))
    cpu = torch.device("cpu")
    for cfg, count in ((train_config(), 0), (train_config(channels_last=True, normalization="batchnorm"), 0),
                       (train_config(channels_last=True), 22)):
        model = Unet3D(1, 3, normalization=cfg.normalization, filters=FILTERS)
        apply_as_resolved(model, cfg, cpu, convert.FUSED_NORM)
        assert sum(isinstance(m, FastConvBlock) for m in model.modules()) == count
        functions = {getattr(m, "norm_activation", None) for m in model.modules() if isinstance(m, ConvBlock)}
        if not count:
            assert functions == {None}
            continue
        # one FusedNormActivation for every block, its four kernels each compiled on its own
        (function,) = functions
        assert isinstance(function, FusedNormActivation)
        assert function.kernels == tuple(("compiled", k) for k in NORM_ACTIVATION_KERNELS)
    # the whole model compiled: the plain function, fused inside the model's graph
    model = Unet3D(1, 3, filters=FILTERS)
    apply_as_resolved(model, train_config(channels_last=True, compile=True), cpu, convert.FUSED_NORM)
    assert model.input_block.conv1.norm_activation is instance_norm_activation
    # no torch.compile: the modules stay, and the line says so
    monkeypatch.setattr(convert, "compile_function", lambda function, **kwargs: function)
    model = Unet3D(1, 3, filters=FILTERS)
    assert convert.FUSED_NORM not in apply_as_resolved(model, train_config(channels_last=True), cpu, convert.FUSED_NORM)
    assert not any(isinstance(m, FastConvBlock) for m in model.modules())
    (unavailable,) = [lever for lever in convert.choose_levers(True, "cpu", True, None, "instancenorm", False, FILTERS)
                      if lever.name == convert.FUSED_NORM]
    assert not unavailable.applied and "torch.compile is unavailable" in unavailable.why


@pytest.mark.slow  # torch.compile on the CPU: tens of seconds on two cores
def test_compiled_fused_norm_equals_eager():
    from runtime.compiling import CompiledFunction, compile_function

    fused = compile_function(instance_norm_activation, dynamic=True)
    assert isinstance(fused, CompiledFunction)
    kernels = [compile_function(k, dynamic=True) for k in NORM_ACTIVATION_KERNELS]
    own_backward = FusedNormActivation(kernels)
    for dtype, tol, layout in ((torch.float32, 1e-5, CL), (torch.bfloat16, 1e-2, CL),
                               (torch.float32, 1e-5, torch.contiguous_format)):
        norm, x = norm_and_input(shape=(2, 6, 8, 8, 8), dtype=dtype)
        x = x.contiguous(memory_format=layout)
        grad = torch.randn_like(x)
        outs = []
        for function in (instance_norm_activation, fused, own_backward):
            xi = x.clone().requires_grad_()
            norm.zero_grad()
            y = function(xi, norm.weight, norm.bias, norm.eps, 0.01)
            y.backward(grad)
            outs.append((y, xi.grad, norm.weight.grad.clone()))
        assert fused.compile_failed is None and all(k.compile_failed is None for k in kernels)
        for out in outs[1:]:
            assert out[0].is_contiguous(memory_format=CL)
            assert out[1].is_contiguous(memory_format=CL) or layout is not CL
            for a, b in zip(out, outs[0]):
                assert rel_err(a, b) < tol


def test_allow_recompiles_raises_and_never_lowers_the_limit(monkeypatch):
    import torch._dynamo.config as dynamo_config

    from runtime.compiling import allow_recompiles

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    monkeypatch.setattr(dynamo_config, name, 8)
    allow_recompiles(64)
    assert getattr(dynamo_config, name) == 64
    allow_recompiles(16)
    assert getattr(dynamo_config, name) == 64


def test_fused_norms_ask_for_room_for_every_layer(monkeypatch):
    """Past dynamo's recompile limit (8) the norm of the remaining layers would silently run
    eagerly (0.51x): the fused norm is compiled with a limit of 64 variants."""
    seen = {}
    monkeypatch.setattr(convert, "compile_function", lambda function, **kwargs: seen.update(kwargs) or function)
    convert.apply_levers(Unet3D(1, 3, filters=FILTERS), (convert.FUSED_NORM,), compile=False)
    assert seen["recompile_limit"] >= 64 and seen["dynamic"] is True
