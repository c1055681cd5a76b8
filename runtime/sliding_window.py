"""Sliding-window evaluation of whole volumes, exactly as the benchmark defines it."""
from __future__ import annotations

from contextlib import nullcontext
from functools import lru_cache
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from scipy.signal import windows

from data_loading.windows import region_in_trimmed, window_geometry
from model.inference_copy import prepare_for_inference
from runtime.distributed import all_reduce_sum

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
                             label: torch.Tensor, roi: Sequence[int], overlap: float,
                             sw_batch_size: int = 1, n_class: int = 3,
                             pad_value: float = PAD_VALUE) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian-weighted sliding-window logits of one volume.

    ``image`` (1, C, D, H, W) float, ``label`` (1, 1, D, H, W). Returns ``(logits, label)`` for
    the trimmed volume: logits (1, n_class, D', H', W') float32 and the label trimmed alike.
    ``sw_batch_size`` windows go through ``predict`` at once; the result does not depend on it.
    """
    geo = window_geometry(image.shape[2:], roi, overlap)
    trim = tuple(slice(b, b + s) for (b, _), s in zip(geo.trim, geo.trimmed_shape))
    image = image[(..., *trim)]
    label = label[(..., *trim)]
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
    return total[(..., *crop)], label


def fast_predictor(model: torch.nn.Module, channels_last: bool = True,
                   int8: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """A ``predict`` for :func:`sliding_window_inference` that runs an inference copy of ``model``.

    The copy comes from :func:`model.inference_copy.prepare_for_inference` (layout-preserving instance
    norms; channels-last weights; int8 convolutions if ``int8``); ``model`` is not changed.
    ``predict`` takes windows ``(N, C, D, H, W)`` in any layout, converts them to channels-last
    when ``channels_last``, runs under ``torch.inference_mode`` and returns float32 NCDHW
    logits. Without ``int8`` the logits equal the model's up to float32 rounding (the order of
    the sums in the kernels differs); with ``int8`` they carry the quantisation error.
    """
    prepared = prepare_for_inference(model, channels_last=channels_last, int8=int8)

    def predict(batch: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            if channels_last:
                batch = batch.contiguous(memory_format=torch.channels_last_3d)
            return prepared(batch).float().contiguous()

    return predict


def evaluate(model: torch.nn.Module, volumes: Iterable, loss_fn, score_fn, roi: Sequence[int],
             overlap: float, sw_batch_size: int, device: torch.device,
             autocast: Callable[[], object] = nullcontext, progress=None,
             cases: list | None = None, scan_region: Callable | None = None) -> dict[str, float]:
    """Evaluate the volumes of this rank and combine all ranks exactly.

    ``volumes`` yields ``(image, label, case_id)``. Per-case loss and Dice are summed on each
    rank, the sums and case counts are summed across ranks, then divided: every case weighs the
    same whatever the world size, and a rank with no case contributes zeros.

    ``cases``: a list that receives this rank's :func:`case_scores` per case (each a host sync;
    the sums do not change). ``scan_region(case_id, shape)``: the slices of the scan inside the
    stored volume (None: unknown), for the Dice inside the scan that ``case_scores`` adds.
    """
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, kidney, tumour, cases

    def predict(x):
        with autocast():
            return model(x)

    with torch.no_grad():
        for image, label, case_id in (progress(volumes) if progress else volumes):
            image = image.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            shape = tuple(image.shape[2:])
            logits, label = sliding_window_inference(predict, image, label, roi, overlap, sw_batch_size)
            loss, scores = loss_fn(logits, label).double(), score_fn(logits, label).double()
            sums[0] += loss
            sums[1:3] += scores
            sums[3] += 1
            if cases is not None:
                region = scan_region(case_id, shape) if scan_region is not None else None
                inside = region and region_in_trimmed(region, shape, roi, overlap)
                cases.append(case_scores(case_id, loss, scores, inside and score_fn(
                    logits[(..., *inside)], label[(..., *inside)])))
    all_reduce_sum(sums)
    model.train()
    loss, kidney, tumour, count = sums.tolist()
    if count == 0:
        raise RuntimeError("no evaluation case on any rank")
    kidney, tumour = kidney / count, tumour / count
    return {"eval_loss": loss / count, "l1_dice": kidney, "l2_dice": tumour,
            "mean_dice": (kidney + tumour) / 2, "eval_cases": int(count)}


def case_scores(case_id: str, loss: torch.Tensor, scores: torch.Tensor, inside: torch.Tensor | None) -> dict:
    """One case's numbers: the benchmark's (its Dice on the whole stored volume, as summed
    into the mean) and, when the scan's region is known, the Dice inside the scan."""
    kidney, tumour = (float(v) for v in scores.tolist())
    record = {"case": case_id, "kidney_dice": kidney, "tumour_dice": tumour, "mean_dice": (kidney + tumour) / 2,
              "eval_loss": float(loss), "scan_kidney_dice": None, "scan_tumour_dice": None, "scan_mean_dice": None}
    if inside is not None:
        scan_kidney, scan_tumour = (float(v) for v in inside.double().tolist())
        record.update(scan_kidney_dice=scan_kidney, scan_tumour_dice=scan_tumour,
                      scan_mean_dice=(scan_kidney + scan_tumour) / 2)
    return record
