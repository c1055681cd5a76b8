"""Geometry of the sliding-window evaluation (pure functions, no tensors).

Shared by the evaluator (which slides the windows) and the loader (which balances evaluation
volumes across ranks by their number of windows).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Sequence


@dataclass(frozen=True)
class WindowGeometry:
    """How one volume is trimmed, padded and tiled.

    Every tuple has one entry per spatial axis. ``trim`` and ``pad`` are ``(before, after)``
    pairs; ``trimmed_shape`` is the volume (and label) after trimming, ``padded_shape`` after
    padding, ``grid`` the number of window positions per axis.
    """

    strides: tuple[int, ...]
    trim: tuple[tuple[int, int], ...]
    trimmed_shape: tuple[int, ...]
    pad: tuple[tuple[int, int], ...]
    padded_shape: tuple[int, ...]
    grid: tuple[int, ...]

    @property
    def n_windows(self) -> int:
        return prod(self.grid)

    def window_origins(self) -> list[tuple[int, ...]]:
        """Start corner of every window in the padded volume, in raster order."""
        origins = [()]
        for count, stride in zip(self.grid, self.strides):
            origins = [o + (i * stride,) for o in origins for i in range(count)]
        return origins


def window_geometry(shape: Sequence[int], roi: Sequence[int], overlap: float) -> WindowGeometry:
    """Trim, pad and grid of the benchmark's sliding window for a volume of ``shape``.

    Per axis: stride ``int(roi * (1 - overlap))``; a remainder ``size % stride`` below half a
    stride is trimmed (half before, the rest after); the trimmed volume is padded (centred) to a
    multiple of the stride that is at least ``roi`` (and, where the stride does not divide the
    window, until the last window ends at the edge).

    An axis shorter than half a stride is the whole remainder: the benchmark's rule would trim
    it to nothing (an empty prediction; the reference scores it NaN). Such an axis is padded
    instead, like any axis shorter than the window. Every other axis is as the benchmark has it.
    """
    strides, trim, trimmed, pad, padded, grid = [], [], [], [], [], []
    for size, window in zip(shape, roi):
        stride = max(1, int(window * (1 - overlap)))
        remainder = size % stride
        cut = remainder if remainder < stride // 2 and remainder < size else 0
        size_t = size - cut
        extra = (stride - size_t % stride) % stride
        if size_t + extra < window:
            extra += stride * -(-(window - size_t - extra) // stride)
        if (size_t + extra - window) % stride:  # stride does not divide the window (odd
            # overlaps): pad on until the last window ends at the edge, or voxels get no weight
            extra += stride - (size_t + extra - window) % stride
        size_p = size_t + extra
        strides.append(stride)
        trim.append((cut // 2, cut - cut // 2))
        trimmed.append(size_t)
        pad.append((extra // 2, extra - extra // 2))
        padded.append(size_p)
        grid.append((size_p - window) // stride + 1)
    return WindowGeometry(tuple(strides), tuple(trim), tuple(trimmed), tuple(pad), tuple(padded),
                          tuple(grid))


def region_in_trimmed(region: Sequence[slice], shape: Sequence[int], roi: Sequence[int],
                      overlap: float) -> tuple[slice, ...]:
    """``region`` (slices of a volume of ``shape``) in the coordinates of the trimmed volume that
    the sliding window scores (:func:`window_geometry`), cut to what the trim keeps."""
    geometry = window_geometry(shape, roi, overlap)
    out = []
    for part, (before, _), kept in zip(region, geometry.trim, geometry.trimmed_shape):
        start = min(max(part.start - before, 0), kept)
        out.append(slice(start, max(start, min(part.stop - before, kept))))
    return tuple(out)
