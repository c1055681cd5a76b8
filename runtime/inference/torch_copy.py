"""The PyTorch backend's inference copy of a trained UNet3D: the same function, laid out for a
fast CPU forward.

:func:`prepare_for_inference` returns a copy of a model (the original is untouched, so training
can go on) with:

* every ``ReLU`` in place (no autograd here, so the norm's output can be overwritten);
* with ``channels_last``, the convolution of the one-channel image run by oneDNN
  (:class:`ChannelsLastConv3d`), so the network is channels-last from its first output;
* every ``InstanceNorm3d`` replaced by :class:`LayoutPreservingInstanceNorm3d`: the same
  statistics and affine map, but a channels-last input gives a channels-last output.
  ``nn.InstanceNorm3d`` makes its input contiguous (NCDHW) to run it as a batch norm over
  ``(1, N·C, D, H, W)``, so in a channels-last network every convolution/norm pair pays two
  full-size layout copies (their share of a forward: docs/performance.md, "What each lever gave").

The state_dict keys stay those of the reference (``...conv1.1.weight`` and so on), so a prepared
model loads the same checkpoints. The prepared model is for ``eval`` only and computes the same
prediction up to float32 rounding (the norms' statistics to about 1e-7, as ``nn.InstanceNorm3d``).
int8 is the OpenVINO backend's (:mod:`runtime.inference.openvino`).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn



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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _is_channels_last(x):
            return F.instance_norm(x, weight=self.weight.to(x.dtype), bias=self.bias.to(x.dtype),
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

    The voxels are read as rows of C values in memory order, in chunks of about
    ``chunk_elements`` values (1 MB in float32: they stay in cache): each chunk's mean and
    centred sum of squares in float32 (two passes over cached data), the chunks combined in
    float64 (Chan et al.'s pairwise update). Relative error about 1e-7 however large the mean is
    next to the spread.
    """
    n, c = x.shape[:2]
    rows = x.permute(0, 2, 3, 4, 1).reshape(n, -1, c)
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


def prepare_for_inference(model: nn.Module, channels_last: bool = True) -> nn.Module:
    """An eval-mode copy of ``model`` for fast inference (``model`` itself is not changed).

    ``channels_last``: weights and the norms' outputs NDHWC (feed channels-last inputs).
    """
    prepared = copy.deepcopy(model).eval()
    for module in list(prepared.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.InstanceNorm3d):
                setattr(module, name, LayoutPreservingInstanceNorm3d(child))
            elif type(child) is nn.ReLU:  # no autograd here: overwrite the norm's output
                setattr(module, name, nn.ReLU(inplace=True))
            elif channels_last and type(child) is nn.Conv3d and child.in_channels == 1:
                setattr(module, name, ChannelsLastConv3d.from_conv(child))
    if channels_last:
        prepared = prepared.to(memory_format=torch.channels_last_3d)
    for p in prepared.parameters():
        p.requires_grad_(False)
    return prepared
