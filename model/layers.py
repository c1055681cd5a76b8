"""Building blocks of the benchmark's "layers-based" UNet3D.

Module names and nesting (``conv1.0`` = convolution, ``conv1.1`` = normalisation) follow the
MLCommons reference so that state_dicts move between the two implementations unchanged.
"""
from __future__ import annotations

import torch
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


class ConvBlock(nn.Sequential):
    """``nn.Sequential(conv, norm, activation)``: the reference's modules and state_dict keys, its
    forward (the CPU's fast variant is ``runtime.levers.cpu.blocks.FastConvBlock``)."""


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


class UpsampleBlock(nn.Module):
    """Transposed convolution (x2), concatenation ``[upsampled, skip]``, two convolutions (the
    CPU's fast variant is ``runtime.levers.cpu.blocks.FastUpsampleBlock``)."""

    def __init__(self, in_channels: int, out_channels: int, normalization: str, activation: str):
        super().__init__()
        self.upsample_conv = nn.Sequential(
            nn.ConvTranspose3d(in_channels, out_channels, kernel_size=2, stride=2, bias=True))
        self.conv1 = conv_block(2 * out_channels, out_channels, normalization, activation)
        self.conv2 = conv_block(out_channels, out_channels, normalization, activation)

    def forward(self, x, skip):
        x = torch.cat((self.upsample_conv(x), skip), dim=1)
        return self.conv2(self.conv1(x))


class OutputLayer(nn.Module):
    """1x1x1 convolution to class logits."""

    def __init__(self, in_channels: int, n_class: int):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, n_class, kernel_size=1, bias=True)

    def forward(self, x):
        return self.conv(x)

