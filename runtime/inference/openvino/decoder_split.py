"""Each decoder's input split in two for OpenVINO int8: the concatenation ``cat([upsampled, skip])``
quantised as one tensor shared one int8 grid between two halves of different ranges.

The split is the training lever's (:func:`runtime.levers.cpu.blocks.split_upsample_block`): the
convolution after the concatenation as one convolution per half, summed, the same function (up
to float32 summation order) with each half a tensor of its own. For int8 with static ranges
(OpenVINO through NNCF) each half's convolution has a weight tensor of its own: quantised
together, the two halves share one scale, and the transposed convolution's signed output next to
the skip's non-negative norm output, each with maxima that change from window to window, left
too few codes to either (NNCF's accuracy control put every decoder's first convolution back in
fp32 on a trained network; split, none of them). Same multiply-adds.
"""
from __future__ import annotations

import copy

from torch import nn

from model.unet3d import Unet3D
from runtime.levers.cpu.blocks import split_upsample_block


def split_decoder_inputs(model: nn.Module) -> nn.Module:
    """A copy of a :class:`Unet3D` (eval mode) whose decoder blocks convolve the two halves of
    their input apart, each with a weight tensor of its own; other networks are returned
    unchanged (not copied)."""
    if not isinstance(model, Unet3D):
        return model
    split = copy.deepcopy(model).eval()
    for i, block in enumerate(split.upsample):
        split.upsample[i] = split_upsample_block(block, part_weights=True)
    return split
