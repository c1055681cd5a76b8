"""Each decoder's input split in two for OpenVINO int8: the concatenation ``cat([upsampled, skip])``
quantised as one tensor shared one int8 grid between two halves of different ranges."""
from __future__ import annotations

import copy

import torch
from torch import nn

from model.unet3d import Unet3D


class HalvesConv3d(nn.Module):
    """A convolution over ``cat([upsampled, skip], 1)`` as one convolution per half, summed: the
    same function (up to float32 summation order) without the concatenation, each half a tensor
    of its own. For int8 with static ranges (OpenVINO through NNCF): quantised together, the two
    halves share one scale, and the transposed convolution's signed output next to the skip's
    non-negative norm output, each with maxima that change from window to window, left too few
    codes to either (NNCF's accuracy control put every decoder's first convolution back in fp32
    on a trained network; split, none of them). Same multiply-adds."""

    def __init__(self, conv: nn.Conv3d, first_channels: int):
        super().__init__()
        options = dict(kernel_size=conv.kernel_size, stride=conv.stride, padding=conv.padding,
                       dilation=conv.dilation, dtype=conv.weight.dtype, device=conv.weight.device)
        self.upsampled = nn.Conv3d(first_channels, conv.out_channels, bias=False, **options)
        self.skip = nn.Conv3d(conv.in_channels - first_channels, conv.out_channels,
                              bias=conv.bias is not None, **options)
        with torch.no_grad():
            self.upsampled.weight.copy_(conv.weight[:, :first_channels])
            self.skip.weight.copy_(conv.weight[:, first_channels:])
            if conv.bias is not None:
                self.skip.bias.copy_(conv.bias)

    def forward(self, upsampled: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.upsampled(upsampled) + self.skip(skip)


class SplitUpsampleBlock(nn.Module):
    """An ``UpsampleBlock`` whose first convolution is a :class:`HalvesConv3d`: the same
    submodules under the same names, no concatenation."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.upsample_conv = block.upsample_conv
        self.conv1 = block.conv1
        self.conv1[0] = HalvesConv3d(block.conv1[0], block.upsample_conv[0].out_channels)
        self.conv2 = block.conv2

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.conv1[0](self.upsample_conv(x), skip)
        return self.conv2(self.conv1[1:](x))


def split_decoder_inputs(model: nn.Module) -> nn.Module:
    """A copy of a :class:`Unet3D` (eval mode) whose decoder blocks are
    :class:`SplitUpsampleBlock`; other networks are returned unchanged (not copied)."""
    if not isinstance(model, Unet3D):
        return model
    split = copy.deepcopy(model).eval()
    for i, block in enumerate(split.upsample):
        split.upsample[i] = SplitUpsampleBlock(block)
    return split
