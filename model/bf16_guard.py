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

SHALLOW_DEPTH = 2  # the input depth at which the faulty kernel is chosen


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


class ShallowFloatConv3d(nn.Conv3d):
    """A ``Conv3d`` that runs in float32, outside autocast, when its input is at most
    :data:`SHALLOW_DEPTH` deep; otherwise exactly ``nn.Conv3d``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.shape[2] > SHALLOW_DEPTH:
            return super().forward(x)
        with torch.autocast("cpu", enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.conv3d(x.float(), self.weight.float(), bias, self.stride, self.padding,
                            self.dilation, self.groups)


def protect_shallow_convolutions(model: nn.Module) -> int:
    """Make every plain ``Conv3d`` of ``model`` a :class:`ShallowFloatConv3d` (in place: same
    parameters, same state_dict); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Conv3d:
            module.__class__ = ShallowFloatConv3d
            count += 1
    return count


# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) under which its kernels may use native bf16 dot products
# (AVX-512 BF16's vdpbf16ps, AMX); "AVX2_VNNI_2" converts to bf16 but has no bf16 dot product.
BF16_DOT_CAPS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                 "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "ALL", "DEFAULT")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as handle:
                cpuinfo = handle.read()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def native_bf16(flags: set[str] | None = None, isa_cap: str | None = None) -> tuple[bool, str]:
    """``(yes, why)``: whether this CPU's convolutions get native bf16 dot products: the
    ``avx512_bf16`` or ``amx_bf16`` flag, and no ``ONEDNN_MAX_CPU_ISA`` below AVX512_CORE_BF16.
    Without them oneDNN emulates bf16 with float32 arithmetic plus conversions: slower than
    float32 (docs/performance.md)."""
    import os

    flags = cpu_flags() if flags is None else flags
    isa_cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "") if isa_cap is None else isa_cap
    found = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if not found:
        return False, "this CPU has no native bf16 dot products (no avx512_bf16 or amx_bf16 flag)"
    if isa_cap and isa_cap.upper() not in BF16_DOT_CAPS:
        return False, f"ONEDNN_MAX_CPU_ISA={isa_cap} keeps oneDNN from this CPU's bf16 dot products ({', '.join(found)})"
    return True, f"native bf16 dot products ({', '.join(found)})"
