"""The benchmark's sliding window over a whole volume: Gaussian-weighted window logits."""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from scipy.signal import windows

from data_loading.windows import window_geometry
from model.unet3d import N_CLASSES

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
                             n_class: int = N_CLASSES, pad_value: float = PAD_VALUE) -> torch.Tensor:
    """Gaussian-weighted sliding-window logits of one volume.

    ``image`` (1, C, D, H, W) float. Returns the logits (1, n_class, D', H', W') float32 of the
    trimmed volume (:func:`trim_like_window` trims a label alike). ``sw_batch_size`` windows go
    through ``predict`` at once; the result does not depend on it.
    """
    geo = window_geometry(image.shape[2:], roi, overlap)
    image = image[(..., *_trim(geo))]
    pad = [p for before_after in reversed(geo.pad) for p in before_after]  # F.pad: last axis first
    padded = F.pad(image, pad, mode="constant", value=pad_value)
    weight = gaussian_importance_map(roi, device=image.device)
    total = torch.zeros((1, n_class, *geo.padded_shape), dtype=torch.float32, device=image.device)
    norm = torch.zeros((1, 1, *geo.padded_shape), dtype=torch.float32, device=image.device)
    origins = geo.window_origins()
    for start in range(0, len(origins), sw_batch_size):
        group = origins[start:start + sw_batch_size]
        slices = [tuple(slice(o, o + r) for o, r in zip(origin, roi)) for origin in group]
        batch = torch.cat([padded[(..., *s)] for s in slices], dim=0)
        logits = predict(batch).float()
        for i, s in enumerate(slices):
            total[(..., *s)] += logits[i:i + 1] * weight
            norm[(..., *s)] += weight
    total /= norm
    crop = tuple(slice(b, b + s) for (b, _), s in zip(geo.pad, geo.trimmed_shape))
    return total[(..., *crop)]


def _trim(geo) -> tuple[slice, ...]:
    return tuple(slice(b, b + s) for (b, _), s in zip(geo.trim, geo.trimmed_shape))


def trim_like_window(volume: torch.Tensor, roi: Sequence[int], overlap: float) -> torch.Tensor:
    """``volume`` (..., D, H, W) trimmed as :func:`sliding_window_inference` trims its image
    (a remainder below half a stride is not scored: the benchmark's definition)."""
    return volume[(..., *_trim(window_geometry(volume.shape[-3:], roi, overlap)))]


