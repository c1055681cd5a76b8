"""Building blocks of the benchmark's "layers-based" UNet3D.

Module names and nesting (``conv1.0`` = convolution, ``conv1.1`` = normalisation) follow the
MLCommons reference so that state_dicts move between the two implementations unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NORMALIZATIONS = ("instancenorm", "batchnorm", "syncbatchnorm")
ACTIVATIONS = ("relu", "leaky_relu")


def make_norm(normalization: str, channels: int) -> nn.Module:
    if normalization == "instancenorm":
        return nn.InstanceNorm3d(channels, affine=True)
    if normalization == "batchnorm":
        return nn.BatchNorm3d(channels)
    if normalization == "syncbatchnorm":
        # Built as BatchNorm3d; the runtime converts it with SyncBatchNorm.convert_sync_batchnorm
        # once a process group exists, so the model can be built (and tested) without one.
        return nn.BatchNorm3d(channels)
    raise ValueError(f"unknown normalization {normalization!r}; choose from {NORMALIZATIONS}")


def make_activation(activation: str) -> nn.Module:
    """Not in place, as in the reference: instance norm returns a view, and an in-place
    activation on a view makes autograd clone full-size gradients in extra copy nodes
    (measured: ``git show 2f4d88a:benchmarks/bench_activation.py``); the values are bit-identical
    either way."""
    if activation == "relu":
        return nn.ReLU()
    if activation == "leaky_relu":
        return nn.LeakyReLU(negative_slope=0.01)
    raise ValueError(f"unknown activation {activation!r}; choose from {ACTIVATIONS}")


def negative_slope(activation: nn.Module) -> float | None:
    """The slope below zero of a ReLU (0) or LeakyReLU; None for anything else."""
    if type(activation) is nn.ReLU:
        return 0.0
    if type(activation) is nn.LeakyReLU:
        return float(activation.negative_slope)
    return None


def instance_norm_activation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                             slope: float) -> torch.Tensor:
    """Affine instance norm of a 5-D ``x`` then ReLU (``slope`` 0) or LeakyReLU, computed in float32,
    returned in ``x``'s dtype and always channels-last.

    ``nn.InstanceNorm3d`` normalises a ``(1, N*C, ...)`` view, which copies a channels-last
    tensor to NCDHW and back; this stays in the layout it is given. Element-wise and reductions
    only, so that ``torch.compile`` makes it one reading pass for the statistics and one for the
    output (likewise backward). The output is channels-last even for an NCDHW ``x``: a
    one-channel input's convolution (the network's first) has an output in NCDHW, since a
    one-channel tensor is both layouts and oneDNN then picks NCDHW; from its norm on the network
    runs channels-last (compiled, the layout change costs no pass of its own)."""
    xf = x.float()
    var, mean = torch.var_mean(xf, dim=(2, 3, 4), keepdim=True, correction=0)
    scale = torch.rsqrt(var + eps) * weight.float().view(1, -1, 1, 1, 1)
    y = (xf - mean) * scale + bias.float().view(1, -1, 1, 1, 1)
    # ReLU written as where(y > 0, y, 0): F.relu's values and gradient (0 at and below 0) exactly;
    # compiled for the CPU, F.relu here kept a boolean mask for its backward whose store made the
    # whole norm 6-10x slower (docs/performance.md, "The fast CPU settings")
    y = F.leaky_relu(y, slope) if slope else torch.where(y > 0, y, 0.0)
    return y.to(x.dtype).contiguous(memory_format=torch.channels_last_3d)


def _voxel_rows(t: torch.Tensor) -> torch.Tensor:
    """A 5-D ``(N, C, D, H, W)`` tensor as its ``(N, D, H·W, C)`` view (a view in either layout):
    sums over its third dimension are partial sums per depth slice, computed in parallel over
    N·D."""
    n, c, d, h, w = t.shape
    return t.permute(0, 2, 3, 4, 1).reshape(n, d, h * w, c)


def _from_rows(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``(N, D, H·W, C)`` rows back to ``like``'s 5-D shape, channels-last, in ``like``'s dtype."""
    n, c, d, h, w = like.shape
    t = rows.to(like.dtype).reshape(n, d, h, w, c).permute(0, 4, 1, 2, 3)
    return t.contiguous(memory_format=torch.channels_last_3d)   # a no-op but for eager NCDHW input


