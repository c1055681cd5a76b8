"""What every recorded number names: the CPU, its vector and int8 instruction sets, the date.

A speed-up on one x86 CPU is not one on another (AVX2-only EPYC, AVX-512 EPYC, VNNI and AMX Xeons
run different kernels), so every benchmark prints :func:`isa_line` in its header.
"""
from __future__ import annotations

import datetime
import os
import platform

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


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_isa() -> list[str]:
    """The vector / int8 instruction sets of this CPU (names of :data:`ISA_FLAGS`), as the kernel
    reports them; ``ONEDNN_MAX_CPU_ISA``, when set, is named too (oneDNN then uses less)."""
    flags = set()
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    names = [name for flag, name in ISA_FLAGS.items() if flag in flags]
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return names + ([f"oneDNN capped at {cap}"] if cap else [])


def isa_line() -> str:
    """``date · CPU · ISA · cores``: one line for a benchmark's header."""
    isa = ", ".join(cpu_isa()) or "no x86 vector flags found"
    return f"{datetime.date.today()} · {cpu_name()} · ISA: {isa} · {os.cpu_count()} cores"
