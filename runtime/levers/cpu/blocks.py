"""The network's fast blocks and the one way the levers specialise a network.

:func:`adopt` makes a module an instance of a subclass of its class that takes over its
parameters, buffers and children (the same ``Parameter`` objects, the same state_dict keys);
:func:`swap` does that for every chosen submodule, in place. Training converts its model in
place, the inference copy a deep copy, the bf16 guard and the OpenVINO decoder split likewise.
The plain classes of ``model/`` know nothing of these subclasses.
"""
from __future__ import annotations

import copy
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from model.layers import ConvBlock, UpsampleBlock
from runtime.levers.cpu.norms import negative_slope

M = TypeVar("M", bound=nn.Module)


def adopt(module: nn.Module, cls: type[M], **attributes) -> M:
    """``module`` as an instance of ``cls``: the same parameters, buffers and children under the
    same names, with ``attributes`` set. ``cls`` is a subclass of ``module``'s class (or that
    class), or a stand-in that says which modules it serves (``check_adoptable(module)`` raising
    ``ValueError`` for the others)."""
    check = getattr(cls, "check_adoptable", None)
    if check is not None:
        check(module)
    elif not issubclass(cls, type(module)):
        raise TypeError(f"a {cls.__name__} cannot adopt a {type(module).__name__}: not its subclass")
    new = cls.__new__(cls)
    # the registries copied (not shared), their entries (parameters, children, hooks) kept
    new.__dict__.update({k: copy.copy(v) if isinstance(v, (dict, set)) else v for k, v in module.__dict__.items()})
    for name, value in attributes.items():
        setattr(new, name, value)
    return new


def swap(model: nn.Module, replace: Callable[[nn.Module], nn.Module | None]) -> int:
    """Every submodule of ``model`` (not ``model`` itself) for which ``replace`` returns a module
    replaced by it in its parent, in place, then its children visited; returns how many."""
    count = 0
    for name, child in list(model.named_children()):
        new = replace(child)
        if new is not None:
            setattr(model, name, new)
            child, count = new, count + 1
        count += swap(child, replace)
    return count