def norm_activation_forward(x, weight, bias, eps: float, slope: float):
    """:func:`instance_norm_activation`'s output (channels-last), with the per-sample, per-channel
    mean and 1/std its backward needs (``(N, 1, 1, C)``, float32). The statistics per depth slice,
    then combined (Chan et al.: the mean of the slices' variances plus the variance of their
    means; equal slice sizes)."""
    rows = _voxel_rows(x).float()
    var_d, mean_d = torch.var_mean(rows, dim=2, correction=0, keepdim=True)
    mean = mean_d.mean(dim=1, keepdim=True)
    var = var_d.mean(dim=1, keepdim=True) + ((mean_d - mean) ** 2).mean(dim=1, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    y = (rows - mean) * (rstd * weight.float()) + bias.float()
    y = F.leaky_relu(y, slope) if slope else torch.where(y > 0, y, 0.0)
    return _from_rows(y, x), mean, rstd


def _masked_gradient(x, grad, mean, rstd, weight, bias, slope: float):
    """The gradient at the norm's output (the activation's mask recomputed from ``x``: nothing
    stored) and the normalised input, as rows."""
    xhat = (_voxel_rows(x).float() - mean) * rstd
    y = xhat * weight.float() + bias.float()
    return _voxel_rows(grad).float() * torch.where(y > 0, 1.0, slope), xhat


def norm_activation_grad_sum(x, grad, mean, rstd, weight, bias, slope: float):
    """Σ over the volume of the gradient at the norm's output, ``(N, 1, 1, C)``."""
    g, _ = _masked_gradient(x, grad, mean, rstd, weight, bias, slope)
    return g.sum(dim=2, keepdim=True).sum(dim=1, keepdim=True)


def norm_activation_grad_xhat_sum(x, grad, mean, rstd, weight, bias, slope: float):
    """Σ over the volume of that gradient times the normalised input, ``(N, 1, 1, C)``. Its own
    pass: compiled together with :func:`norm_activation_grad_sum`, the masked gradient was
    written out in float32 and read back (docs/performance.md)."""
    g, xhat = _masked_gradient(x, grad, mean, rstd, weight, bias, slope)
    return (g * xhat).sum(dim=2, keepdim=True).sum(dim=1, keepdim=True)


def norm_activation_grad_input(x, grad, mean, rstd, weight, bias, slope: float, g_sum, gx_sum):
    """The input's gradient (channels-last): ``rstd·w·(g - mean(g) - x̂·mean(g·x̂))``."""
    n, c, d, h, w = x.shape
    voxels = d * h * w
    g, xhat = _masked_gradient(x, grad, mean, rstd, weight, bias, slope)
    return _from_rows((rstd * weight.float()) * (g - g_sum / voxels - xhat * (gx_sum / voxels)), x)


NORM_ACTIVATION_KERNELS = (norm_activation_forward, norm_activation_grad_sum, norm_activation_grad_xhat_sum,
                           norm_activation_grad_input)


class _NormActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, slope, kernels):
        forward, ctx.grad_sum, ctx.grad_xhat_sum, ctx.grad_input = kernels
        y, mean, rstd = forward(x, weight, bias, eps, slope)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.slope = slope
        return y

    @staticmethod
    def backward(ctx, grad):
        x, mean, rstd, weight, bias = ctx.saved_tensors
        grad = grad.contiguous(memory_format=torch.channels_last_3d)
        args = (x, grad, mean, rstd, weight, bias, ctx.slope)
        g_sum, gx_sum = ctx.grad_sum(*args), ctx.grad_xhat_sum(*args)
        grad_x = ctx.grad_input(*args, g_sum, gx_sum)
        reduce = (0, 1, 2)
        return grad_x, gx_sum.sum(reduce).to(weight.dtype), g_sum.sum(reduce).to(bias.dtype), None, None, None


class FusedNormActivation:
    """:func:`instance_norm_activation` (its values and gradients, float32 arithmetic) with its own
    backward. Forward: one reading pass for the statistics (partial sums per depth slice, so that
    both threads work: over the whole volume the reduction runs in parallel over the channels
    only), one for the output. Backward: two reading passes of the input and the output's gradient
    for the two sums over the volume, one for the input's gradient, the activation's mask
    recomputed in each; the compiled formula's own backward wrote the masked gradient out in
    float32 and read it back twice (docs/performance.md, "The fast CPU settings").
    ``kernels``: :data:`NORM_ACTIVATION_KERNELS`, each compiled on its own (``runtime.build``) or
    eager."""

    def __init__(self, kernels=NORM_ACTIVATION_KERNELS):
        self.kernels = tuple(kernels)

    def __call__(self, x, weight, bias, eps: float, slope: float) -> torch.Tensor:
        return _NormActivation.apply(x, weight, bias, eps, slope, self.kernels)


