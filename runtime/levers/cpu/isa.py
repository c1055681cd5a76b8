"""What this CPU can do, for every choice made by feature (never by name or version): its flags,
native bf16 dot products, int8 products accumulated in 32 bits (VNNI/AMX) or in saturating 16-bit
pairs, and the one line every recorded number names.

``ONEDNN_MAX_CPU_ISA`` limits oneDNN (and OpenVINO's oneDNN kernels) below what the CPU has; each
answer here honours it.
"""
from __future__ import annotations

import datetime
import os
import platform

# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) under which its kernels may use native bf16 dot products
# (AVX-512 BF16's vdpbf16ps, AMX); "AVX2_VNNI_2" converts to bf16 but has no bf16 dot product.
BF16_DOT_CAPS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                 "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "ALL", "DEFAULT")
NO_VNNI_CAPS = {"SSE41", "AVX", "AVX2", "AVX512_CORE"}  # ONEDNN_MAX_CPU_ISA values below VNNI
VNNI_FLAGS = {"avx512_vnni", "avx_vnni", "amx_int8"}
# /proc/cpuinfo flag -> the name in the docs, in the order printed
ISA_FLAGS = {"avx2": "AVX2", "fma": "FMA", "avx512f": "AVX-512", "avx512_bf16": "AVX-512 BF16",
             "avx512_vnni": "AVX-512 VNNI", "avx_vnni": "AVX-VNNI", "amx_int8": "AMX-INT8",
             "amx_bf16": "AMX-BF16"}


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            return handle.read()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def isa_cap(environ=os.environ) -> str:
    """``ONEDNN_MAX_CPU_ISA`` as oneDNN reads it (upper case), "" when unset."""
    return environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()


def native_bf16(flags: set[str] | None = None, cap: str | None = None) -> tuple[bool, str]:
    """``(yes, why)``: whether this CPU's convolutions get native bf16 dot products: the
    ``avx512_bf16`` or ``amx_bf16`` flag, and no ``ONEDNN_MAX_CPU_ISA`` below AVX512_CORE_BF16.
    Without them oneDNN emulates bf16 with float32 arithmetic plus conversions: slower than
    float32 (docs/performance.md)."""
    flags = cpu_flags() if flags is None else flags
    cap = isa_cap() if cap is None else cap
    found = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if not found:
        return False, "this CPU has no native bf16 dot products (no avx512_bf16 or amx_bf16 flag)"
    if cap and cap.upper() not in BF16_DOT_CAPS:
        return False, f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN from this CPU's bf16 dot products ({', '.join(found)})"
    return True, f"native bf16 dot products ({', '.join(found)})"


def int8_pairs_saturate(flags: set[str] | None = None, environ=os.environ) -> bool:
    """True when the CPU's int8 dot products go through saturating 16-bit pair sums: no VNNI
    in ``/proc/cpuinfo``, or oneDNN limited below it by ``ONEDNN_MAX_CPU_ISA`` (OpenVINO's CPU
    plugin honours it for its oneDNN kernels)."""
    flags = cpu_flags() if flags is None else flags
    return not (flags & VNNI_FLAGS) or isa_cap(environ) in NO_VNNI_CAPS


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_isa() -> list[str]:
    """The vector / int8 instruction sets of this CPU (names of :data:`ISA_FLAGS`), as the kernel
    reports them; ``ONEDNN_MAX_CPU_ISA``, when set, is named too (oneDNN then uses less)."""
    flags = cpu_flags()
    names = [name for flag, name in ISA_FLAGS.items() if flag in flags]
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return names + ([f"oneDNN capped at {cap}"] if cap else [])


def isa_line() -> str:
    """``date · CPU · ISA · cores``: one line for a benchmark's header."""
    isa = ", ".join(cpu_isa()) or "no x86 vector flags found"
    return f"{datetime.date.today()} · {cpu_name()} · ISA: {isa} · {os.cpu_count()} cores"
