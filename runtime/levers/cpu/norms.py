"""The channels-last instance norm, for training and for inference, in one place.

``nn.InstanceNorm3d`` normalises a ``(1, N·C, D, H, W)`` view, which copies a channels-last tensor
to NCDHW and back: in a channels-last network every convolution/norm pair pays two full-size
layout copies. Here the norm stays in the layout it is given:

- training: :func:`instance_norm_activation` (the norm and its ReLU/LeakyReLU as one formula,
  for a compiled model) and :class:`FusedNormActivation` (the same values with its own backward,
  its four kernels compiled on their own);
- inference: :class:`LayoutPreservingInstanceNorm3d` (float64-combined statistics, see
  :func:`channels_last_moments`).

The two keep their own numerics (training's follows the modules' float32 gradients; inference's
matches ``nn.InstanceNorm3d`` to 1e-7 at a 128³ window); they share the voxel-rows view.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    Element-wise and reductions only, so that ``torch.compile`` makes it one reading pass for the
    statistics and one for the output (likewise backward). The output is channels-last even for
    an NCDHW ``x``: a one-channel input's convolution (the network's first) has an output in
    NCDHW, since a one-channel tensor is both layouts and oneDNN then picks NCDHW; from its norm
    on the network runs channels-last (compiled, the layout change costs no pass of its own)."""
    xf = x.float()
    var, mean = torch.var_mean(xf, dim=(2, 3, 4), keepdim=True, correction=0)
    scale = torch.rsqrt(var + eps) * weight.float().view(1, -1, 1, 1, 1)
    y = (xf - mean) * scale + bias.float().view(1, -1, 1, 1, 1)
    # ReLU written as where(y > 0, y, 0): F.relu's values and gradient (0 at and below 0) exactly;
    # compiled for the CPU, F.relu here kept a boolean mask for its backward whose store made the
    # whole norm 6-10x slower (docs/performance.md, "The fast CPU settings")
    y = F.leaky_relu(y, slope) if slope else torch.where(y > 0, y, 0.0)
    return y.to(x.dtype).contiguous(memory_format=torch.channels_last_3d)


def voxel_rows(t: torch.Tensor) -> torch.Tensor:
    """A 5-D ``(N, C, D, H, W)`` tensor as its ``(N, D, H·W, C)`` view (a view for channels-last
    ``t``): sums over its third dimension are partial sums per depth slice, computed in parallel
    over N·D."""
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
    rows = voxel_rows(x).float()
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
    xhat = (voxel_rows(x).float() - mean) * rstd
    y = xhat * weight.float() + bias.float()
    return voxel_rows(grad).float() * torch.where(y > 0, 1.0, slope), xhat


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
    ``kernels``: :data:`NORM_ACTIVATION_KERNELS`, each compiled on its own
    (:mod:`runtime.levers.cpu.convert`) or eager."""

    def __init__(self, kernels=NORM_ACTIVATION_KERNELS):
        self.kernels = tuple(kernels)

    def __call__(self, x, weight, bias, eps: float, slope: float) -> torch.Tensor:
        return _NormActivation.apply(x, weight, bias, eps, slope, self.kernels)


class LayoutPreservingInstanceNorm3d(nn.Module):
    """Eval-time ``InstanceNorm3d(affine=True)`` that keeps the input's memory format and dtype: a
    stand-in that adopts one (:func:`runtime.levers.cpu.blocks.adopt`: the same parameters and
    state_dict keys).

    Input ``(N, C, D, H, W)`` in NCDHW or channels-last (NDHWC strides), float32 or bfloat16;
    output the same shape, layout and dtype. Per sample and channel: ``(x - mean) / sqrt(var +
    eps) * weight + bias`` with the biased variance over D, H, W, accumulated in float32 (the
    weight and bias stay float32 whatever the input dtype). For an NCDHW input it calls
    ``F.instance_norm`` itself, so the numbers are exactly those of ``nn.InstanceNorm3d``; a
    channels-last input gets its statistics from :func:`channels_last_moments` and one
    ``addcmul`` in its own layout (no layout copy). PyTorch's channels-last batch norm, used here
    before, sums 2 million float32 values per channel in an order that leaves a relative error of
    2-3e-4 at 128³ (``nn.InstanceNorm3d``: 1e-7), enough to change segmentations.
    """

    @staticmethod
    def check_adoptable(norm: nn.Module) -> None:
        if not isinstance(norm, nn.InstanceNorm3d) or not norm.affine or norm.track_running_stats:
            raise ValueError("only InstanceNorm3d(affine=True, track_running_stats=False) is supported")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _is_channels_last(x):
            return F.instance_norm(x, weight=self.weight.float().to(x.dtype), bias=self.bias.float().to(x.dtype),
                                   eps=self.eps)
        mean, var = channels_last_moments(x)
        scale = self.weight.double() * torch.rsqrt(var + self.eps)
        shift = self.bias.double() - mean * scale
        n, c = x.shape[:2]
        return torch.addcmul(shift.to(x.dtype).view(n, c, 1, 1, 1), x,
                             scale.to(x.dtype).view(n, c, 1, 1, 1))


def channels_last_moments(x: torch.Tensor, chunk_elements: int = 1 << 18) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance over D, H, W of a channels-last ``(N, C, D, H, W)`` tensor, each
    ``(N, C)`` float64, without a layout copy.

    The voxels are read as rows of C values in memory order (:func:`voxel_rows`, all slices in
    one), in chunks of about ``chunk_elements`` values (1 MB in float32: they stay in cache): each
    chunk's mean and centred sum of squares in float32 (two passes over cached data), the chunks
    combined in float64 (Chan et al.'s pairwise update). Relative error about 1e-7 however large
    the mean is next to the spread.
    """
    n, c = x.shape[:2]
    rows = voxel_rows(x).flatten(1, 2)
    means, sums_of_squares, counts = [], [], []
    for chunk in rows.split(max(1, chunk_elements // c), dim=1):
        chunk = chunk.float()
        mean = chunk.mean(1, keepdim=True)
        centred = chunk - mean
        means.append(mean.squeeze(1))
        sums_of_squares.append((centred * centred).sum(1))
        counts.append(chunk.shape[1])
    means = torch.stack(means, 1).double()
    count = torch.tensor(counts, dtype=torch.float64).view(1, -1, 1)
    total = rows.shape[1]
    mean = (means * count).sum(1) / total
    spread = torch.stack(sums_of_squares, 1).double().sum(1) + (count * (means - mean[:, None]) ** 2).sum(1)
    return mean, spread / total


def _is_channels_last(x: torch.Tensor) -> bool:
    return (x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d)
            and not x.is_contiguous())
