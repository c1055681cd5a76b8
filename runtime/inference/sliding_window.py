"""Sliding windows over a whole volume: Gaussian-weighted window logits.

:func:`sliding_window_inference` is the benchmark's (evaluation: its trimming and padding, bit for
bit the MLCommons reference's); :func:`flush_sliding_window_inference` is predict's (every voxel
scored, the last window of each axis flush with the edge, as MONAI and nnU-Net place it). Both
weight the windows alike (:func:`gaussian_importance_map`).
"""
from __future__ import annotations

import itertools
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from scipy.signal import windows

from data_loading.windows import window_geometry

PAD_VALUE = -2.2  # the reference's constant (near, not equal to, (-79 - 101.0) / 76.9 = -2.34)


@lru_cache(maxsize=8)
def _gaussian_map_np(roi: tuple[int, ...], sigma_scale: float) -> np.ndarray:
    axes = [windows.gaussian(n, sigma_scale * n) for n in roi]
    weights = np.cbrt(axes[0][:, None, None] * axes[1][None, :, None] * axes[2][None, None, :])
    return weights / weights.max()


def gaussian_importance_map(roi: Sequence[int], device=None, dtype=torch.float32,
                            sigma_scale: float = 0.125) -> torch.Tensor:
    """``roi``-shaped weights: outer product of 1-D Gaussians (std 0.125·n), cube root, max 1."""
    return torch.as_tensor(_gaussian_map_np(tuple(roi), sigma_scale), dtype=dtype, device=device)


def sliding_window_inference(predict: Callable[[torch.Tensor], torch.Tensor], image: torch.Tensor,
                             roi: Sequence[int], overlap: float, sw_batch_size: int = 1,
                             n_class: int | None = None, pad_value: float = PAD_VALUE) -> torch.Tensor:
    """Gaussian-weighted sliding-window logits of one volume.

    ``image`` (1, C, D, H, W) float. Returns the logits (1, n_class, D', H', W') float32 of the
    trimmed volume (:func:`trim_like_window` trims a label alike). ``sw_batch_size`` windows go
    through ``predict`` at once; the result does not depend on it.
    """
    geo = window_geometry(image.shape[2:], roi, overlap)
    image = image[(..., *_trim(geo))]
    pad = [p for before_after in reversed(geo.pad) for p in before_after]  # F.pad: last axis first
    padded = F.pad(image, pad, mode="constant", value=pad_value)
    total = _weighted_windows(predict, padded, geo.window_origins(), roi, sw_batch_size, n_class)
    crop = tuple(slice(b, b + s) for (b, _), s in zip(geo.pad, geo.trimmed_shape))
    return total[(..., *crop)]


def _weighted_windows(predict: Callable[[torch.Tensor], torch.Tensor], padded: torch.Tensor,
                      origins: Sequence[tuple[int, ...]], roi: Sequence[int], sw_batch_size: int,
                      n_class: int | None) -> torch.Tensor:
    """The Gaussian-weighted mean (1, n_class, *padded's shape) float32 of ``predict`` on the
    ``roi`` windows of ``padded`` (1, C, D, H, W) at ``origins``, ``sw_batch_size`` at a time.
    ``n_class`` None: the network's output channels (one per label of its label set), as its
    first windows give them."""
    weight = gaussian_importance_map(roi, device=padded.device)
    total = None if n_class is None else \
        torch.zeros((1, n_class, *padded.shape[2:]), dtype=torch.float32, device=padded.device)
    norm = torch.zeros((1, 1, *padded.shape[2:]), dtype=torch.float32, device=padded.device)
    for start in range(0, len(origins), sw_batch_size):
        group = origins[start:start + sw_batch_size]
        slices = [tuple(slice(o, o + r) for o, r in zip(origin, roi)) for origin in group]
        batch = torch.cat([padded[(..., *s)] for s in slices], dim=0)
        logits = predict(batch).float()
        if total is None:
            total = torch.zeros((1, logits.shape[1], *padded.shape[2:]), dtype=torch.float32, device=padded.device)
        for i, s in enumerate(slices):
            total[(..., *s)] += logits[i:i + 1] * weight
            norm[(..., *s)] += weight
    total /= norm
    return total


