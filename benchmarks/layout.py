"""Memory layout: the channels-last 3-D format (NDHWC strides, same logical NCDHW shape)."""
from __future__ import annotations

import torch
from torch import nn


def to_channels_last(value):
    """A 5-D tensor in ``torch.channels_last_3d`` (NDHWC strides, same logical NCDHW shape), or a
    module whose 5-D weights are; anything else is returned unchanged."""
    if isinstance(value, nn.Module):
        return value.to(memory_format=torch.channels_last_3d)
    if isinstance(value, torch.Tensor) and value.dim() == 5:
        return value.contiguous(memory_format=torch.channels_last_3d)
    return value
