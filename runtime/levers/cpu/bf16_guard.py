"""bf16 training on CPUs whose oneDNN computes a wrong weight gradient for 3D convolutions.

oneDNN's AVX-512 bf16 kernel for the weight gradient of a 3x3x3 convolution (stride 1, padding
1) whose input is 2 voxels deep returns wrong values, and on reused memory NaN or 1e30: it
reads memory it never wrote (seen with torch 2.3 and 2.13 on AVX-512 BF16 CPUs, and under
``ONEDNN_MAX_CPU_ISA=AVX512_CORE``; the AVX2 kernels are right; the forward pass and the input
gradient are right everywhere). A network trained on 64-voxel-deep patches meets such a layer
at its bottleneck (64 / 2**5 = 2), so ``--amp --amp_dtype bf16`` training there learns from
garbage or diverges.

:func:`bf16_weight_grad_ok` decides, once per process, by a known-answer gradient (not by the
CPU's name) whether this CPU has the fault; :func:`protect_shallow_convolutions` then computes
those convolutions (input depth <= 2, a few voxels each: negligible time) in float32 outside
autocast. Weights, state_dict keys and float32 results are unchanged.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from runtime.levers.cpu.blocks import SHALLOW_DEPTH, ShallowFloatConv3d, adopt, swap


@functools.lru_cache(maxsize=None)
def bf16_weight_grad_ok() -> bool:
    """True when a bf16 3x3x3 convolution's weight gradient on a 2-deep input agrees with the
    float64 one (relative error below 5%; a correct bf16 kernel gives about 0.5%)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, SHALLOW_DEPTH, 4, 4, generator=gen, dtype=torch.float64)
    weight = torch.randn(8, 16, 3, 3, 3, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(2, 8, SHALLOW_DEPTH, 4, 4, generator=gen, dtype=torch.float64)

    def weight_grad(dtype: torch.dtype) -> torch.Tensor:
        w = weight.detach().to(dtype).requires_grad_()
        F.conv3d(x.to(dtype), w, padding=1).backward(grad_out.to(dtype))
        return w.grad.double()

    exact = weight_grad(torch.float64)
    error = (weight_grad(torch.bfloat16) - exact).abs().max() / exact.abs().max()
    return bool(torch.isfinite(error)) and float(error) < 0.05


def protect_shallow_convolutions(model: nn.Module) -> int:
    """Make every plain ``Conv3d`` of ``model`` a
    :class:`~runtime.levers.cpu.blocks.ShallowFloatConv3d` (in place: same parameters, same
    state_dict); returns how many."""
    return swap(model, lambda m: adopt(m, ShallowFloatConv3d) if type(m) is nn.Conv3d else None)
