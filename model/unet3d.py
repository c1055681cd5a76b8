"""The benchmark's UNet3D (31,190,243 parameters with the default filters)."""
from __future__ import annotations

from typing import Sequence

from torch import nn

from model.layers import DownsampleBlock, InputBlock, OutputLayer, UpsampleBlock

IN_CHANNELS = 1  # the CT intensities
N_CLASSES = 3  # background, kidney, tumour: KiTS19's label values 0, 1, 2
DEFAULT_FILTERS = (32, 64, 128, 256, 320)


def shape_divisor(filters: Sequence[int] = DEFAULT_FILTERS) -> int:
    """Every spatial input size must be a multiple of this: each of the ``len(filters)`` stride-2
    stages (the down blocks and the bottleneck) halves it."""
    return 2 ** len(filters)


SHAPE_DIVISOR = shape_divisor()  # of the benchmark's model (32)


class Unet3D(nn.Module):
    """3-D U-Net for KiTS19 segmentation.

    Input ``(N, in_channels, D, H, W)`` with D, H, W divisible by ``shape_divisor(filters)``;
    output logits ``(N, n_class, D, H, W)``. ``filters`` gives the channel widths of the input
    block and the down blocks; the bottleneck keeps the last width. Building has no side
    effects: the MLPerf ``weights_initialization`` events are logged by the runtime from
    :func:`weight_init_tensor_names`.
    """

    def __init__(self, in_channels: int = IN_CHANNELS, n_class: int = N_CLASSES,
                 normalization: str = "instancenorm", activation: str = "relu",
                 filters: Sequence[int] = DEFAULT_FILTERS):
        super().__init__()
        filters = tuple(filters)
        if len(filters) < 2:
            raise ValueError("filters needs at least two widths")
        self.filters = filters
        self.input_block = InputBlock(in_channels, filters[0], normalization, activation)
        self.downsample = nn.ModuleList(
            DownsampleBlock(i, o, normalization, activation) for i, o in zip(filters[:-1], filters[1:]))
        self.bottleneck = DownsampleBlock(filters[-1], filters[-1], normalization, activation)
        up_in = (filters[-1],) + filters[:0:-1]
        up_out = filters[::-1]
        self.upsample = nn.ModuleList(
            UpsampleBlock(i, o, normalization, activation) for i, o in zip(up_in, up_out))
        self.output = OutputLayer(filters[0], n_class)

    @property
    def divisor(self) -> int:
        """Every spatial size of the input must be a multiple of this."""
        return shape_divisor(self.filters)

    def forward(self, x):
        x = self.input_block(x)
        skips = [x]
        for block in self.downsample:
            x = block(x)
            skips.append(x)
        x = self.bottleneck(x)
        for block, skip in zip(self.upsample, reversed(skips)):
            x = block(x, skip)
        return self.output(x)


def weight_init_tensor_names(n_levels: int = len(DEFAULT_FILTERS),
                             normalization: str = "instancenorm") -> list[str]:
    """Tensor names of the reference's 50 MLPerf ``weights_initialization`` events, in order."""
    norm = normalization.replace("sync", "")

    def block(prefix: str) -> list[str]:
        return [f"{prefix}_block_{i}_{kind}" for i in (0, 1) for kind in ("conv", norm)]

    names = [f"input_block_{i}_{kind}" for i in (0, 1) for kind in ("conv", norm)]
    for idx in range(n_levels):  # the bottleneck is the last "down" block in these names
        names += block(f"down{idx}")
    for idx in range(n_levels):
        names += [f"up{idx}_deconv"] + block(f"up{idx}")
    names.append("output_conv")
    return names
