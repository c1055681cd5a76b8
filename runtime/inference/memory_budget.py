"""Predict's host memory: the window batch chosen so that the estimated peak fits a limit.

The limit is ``--max_memory_gb`` when given, else the memory available when predict starts
(the smallest of ``MemAvailable``, the job's own cgroup limit less its use, v1 or v2, and
SLURM's ``--mem``: :mod:`data_loading.memory_limits`; under torchrun, divided among the node's
processes).
The estimate is the process's base (PyTorch, the
network, OpenVINO's compiled model), the volume's buffers, and the windows in flight:

* PyTorch holds every window of a batch in one forward, and keeps freed blocks for reuse
  (``runtime.levers.cpu.host_memory``): ``TORCH_WINDOW_FACTOR`` times the window's first activation
  (``filters[0]`` channels x window voxels x 4 bytes) per window;
* OpenVINO runs one window per request whatever the batch, in buffers it plans once:
  ``OPENVINO_WINDOW_FACTOR`` times the first activation, once.

The constants are set above the peaks measured on a KiTS-size scan with the default network
(docs/performance.md, "Peak memory of predict": each measured peak beside its estimate). The
batch is the largest (at most ``--sw_batch_size``) whose estimate fits; when
not even one window fits an explicit ``--max_memory_gb``, predict stops with one line. The
segmentation does not depend on the batch.
"""
from __future__ import annotations

import math
import os
from typing import Callable

from data_loading.memory_limits import read_memory
from runtime.config import UsageError

GB = 1e9
BASE_BYTES = 1.0 * GB  # interpreter, PyTorch and its libraries, the network's weights
VOLUME_BYTES = 2.0 * GB  # a KiTS-size scan: padded image, class sums, weights, probabilities, restore
TORCH_WINDOW_FACTOR = 11.0  # 9 was exceeded: 8.39 GB measured with 2 windows (PyTorch int8) against 7.83
OPENVINO_WINDOW_FACTOR = 6.0


def available_bytes() -> float | None:
    """The memory this process may take now (:func:`data_loading.memory_limits.read_memory`:
    the smallest of ``MemAvailable``, its job's cgroup headroom and SLURM's ``--mem``), or None
    where nothing says."""
    available = read_memory().available
    return None if available is None else float(available)


def local_processes() -> int:
    """Processes of this job on this node (torchrun's ``LOCAL_WORLD_SIZE``; 1 otherwise)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def first_activation_bytes(filters, window) -> float:
    """Bytes of the network's first activation on one window: ``filters[0]`` channels of float32."""
    return 4.0 * filters[0] * math.prod(window)


def estimate_bytes(filters, window, backend: str, batch: int) -> float:
    """Estimated peak resident bytes of predict with ``batch`` windows per forward, for a network
    of ``filters`` on ``window``-sized windows."""
    first = first_activation_bytes(filters, window)
    windows = OPENVINO_WINDOW_FACTOR * first if backend == "openvino" else TORCH_WINDOW_FACTOR * first * batch
    return BASE_BYTES + VOLUME_BYTES + windows


def bounded_window_batch(asked: int, max_memory_gb: float, filters, window, backend: str,
                         say: Callable[[str], None] = print,
                         available: Callable[[], float | None] = available_bytes) -> int:
    """The window batch: ``asked`` (``--sw_batch_size``) lowered until the estimate for the network's
    ``filters`` and the ``window`` that run fits the limit (``--max_memory_gb``, 0: the memory
    available; see the module docstring); one line when it is lowered. :class:`UsageError` when
    an explicit ``--max_memory_gb`` cannot hold one window."""
    explicit = max_memory_gb > 0
    limit = max_memory_gb * GB if explicit else available()
    if limit is None:
        return asked
    source = f"--max_memory_gb {max_memory_gb:g}" if explicit else "the memory available now"
    if not explicit and available is available_bytes:
        source += f" ({read_memory().available_source})"
    if not explicit and local_processes() > 1:  # torchrun: the node's ranks share what is available
        limit /= local_processes()
        source += f" shared by {local_processes()} processes on this node"
    one = estimate_bytes(filters, window, backend, 1)
    if one > limit:
        if explicit:
            raise UsageError(f"--max_memory_gb {max_memory_gb:g}: predict needs about {one / GB:.1f} GB with one "
                             f"window per forward ({backend}, {list(window)} windows)")
        say(f"memory: about {one / GB:.1f} GB needed, {limit / GB:.1f} GB available; one window per forward")
        return 1
    batch = asked
    while batch > 1 and estimate_bytes(filters, window, backend, batch) > limit:
        batch -= 1
    if batch != asked:
        say(f"memory: --sw_batch_size {asked} lowered to {batch} to stay within {source} "
            f"({limit / GB:.1f} GB; about {estimate_bytes(filters, window, backend, batch) / GB:.1f} GB estimated)")
    return batch
