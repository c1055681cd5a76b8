"""Inference-only forms of a trained UNet3D: the same function, laid out for a fast CPU forward.

:func:`prepare_for_inference` returns a copy of a model (the original is untouched, so training
can go on) with:

* every ``ReLU`` in place (no autograd here, so the norm's output can be overwritten);
* with ``channels_last``, the convolution of the one-channel image run by oneDNN
  (:class:`ChannelsLastConv3d`), so the network is channels-last from its first output;
* every ``InstanceNorm3d`` replaced by :class:`LayoutPreservingInstanceNorm3d`: the same
  statistics and affine map, but a channels-last input gives a channels-last output.
  ``nn.InstanceNorm3d`` makes its input contiguous (NCDHW) to run it as a batch norm over
  ``(1, N·C, D, H, W)``, so in a channels-last network every convolution/norm pair pays two
  full-size layout copies (their share of a forward: docs/performance.md, "What each lever gave");
* optionally (``int8=True``) the 3x3x3 convolutions with at least ``int8_min_channels`` input
  channels replaced by :class:`Int8Conv3d` (oneDNN int8 convolution with float output; see there),
  their inputs' channels equalized per window by the norms before them
  (:func:`equalize_int8_inputs`).

Without int8 the state_dict keys stay those of the reference (``...conv1.1.weight`` and so
on), so a prepared model loads the same checkpoints. The prepared model is for ``eval`` only.
Without int8 it computes the same prediction up to float32 rounding (the norms' statistics to
about 1e-7, as ``nn.InstanceNorm3d``); with int8, with 8-bit rounding (7-bit weights on
CPUs without VNNI/AMX). Speed and agreement, per CPU:
docs/performance.md.
"""
from __future__ import annotations

import copy
import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.unet3d import Unet3D