class ConvBlock(nn.Sequential):
    """``nn.Sequential(conv, norm, activation)`` (the reference's modules and state_dict keys).

    With :attr:`norm_activation` set (``runtime.build`` sets a compiled
    :func:`instance_norm_activation` for channels-last training only), an instance-norm block
    computes its norm and ReLU/LeakyReLU with it (channels-last output); otherwise (the default,
    and the NCDHW float32 path that is the reference's bit for bit) the forward is exactly
    ``nn.Sequential``'s. With :attr:`ncdhw` (:func:`set_ncdhw`) its convolution reads its input
    (the parts of a concatenation concatenated) in NCDHW.
    """

    norm_activation = None  # callable(x, weight, bias, eps, slope) or None
    ncdhw = False           # the convolution in NCDHW in a channels-last network: set_ncdhw

    def forward(self, x):
        fused = self.norm_activation
        if self.ncdhw:
            x = (torch.cat(x, dim=1) if isinstance(x, tuple) else x).contiguous()
        if isinstance(x, tuple):              # the parts of a channel concatenation (UpsampleBlock)
            if len(self) != 3:
                return super().forward(torch.cat(x, dim=1))
            x = conv_of_concatenation(self[0], x)
        elif fused is None or len(self) != 3:   # the default (and a block rebuilt by inference code)
            return super().forward(x)
        else:
            x = self[0](x)
        norm, activation = self[1], self[2]
        if fused is not None and type(norm) is nn.InstanceNorm3d and norm.affine and x.dim() == 5:
            slope = negative_slope(activation)
            if slope is not None:
                return fused(x, norm.weight, norm.bias, norm.eps, slope)
        return activation(norm(x))