def _trim(geo) -> tuple[slice, ...]:
    return tuple(slice(b, b + s) for (b, _), s in zip(geo.trim, geo.trimmed_shape))


def trim_like_window(volume: torch.Tensor, roi: Sequence[int], overlap: float) -> torch.Tensor:
    """``volume`` (..., D, H, W) trimmed as :func:`sliding_window_inference` trims its image
    (a remainder below half a stride is not scored: the benchmark's definition)."""
    return volume[(..., *_trim(window_geometry(volume.shape[-3:], roi, overlap)))]




# ----------------------------------------------------------------------------- predict's placement


def flush_starts(size: int, window: int, stride: int) -> list[int]:
    """Window starts along one axis of ``size`` voxels (at least ``window``): every ``stride``
    from 0, the last one flush with the edge (``size - window``), as MONAI's
    ``dense_patch_slices`` and nnU-Net place them; every voxel is covered, none is outside."""
    if size < window:
        raise ValueError(f"an axis of {size} voxels is shorter than the window ({window}): pad it first")
    count = 1 + max(0, -(-(size - window) // stride))  # ceil((size - window) / stride) more
    return [min(i * stride, size - window) for i in range(count)]


def short_axis_padding(shape: Sequence[int], roi: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``(before, after)`` per axis that brings an axis shorter than the window to the window
    (half before, as MONAI pads); nothing on any other axis."""
    return tuple(((window - size) // 2, window - size - (window - size) // 2) if size < window else (0, 0)
                 for size, window in zip(shape, roi))


def pad_short_axes(image: torch.Tensor, roi: Sequence[int]) -> tuple[torch.Tensor, tuple[tuple[int, int], ...]]:
    """``image`` (1, C, D, H, W) with each axis shorter than ``roi`` padded to it with the edge's
    values (replicated, :func:`short_axis_padding`: half before), and that padding: what
    predict's windows (and int8's calibration windows) are cut from."""
    padding = short_axis_padding(image.shape[2:], roi)
    if not any(before or after for before, after in padding):
        return image, padding
    return F.pad(image, [p for pair in reversed(padding) for p in pair], mode="replicate"), padding


def flush_sliding_window_inference(predict: Callable[[torch.Tensor], torch.Tensor], image: torch.Tensor,
                                   roi: Sequence[int], overlap: float, sw_batch_size: int = 1,
                                   n_class: int | None = None) -> torch.Tensor:
    """Predict's sliding window: Gaussian-weighted logits (1, n_class, D, H, W) float32 of every
    voxel of ``image`` (1, C, D, H, W), no voxel trimmed.

    The windows are the benchmark's (``roi``, stride ``int(roi * (1 - overlap))``, the same
    Gaussian weights), but the last one of each axis is placed flush with the volume's edge
    (:func:`flush_starts`) instead of the volume being padded to a multiple of the stride, so no
    window reads a constant slab the scan does not need: the network normalises each window by
    its own statistics (instance norm), and a slab changes what it predicts inside the scan.
    Only an axis shorter than the window is padded, with the edge's values (replicated), as
    preprocessing pads a scan to 128 voxels (the network saw that in training), then cropped
    back. Evaluation keeps :func:`sliding_window_inference` (the benchmark's trimming and padding).
    """
    padded, padding = pad_short_axes(image, roi)
    strides = window_geometry(padded.shape[2:], roi, overlap).strides  # the benchmark's
    starts = [flush_starts(size, window, stride) for size, window, stride in zip(padded.shape[2:], roi, strides)]
    origins = [tuple(origin) for origin in itertools.product(*starts)]  # raster order, as the benchmark's
    total = _weighted_windows(predict, padded, origins, roi, sw_batch_size, n_class)
    return total[(..., *(slice(b, b + s) for (b, _), s in zip(padding, image.shape[2:])))]