class LayoutPreservingInstanceNorm3d(nn.Module):
    """Eval-time ``InstanceNorm3d(affine=True)`` that keeps the input's memory format and dtype.

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

    def __init__(self, norm: nn.InstanceNorm3d):
        super().__init__()
        if not norm.affine or norm.track_running_stats:
            raise ValueError("only InstanceNorm3d(affine=True, track_running_stats=False) is supported")
        self.eps = norm.eps
        self.weight = nn.Parameter(norm.weight.detach().float().clone(), requires_grad=False)
        self.bias = nn.Parameter(norm.bias.detach().float().clone(), requires_grad=False)
        self.equalize = False  # set by equalize_int8_inputs: see there
        self.channel_scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.equalize and not _is_channels_last(x):
            return F.instance_norm(x, weight=self.weight.to(x.dtype), bias=self.bias.to(x.dtype),
                                   eps=self.eps)
        if not _is_channels_last(x):  # equalized: the int8 convolution after it wants NDHWC
            x = x.contiguous(memory_format=torch.channels_last_3d)
        mean, var, low, high = channels_last_moments(x, extremes=self.equalize)
        scale = self.weight.double() * torch.rsqrt(var + self.eps)
        shift = self.bias.double() - mean * scale
        if self.equalize:
            divisor = channel_divisors(torch.maximum(scale * low, scale * high) + shift)
            scale, shift = scale / divisor, shift / divisor
            self.channel_scale = divisor.float()
        n, c = x.shape[:2]
        return torch.addcmul(shift.to(x.dtype).view(n, c, 1, 1, 1), x,
                             scale.to(x.dtype).view(n, c, 1, 1, 1))


def channel_divisors(highs: torch.Tensor, strength: float = 0.5, floor: float = 1e-3) -> torch.Tensor:
    """Per-channel divisors ``(C,)`` that bring the channels of a non-negative activation (after
    ReLU) closer to the top of the largest one: ``highs`` ``(N, C)`` are the channels' maxima
    before ReLU; divisor ``(max(high_c, 0) / max_c' high_c') ** strength``, at least ``floor``;
    all ones when nothing is positive. ``strength`` 1 would equalize the channels fully, but it
    moves the whole imbalance into the weights (multiplied back by the divisors, quantized per
    output channel); 0.5 splits it between the two, as SmoothQuant's migration strength does.
    On the trained network's most sensitive convolution the output error of fake-quantized
    arithmetic was, per strength 0 / 0.5 / 1: 0.0079 / 0.0032 / 0.0044 with 8-bit weights and
    0.0079 / 0.0040 / 0.0081 with the 7-bit weights of CPUs without VNNI."""
    top = highs.clamp_min(0).amax(0)
    if float(top.max()) <= 0.0:
        return torch.ones_like(top)
    return ((top / top.max()) ** strength).clamp_min(floor)


def channels_last_moments(x: torch.Tensor, extremes: bool = True,
                          chunk_elements: int = 1 << 18) -> tuple[torch.Tensor, ...]:
    """Mean, biased variance, minimum and maximum (``None`` without ``extremes``; of every 4th
    voxel in memory order) over D, H, W of a channels-last ``(N, C, D, H, W)`` tensor, each
    ``(N, C)`` float64, without a layout copy.

    The voxels are read as rows of C values in memory order, in chunks of about
    ``chunk_elements`` values (1 MB in float32: they stay in cache): each chunk's mean and
    centred sum of squares in float32 (two passes over cached data), the chunks combined in
    float64 (Chan et al.'s pairwise update). Relative error about 1e-7 however large the mean is
    next to the spread.
    """
    n, c = x.shape[:2]
    rows = x.permute(0, 2, 3, 4, 1).reshape(n, -1, c)
    means, sums_of_squares, counts, lows, highs = [], [], [], [], []
    for chunk in rows.split(max(1, chunk_elements // c), dim=1):
        chunk = chunk.float()
        mean = chunk.mean(1, keepdim=True)
        centred = chunk - mean
        means.append(mean.squeeze(1))
        sums_of_squares.append((centred * centred).sum(1))
        counts.append(chunk.shape[1])
        if extremes:  # every 4th voxel: the extremes only choose equalization factors
            lows.append(chunk[:, ::4].amin(1))
            highs.append(chunk[:, ::4].amax(1))
    means = torch.stack(means, 1).double()
    count = torch.tensor(counts, dtype=torch.float64).view(1, -1, 1)
    total = rows.shape[1]
    mean = (means * count).sum(1) / total
    spread = torch.stack(sums_of_squares, 1).double().sum(1) + (count * (means - mean[:, None]) ** 2).sum(1)
    if not extremes:
        return mean, spread / total, None, None
    return mean, spread / total, torch.stack(lows, 1).amin(1).double(), torch.stack(highs, 1).amax(1).double()


def _is_channels_last(x: torch.Tensor) -> bool:
    return (x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d)
            and not x.is_contiguous())


def int8_available() -> str | None:
    """``None`` when this torch has oneDNN's int8 convolution on this CPU, else the reason."""
    try:  # torch.ops namespaces resolve lazily and raise on unknown names
        has_ops = all(hasattr(torch.ops.onednn, op) for op in ("qconv_pointwise", "qconv_prepack"))
    except (AttributeError, RuntimeError):
        has_ops = False
    if not has_ops:
        return f"torch {torch.__version__} has no torch.ops.onednn.qconv_pointwise"
    if not torch.backends.mkldnn.is_available():
        return "this torch is built without oneDNN (mkldnn)"
    return None


@dataclass(frozen=True)
class Int8Grid:
    """The integer grids of an int8 convolution: uint8 activation codes ``0..activation_codes``,
    int8 weight codes ``-weight_max..weight_max``."""

    activation_codes: int
    weight_max: int

    def describe(self) -> str:
        return (f"{bits(self.activation_codes)}-bit activations, "
                f"{bits(self.weight_max) + 1}-bit weights")


def bits(codes: int) -> int:
    return int(codes).bit_length()


FULL_GRID = Int8Grid(255, 127)  # exact where int8 products accumulate in 32 bits (VNNI, AMX)
# Where pairs of products saturate at 16 bits, either grid fits (255 x 63 x 2 = 32,130 and
# 127 x 127 x 2 = 32,258 <= 32,767). 7-bit weights are the one used: on trained weights they
# halved the logits' error of 7-bit activations
# (docs/performance.md, "int8 on CPUs with and without VNNI").
SEVEN_BIT_WEIGHTS = Int8Grid(255, 63)
SEVEN_BIT_ACTIVATIONS = Int8Grid(127, 127)


@functools.lru_cache(maxsize=None)
def int8_grid() -> Int8Grid:
    """The grid this CPU's int8 convolution computes exactly: :data:`FULL_GRID` or
    :data:`SEVEN_BIT_WEIGHTS`.

    With VNNI or AMX, oneDNN accumulates each uint8 x int8 product in int32. Without them
    (AVX2, AVX-512 without VNNI) it uses ``vpmaddubsw``, which adds each pair of products into a
    signed 16-bit value with saturation: 255 x 127 x 2 = 64,770 > 32,767, so full-range codes lose
    up to half of a pair's sum. Decided once per process by a known-answer convolution, not by the
    CPU's name: every activation code 255 and every weight code 127 give exactly ``8 x 27`` at the
    centre voxel when nothing saturates, about half of it when pairs do.
    """
    conv = nn.Conv3d(8, 1, 3, padding=1, bias=False)
    with torch.no_grad():
        conv.weight.fill_(1.0)
        probe = Int8Conv3d(conv, grid=FULL_GRID)
        centre = float(probe(torch.ones(1, 8, 3, 3, 3).contiguous(memory_format=torch.channels_last_3d))
                       [0, 0, 1, 1, 1])
    return FULL_GRID if abs(centre - 8 * 27) < 1e-3 else SEVEN_BIT_WEIGHTS


def int8_path() -> str:
    """One line saying which int8 arithmetic this CPU runs (for the user)."""
    grid = int8_grid()
    if grid == FULL_GRID:
        return (f"int8 convolutions: {grid.describe()} (this CPU accumulates int8 products in "
                f"32 bits: VNNI/AMX)")
    return (f"int8 convolutions: {grid.describe()} (this CPU adds pairs of int8 products in 16 bits "
            f"with saturation, no VNNI/AMX: weights on 7 bits keep every sum exact)")


def quantize_weight(weight: torch.Tensor, weight_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel codes of a convolution weight ``(O, I, kD, kH, kW)``: int8
    ``clamp(round(w / scale), -weight_max, weight_max)`` and the scales ``max|w| / weight_max``."""
    scale = weight.abs().amax(dim=(1, 2, 3, 4)).clamp_min(1e-12) / weight_max
    q = torch.clamp(torch.round(weight / scale[:, None, None, None, None]), -weight_max, weight_max)
    return q.to(torch.int8), scale


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

    @classmethod
    def from_conv(cls, conv: nn.Conv3d) -> "ChannelsLastConv3d":
        new = cls.__new__(cls)
        new.__dict__.update(conv.__dict__)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type != "cpu" or x.dtype != torch.float32 or self.padding_mode != "zeros"
                or isinstance(self.padding, str) or not torch.backends.mkldnn.is_available()
                or _cpu_autocast_enabled()):  # autocast's dtype rules apply to nn.Conv3d only
            return super().forward(x)
        return torch.mkldnn_convolution(x, self.weight, self.bias, self.padding, self.stride,
                                        self.dilation, self.groups)


class Int8Conv3d(nn.Module):
    """A stride-s 3-D convolution computed by oneDNN in int8, with a float output.

    Weights: symmetric int8 per output channel (scale = max|w| / weight_max), packed once. Input:
    asymmetric uint8 per tensor, codes ``0..activation_codes``, its scale and zero point taken from this
    input's own minimum and maximum (dynamic: nothing is calibrated, every window gets its own
    range). The product is accumulated in int32 and rescaled to float32, NDHWC. Input
    ``(N, C, D, H, W)`` float32 (any layout; channels-last avoids a copy); output float32
    channels-last. With VNNI (AVX-512 VNNI) the int8 kernel does four times the multiply-adds per
    instruction of float32. ``grid``: the integer grids, default the one this CPU computes
    exactly (:func:`int8_grid`).
    """

    def __init__(self, conv: nn.Conv3d, grid: Int8Grid | None = None):
        super().__init__()
        self.grid = int8_grid() if grid is None else grid
        if conv.groups != 1 or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ValueError("Int8Conv3d supports groups=1 and numeric zero padding only")
        weight = conv.weight.detach().float()
        self.register_buffer("float_weight", weight.clone(), persistent=False)
        self._set_weight(weight)
        self.register_buffer("bias", None if conv.bias is None else conv.bias.detach().float().clone(),
                             persistent=False)
        self.stride, self.padding = list(conv.stride), list(conv.padding)
        self.dilation = list(conv.dilation)
        self.out_channels = conv.out_channels
        self._packed: dict[tuple, torch.Tensor] = {}
        self._factors: torch.Tensor | None = None  # the input scales folded into q_weight
        # (first input channel, norm): input channels that norm divided by its channel_scale
        # (equalize_int8_inputs); the weight is multiplied back before it is quantized.
        self.scaled_inputs: list[tuple[int, LayoutPreservingInstanceNorm3d]] = []

    def _set_weight(self, weight: torch.Tensor) -> None:
        q, scale = quantize_weight(weight, self.grid.weight_max)
        self.register_buffer("w_scale", scale, persistent=False)
        self.register_buffer("w_zero_point", torch.zeros_like(scale, dtype=torch.int64), persistent=False)
        self.register_buffer("q_weight", q, persistent=False)
        self._packed = {}

    def _fold_input_scales(self) -> None:
        """Quantize ``float_weight`` times this window's input channel scales (each norm's
        ``channel_scale`` of its last forward) when they changed."""
        factors = torch.ones(self.float_weight.shape[1])
        for first, norm in self.scaled_inputs:
            if norm.channel_scale is not None:
                factors[first:first + norm.channel_scale.numel()] = norm.channel_scale
        if self._factors is None or not torch.equal(factors, self._factors):
            self._set_weight(self.float_weight * factors.view(1, -1, 1, 1, 1))
            self._factors = factors

    def _packed_weight(self, shape: tuple[int, ...]) -> torch.Tensor:
        packed = self._packed.get(shape)
        if packed is None:  # oneDNN picks its blocked weight layout for the input shape
            packed = torch.ops.onednn.qconv_prepack(
                self.q_weight.contiguous(memory_format=torch.channels_last_3d), self.w_scale, 1.0, 0,
                self.stride, self.padding, self.dilation, 1, list(shape))
            self._packed = {shape: packed}
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaled_inputs:
            self._fold_input_scales()
        q, scale, zero_point = quantize_uint8(x, self.grid.activation_codes)
        return torch.ops.onednn.qconv_pointwise(
            q, scale, zero_point, self._packed_weight(tuple(x.shape)), self.w_scale,
            self.w_zero_point, self.bias, self.stride, self.padding, self.dilation, 1, 1.0, 0,
            torch.float32, "none", [], "")


def uint8_range(minimum: float, maximum: float, codes: int = 255) -> tuple[float, int]:
    """Scale and zero point of an asymmetric grid of codes ``0..codes`` covering
    ``[min(minimum, 0), max(maximum, 0)]`` (0 exactly representable, as zero padding needs)."""
    low, high = min(minimum, 0.0), max(maximum, 0.0)
    scale = (high - low) / codes
    if scale <= 0.0:
        return 1.0, 0
    return scale, int(min(codes, max(0, round(-low / scale))))


def quantize_uint8(x: torch.Tensor, codes: int = 255) -> tuple[torch.Tensor, float, int]:
    """``x`` (float, any layout) as uint8 codes ``clamp(round(x / scale) + zero_point, 0, codes)``
    in the same layout, with the scale and zero point of :func:`uint8_range` of its range."""
    low, high = torch.aminmax(_flat(x))
    scale, zero_point = uint8_range(float(low), float(high), codes)
    with warnings.catch_warnings():  # torch 2.10+ calls the quantized dtypes deprecated
        warnings.simplefilter("ignore", UserWarning)
        q = uint8_codes(torch.quantize_per_tensor(x.float(), scale, zero_point, torch.quint8))
    if codes < 255:  # two roundings (value, zero point) can reach codes + 1 at the top
        q.clamp_(max=codes)
    return q, scale, zero_point


def uint8_codes(q: torch.Tensor) -> torch.Tensor:
    """The codes of a ``quint8`` tensor as a plain uint8 tensor sharing its memory: what
    ``q.int_repr()`` returns, without its copy (a full pass over every int8 convolution's input)."""
    return torch.empty(0, dtype=torch.uint8).set_(q.untyped_storage(), q.storage_offset(), q.shape, q.stride())


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 1-D view in memory order: reductions over a channels-last tensor's logical
    order copy it to NCDHW first, many times the reduction's own time
    (docs/performance.md, "What each lever gave", int8)."""
    if _is_channels_last(x):
        return x.permute(0, 2, 3, 4, 1).reshape(-1)
    return x.reshape(-1)


def equalize_int8_inputs(net: nn.Module) -> int:
    """Give every channel of an int8 convolution's input the full range of its 8-bit grid.

    An int8 convolution quantizes its whole input on one grid (oneDNN takes one activation scale
    per tensor), so a channel whose values reach 1 next to one that reaches 9 keeps only a ninth
    of the codes: on a trained network that channel imbalance, not the 8 bits, made most of the
    difference from float (the first stride-2 convolution alone changed 1.2% of the foreground
    union). Here each norm whose output goes only to int8 convolutions divides its output
    channels, per window, by :func:`channel_divisors` of their maxima (folded into the norm's own
    scale and shift: ReLU and leaky ReLU commute with a positive factor, so it costs no pass over
    the data), and those convolutions multiply their weights back (re-quantized when the factors
    change). The float function is unchanged; the int8 one sees equalized channels. Links follow
    the UNet3D's wiring (a norm's output feeds its block's second convolution, or the next stage
    and the matching upsample block's convolution as its skip half). The other half of an
    upsample block's input (the transposed convolution's output, no norm) keeps its scale.
    Returns the number of norms linked; 0 for other networks or norms.
    """
    if not isinstance(net, Unet3D):
        return 0
    links = []
    stages = [net.input_block, *net.downsample]
    for block in [*stages, net.bottleneck, *net.upsample]:
        links.append((block.conv1[1], [(block.conv2[0], 0)]))
    following = [*net.downsample, net.bottleneck]
    for i, stage in enumerate(stages):
        up = net.upsample[len(stages) - 1 - i]
        links.append((stage.conv2[1], [(following[i].conv1[0], 0),
                                       (up.conv1[0], up.upsample_conv[0].out_channels)]))
    linked = 0
    for norm, consumers in links:
        if isinstance(norm, LayoutPreservingInstanceNorm3d) and all(
                isinstance(conv, Int8Conv3d) for conv, _ in consumers):
            norm.equalize = True
            for conv, first in consumers:
                conv.scaled_inputs.append((first, norm))
            linked += 1
    return linked


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


def prepare_for_inference(model: nn.Module, channels_last: bool = True, int8: bool = False,
                          int8_min_channels: int = 2, equalize: bool = True) -> nn.Module:
    """An eval-mode copy of ``model`` for fast inference (``model`` itself is not changed).

    ``channels_last``: weights and the norms' outputs NDHWC (feed channels-last inputs).
    ``int8``: 3x3x3 convolutions with at least ``int8_min_channels`` input channels become
    :class:`Int8Conv3d` (the first convolution, on the one-channel image, stays float: it is
    0.4% of the FLOPs and sees raw intensities), their inputs equalized unless ``equalize`` is
    False (:func:`equalize_int8_inputs`; False: one activation grid per input, the way before,
    for comparisons). Raises ``RuntimeError`` with the reason when int8 is asked for and
    unavailable.
    """
    if int8 and int8_available() is not None:
        raise RuntimeError(f"int8 inference unavailable: {int8_available()}")
    prepared = copy.deepcopy(model).eval()
    for module in list(prepared.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.InstanceNorm3d):
                setattr(module, name, LayoutPreservingInstanceNorm3d(child))
            elif type(child) is nn.ReLU:  # no autograd here: overwrite the norm's output
                setattr(module, name, nn.ReLU(inplace=True))
            elif (int8 and type(child) is nn.Conv3d and child.kernel_size == (3, 3, 3)
                  and child.in_channels >= int8_min_channels):
                setattr(module, name, Int8Conv3d(child))
            elif channels_last and type(child) is nn.Conv3d and child.in_channels == 1:
                setattr(module, name, ChannelsLastConv3d.from_conv(child))
    if int8 and equalize:
        equalize_int8_inputs(prepared)
    if channels_last:
        prepared = prepared.to(memory_format=torch.channels_last_3d)
    for p in prepared.parameters():
        p.requires_grad_(False)
    return prepared