def conv_of_concatenation(conv: nn.Conv3d, parts: tuple[torch.Tensor, ...],
                          weights: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """``conv(torch.cat(parts, dim=1))`` as the sum of one convolution per part (each with the
    weight's matching input channels, the bias in the first): no concatenated tensor, and each
    part gets its gradient whole instead of as a slice of the concatenation's. The same sums in
    another order. Through ``conv._conv_forward``, so a subclass's handling of its input (the bf16
    guard's float32 for shallow inputs) applies to every part. ``weights``: a tensor of its own
    per part instead of slices of ``conv.weight`` (:func:`split_decoder_inputs`)."""
    out, start = None, 0
    for i, part in enumerate(parts):
        width = part.shape[1]
        weight = conv.weight[:, start:start + width] if weights is None else weights[i]
        y = conv._conv_forward(part, weight, conv.bias if start == 0 else None)
        out = y if out is None else out + y
        start += width
    if start != conv.in_channels:
        raise ValueError(f"conv_of_concatenation: parts of {start} channels for a {conv.in_channels}-channel convolution")
    return out


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


class FastConvBlock(ConvBlock):
    """A :class:`~model.layers.ConvBlock` with the CPU's levers; with none set, its forward is
    ``nn.Sequential``'s.

    - :attr:`norm_activation` (callable ``(x, weight, bias, eps, slope)``): an affine instance
      norm and its ReLU/LeakyReLU computed by it (channels-last output); other norms keep their
      modules (batch norm's running statistics);
    - :attr:`ncdhw` (:meth:`set_ncdhw`): the convolution reads its input (the parts of a
      concatenation concatenated) and weight in NCDHW;
    - the input may be the parts of a channel concatenation (:class:`FastUpsampleBlock`), each
      convolved on its own (:func:`conv_of_concatenation`, with :attr:`part_weights` if set).
    """

    norm_activation = None
    ncdhw = False
    part_weights: tuple[torch.Tensor, ...] | None = None

    def forward(self, x):
        conv, norm, activation = self
        if self.ncdhw:
            x = (torch.cat(x, dim=1) if isinstance(x, tuple) else x).contiguous()
        x = conv_of_concatenation(conv, x, self.part_weights) if isinstance(x, tuple) else conv(x)
        fused = self.norm_activation
        if fused is not None and type(norm) is nn.InstanceNorm3d and norm.affine and x.dim() == 5:
            slope = negative_slope(activation)
            if slope is not None:
                return fused(x, norm.weight, norm.bias, norm.eps, slope)
        return activation(norm(x))

    def set_ncdhw(self, enabled: bool) -> None:
        """Compute the convolution in NCDHW (its weight and input; the norm after it writes
        channels-last again) or, ``enabled`` False, back in channels-last. In a channels-last
        network this is for layers whose weight is large and activations small: PyTorch's
        channels-last convolution backward copies the weight's gradient twice (to a dense tensor,
        then to channels-last), the NCDHW one does not (docs/performance.md). The same
        convolution in another memory layout."""
        self.ncdhw = enabled
        self[0].to(memory_format=torch.contiguous_format if enabled else torch.channels_last_3d)


class FastUpsampleBlock(UpsampleBlock):
    """An :class:`~model.layers.UpsampleBlock` with the CPU's levers; with none set, its forward
    is the plain block's.

    - :attr:`transposed_as_gemm`: the transposed convolution by :func:`transposed_conv_as_gemm`;
    - :attr:`split_concatenation`: no concatenation; its first convolution block (a
      :class:`FastConvBlock`) convolves the two parts (:func:`split_concatenations`)."""

    transposed_as_gemm = False
    split_concatenation = False

    def forward(self, x, skip):
        if self.transposed_as_gemm:
            transposed = self.upsample_conv[0]
            x = transposed_conv_as_gemm(x, transposed.weight, transposed.bias)
        else:
            x = self.upsample_conv(x)
        x = (x, skip) if self.split_concatenation else torch.cat((x, skip), dim=1)
        return self.conv2(self.conv1(x))


def fuse_norms(model: nn.Module, function) -> int:
    """Every :class:`~model.layers.ConvBlock` of ``model`` a :class:`FastConvBlock` with the
    fused norm + activation ``function``; returns how many blocks."""
    return swap(model, lambda m: adopt(m, FastConvBlock, norm_activation=function)
                if isinstance(m, ConvBlock) else None)


def gemm_transposed_convolutions(model: nn.Module) -> int:
    """Every :class:`~model.layers.UpsampleBlock` of ``model`` with its transposed convolution as
    one GEMM; returns how many blocks."""
    return swap(model, lambda m: adopt(m, FastUpsampleBlock, transposed_as_gemm=True)
                if isinstance(m, UpsampleBlock) else None)


def split_upsample_block(block: UpsampleBlock, part_weights: bool = False) -> FastUpsampleBlock:
    """``block`` with its concatenation split (:class:`FastUpsampleBlock`); ``part_weights``: its
    first convolution gets a weight tensor of its own per part (copies of the weight's slices),
    which the OpenVINO conversion sees as two convolutions."""
    split = adopt(block, FastUpsampleBlock, split_concatenation=True)
    weights = None
    if part_weights:
        conv, first = split.conv1[0], split.upsample_conv[0].out_channels
        weights = (conv.weight[:, :first].detach().clone(), conv.weight[:, first:].detach().clone())
    split.conv1 = adopt(split.conv1, FastConvBlock, **({"part_weights": weights} if part_weights else {}))
    return split


def split_concatenations(model: nn.Module) -> int:
    """Every :class:`~model.layers.UpsampleBlock` of ``model`` with the convolution after its
    concatenation as one convolution per part, summed; returns how many blocks."""
    return swap(model, lambda m: split_upsample_block(m) if isinstance(m, UpsampleBlock) else None)


def widest_blocks_in_ncdhw(model: nn.Module) -> list[str]:
    """The convolution blocks of ``model`` at its widest filter count (the deepest levels: the
    largest weights, the fewest voxels) in NCDHW (:meth:`FastConvBlock.set_ncdhw`); returns
    their names."""
    blocks = [m for m in model.modules() if isinstance(m, ConvBlock)]
    widest = max(block[0].out_channels for block in blocks)
    chosen = []

    def to_ncdhw(m: nn.Module):
        if not (isinstance(m, ConvBlock) and m[0].out_channels == widest):
            return None
        block = adopt(m, FastConvBlock)
        block.set_ncdhw(True)
        chosen.append(block)
        return block

    swap(model, to_ncdhw)
    names = {id(m): name for name, m in model.named_modules()}
    return [names[id(block)] for block in chosen]


SHALLOW_DEPTH = 2  # the input depth at which oneDNN's faulty bf16 weight-gradient kernel is chosen


class ShallowFloatConv3d(nn.Conv3d):
    """A ``Conv3d`` that runs in float32, outside autocast, when its input is at most
    :data:`SHALLOW_DEPTH` deep; otherwise exactly ``nn.Conv3d`` (the bf16 guard:
    :mod:`runtime.levers.cpu.bf16_guard`). In ``_conv_forward``, which ``forward`` calls with the
    module's weight and :func:`conv_of_concatenation` with slices of it."""

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.device.type != "cpu" or x.shape[2] > SHALLOW_DEPTH:
            return super()._conv_forward(x, weight, bias)
        with torch.autocast("cpu", enabled=False):
            return F.conv3d(x.float(), weight.float(), None if bias is None else bias.float(), self.stride,
                            self.padding, self.dilation, self.groups)


def _cpu_autocast_enabled() -> bool:
    try:  # torch 2.4+
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch 2.3: no device argument
        return torch.is_autocast_cpu_enabled()


class ChannelsLastConv3d(nn.Conv3d):
    """A ``Conv3d`` (same parameters and state_dict keys) whose CPU forward always runs oneDNN's
    convolution, giving a channels-last output.

    On a one-channel input (the image) channels-last and NCDHW strides are the same, so PyTorch
    takes the input as NCDHW, and below its size threshold for oneDNN it runs the im2col
    convolution (``slow_conv3d``) with an NCDHW output: at a 128³ window about 6x oneDNN's time,
    and the norm after it then copies the output to channels-last (docs/performance.md,
    "Overheads of the int8 window"). Elsewhere (CUDA, other dtypes) it is ``nn.Conv3d``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type != "cpu" or x.dtype != torch.float32 or self.padding_mode != "zeros"
                or isinstance(self.padding, str) or not torch.backends.mkldnn.is_available()
                or _cpu_autocast_enabled()):  # autocast's dtype rules apply to nn.Conv3d only
            return super().forward(x)
        return torch.mkldnn_convolution(x, self.weight, self.bias, self.padding, self.stride,
                                        self.dilation, self.groups)
