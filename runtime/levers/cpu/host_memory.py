"""Keep freed host memory in the process, so large CPU tensors do not pay page faults each time
(evaluate, predict and training on the CPU: ``runtime.resolve.decide_host_memory`` decides).

PyTorch has no caching allocator for the CPU: every tensor comes from ``malloc``. glibc serves
blocks above its mmap threshold (at most 32 MB) with a fresh ``mmap`` and returns them with
``munmap`` when freed, so every 268 MB activation of a 128³ window (32 channels, float32), and
every activation and gradient of a training step, is new memory whose pages the kernel faults in
and zeroes on first touch: a large share of the CPU time goes to page faults (inference:
docs/performance.md, "Host memory reuse"; training: docs/performance.md, "The fast CPU settings").

:func:`reuse_freed_memory` tells glibc to serve every block from its main heap (``M_MMAP_MAX``
0), to give every thread that heap (``M_ARENA_MAX`` 1: a thread's own arena is a set of 64 MB
mappings, which would map large blocks afresh again), and never to give the heap's top back
to the system (``M_TRIM_THRESHOLD`` -1): a freed activation is then reused by a later one,
already mapped. The numbers computed do not change.
The cost is memory: the process keeps its largest heap until it exits, and blocks of varying
sizes fragment it (the peak resident memory is higher, and stays there over many windows
instead of growing: docs/performance.md, "Host memory reuse"). Other C libraries (musl, macOS) are left as
they are.
"""
from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
M_ARENA_MAX = -8
_TRIM_NEVER = -1  # mallopt(3): "-1 disables trimming completely"


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.mallopt.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def reuse_freed_memory() -> str | None:
    """Make glibc keep and reuse freed memory (see the module docstring).

    Returns ``None`` when done, else why not (not glibc, or ``mallopt`` refused); the caller
    may say so, nothing else changes. Safe to call more than once.
    """
    libc = _glibc()
    if libc is None:
        return "the C library is not glibc"
    if libc.mallopt(M_ARENA_MAX, 1) != 1:
        return "mallopt(M_ARENA_MAX, 1) refused"
    if libc.mallopt(M_MMAP_MAX, 0) != 1:
        return "mallopt(M_MMAP_MAX, 0) refused"
    if libc.mallopt(M_TRIM_THRESHOLD, _TRIM_NEVER) != 1:
        return "mallopt(M_TRIM_THRESHOLD) refused"
    return None