def conv_of_concatenation(conv: nn.Conv3d, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``conv(torch.cat(parts, dim=1))`` as the sum of one convolution per part (each with the
    weight's matching input channels, the bias in the first): no concatenated tensor, and each
    part gets its gradient whole instead of as a slice of the concatenation's. The same sums in
    another order. Through ``conv._conv_forward``, so a subclass's handling of its input (the bf16
    guard's float32 for shallow inputs) applies to every part."""
    out, start = None, 0
    for part in parts:
        width = part.shape[1]
        y = conv._conv_forward(part, conv.weight[:, start:start + width], conv.bias if start == 0 else None)
        out = y if out is None else out + y
        start += width
    if start != conv.in_channels:
        raise ValueError(f"conv_of_concatenation: parts of {start} channels for a {conv.in_channels}-channel convolution")
    return out


def _set_in_every(model: nn.Module, kind: type, name: str, value) -> int:
    """``module.<name> = value`` for every ``kind`` module of ``model``; returns how many."""
    blocks = [module for module in model.modules() if isinstance(module, kind)]
    for module in blocks:
        setattr(module, name, value)
    return len(blocks)


def set_ncdhw(block: ConvBlock, enabled: bool) -> None:
    """Compute ``block``'s convolution in NCDHW (its weight and input; the norm after it writes
    channels-last again) or, ``enabled`` False, back in channels-last. In a channels-last
    network this is for layers whose weight is large and activations small: PyTorch's
    channels-last convolution backward copies the weight's gradient twice (to a dense tensor,
    then to channels-last), the NCDHW one does not (docs/performance.md). The same convolution
    in another memory layout."""
    block.ncdhw = enabled
    block[0].to(memory_format=torch.contiguous_format if enabled else torch.channels_last_3d)


def set_norm_activation(model: nn.Module, function) -> int:
    """Give every :class:`ConvBlock` of ``model`` the fused norm + activation ``function`` (None:
    the modules again); returns how many blocks."""
    return _set_in_every(model, ConvBlock, "norm_activation", function)


def conv_block(in_channels: int, out_channels: int, normalization: str, activation: str,
               stride: int = 1) -> ConvBlock:
    """3x3x3 convolution (no bias: a norm follows), normalisation, activation."""
    return ConvBlock(
        nn.Conv3d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False),
        make_norm(normalization, out_channels),
        make_activation(activation),
    )


class InputBlock(nn.Module):
    """Two stride-1 convolutions at full resolution."""

    def __init__(self, in_channels: int, out_channels: int, normalization: str, activation: str):
        super().__init__()
        self.conv1 = conv_block(in_channels, out_channels, normalization, activation)
        self.conv2 = conv_block(out_channels, out_channels, normalization, activation)

    def forward(self, x):
        return self.conv2(self.conv1(x))


class DownsampleBlock(nn.Module):
    """Stride-2 convolution (halves every spatial axis), then a stride-1 convolution."""

    def __init__(self, in_channels: int, out_channels: int, normalization: str, activation: str):
        super().__init__()
        self.conv1 = conv_block(in_channels, out_channels, normalization, activation, stride=2)
        self.conv2 = conv_block(out_channels, out_channels, normalization, activation)

    def forward(self, x):
        return self.conv2(self.conv1(x))


def transposed_conv_as_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.conv_transpose3d(x, weight, bias, stride=2)`` for a 2x2x2 kernel, as one matrix
    product, returned channels-last.

    With kernel = stride = 2 the output blocks do not overlap: each input voxel's ``Ci`` values
    times the ``(Ci, 8 * Co)`` weight matrix are its 2x2x2 block of ``Co`` outputs, so the whole
    layer is one GEMM over the channels-last rows of ``x`` (bias added in it) and one copy that
    puts the blocks in place; autograd's backward is that copy back and two GEMMs. The same sums
    as the convolution, in another order. PyTorch's float32 CPU kernel for this layer
    (``slow_conv_transpose3d``) runs at about a third of that rate and returns NCDHW, which made
    the next concatenation and convolution change layout (docs/performance.md)."""
    n, ci, d, h, w = x.shape
    co = weight.shape[1]
    rows = x.permute(0, 2, 3, 4, 1).reshape(-1, ci)                   # a view for channels-last x
    matrix = weight.permute(0, 2, 3, 4, 1).reshape(ci, 8 * co)        # columns (i, j, k, co)
    blocks = torch.addmm(bias.repeat(8), rows, matrix)
    y = blocks.view(n, d, h, w, 2, 2, 2, co).permute(0, 1, 4, 2, 5, 3, 6, 7).reshape(n, 2 * d, 2 * h, 2 * w, co)
    return y.permute(0, 4, 1, 2, 3)                                   # NCDHW shape, channels-last strides


class UpsampleBlock(nn.Module):
    """Transposed convolution (x2), concatenation ``[upsampled, skip]``, two convolutions.

    With :attr:`transposed_as_gemm` set (``runtime.build`` sets it for channels-last CPU
    training only) the transposed convolution is computed by :func:`transposed_conv_as_gemm`;
    with :attr:`split_concatenation` (float32 channels-last CPU training) the first convolution
    by :func:`conv_of_concatenation` of the two parts; otherwise (the default, the reference's
    bit for bit) by their modules on the concatenated tensor."""

    transposed_as_gemm = False
    split_concatenation = False

    def __init__(self, in_channels: int, out_channels: int, normalization: str, activation: str):
        super().__init__()
        self.upsample_conv = nn.Sequential(
            nn.ConvTranspose3d(in_channels, out_channels, kernel_size=2, stride=2, bias=True))
        self.conv1 = conv_block(2 * out_channels, out_channels, normalization, activation)
        self.conv2 = conv_block(out_channels, out_channels, normalization, activation)

    def forward(self, x, skip):
        if self.transposed_as_gemm:
            transposed = self.upsample_conv[0]
            x = transposed_conv_as_gemm(x, transposed.weight, transposed.bias)
        else:
            x = self.upsample_conv(x)
        x = (x, skip) if self.split_concatenation else torch.cat((x, skip), dim=1)
        return self.conv2(self.conv1(x))


def set_transposed_as_gemm(model: nn.Module, enabled: bool) -> int:
    """Switch every :class:`UpsampleBlock` of ``model`` to (or back from) the one-GEMM transposed
    convolution; returns how many blocks."""
    return _set_in_every(model, UpsampleBlock, "transposed_as_gemm", enabled)


def set_split_concatenation(model: nn.Module, enabled: bool) -> int:
    """Switch every :class:`UpsampleBlock` of ``model`` to (or back from) the convolution of its
    concatenation as one convolution per part; returns how many blocks."""
    return _set_in_every(model, UpsampleBlock, "split_concatenation", enabled)


class OutputLayer(nn.Module):
    """1x1x1 convolution to class logits."""

    def __init__(self, in_channels: int, n_class: int):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, n_class, kernel_size=1, bias=True)

    def forward(self, x):
        return self.conv(x)

