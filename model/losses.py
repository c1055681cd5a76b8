"""Dice + cross-entropy training loss and the Dice score of the benchmark.

All functions take logits ``(N, C, *spatial)`` (layout ``NCDHW``; a channels-last memory format
is fine, the logical layout is what counts) and integer labels ``(N, 1, *spatial)``.

``ignore_index``: nnU-Net's ignore label (a value of the labels that is no class, e.g. voxels
nobody annotated): its voxels add nothing to the loss or the score, as nnU-Net masks them (its
``DC_and_CE_loss`` with ``ignore_label``: the Dice of ``softmax * mask`` against ``onehot *
mask``, the cross-entropy's mean over the other voxels; its ``compute_metrics``: TP, FP and FN
counted where the truth is not ignored). None (the benchmark's): every voxel counts, as before.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

SMOOTH = 1e-6
CHANNELS = 1  # the channel axis of NCDHW


def one_hot(label: torch.Tensor, n_class: int) -> torch.Tensor:
    """Integer labels ``(N, 1, *spatial)`` -> float one-hot ``(N, n_class, *spatial)``."""
    return F.one_hot(label.squeeze(CHANNELS).long(), n_class).movedim(-1, CHANNELS).float()


def dice_per_class(prediction: torch.Tensor, target: torch.Tensor, include_background: bool,
                   smooth: float = SMOOTH, absent_nan: bool = False) -> torch.Tensor:
    """Dice ``(2·Σ(p·t) + s) / (Σt + Σp + s)`` per sample and class -> ``(N, C')``.

    ``prediction`` and ``target`` are per-class maps ``(N, C, *spatial)``; the background class
    (index 0) is dropped unless ``include_background``. ``absent_nan``: nnU-Net's per-label Dice
    ``2·Σ(p·t) / (Σt + Σp)``, no smoothing, NaN for a class absent from both.
    """
    if not include_background:
        prediction = prediction[:, 1:]
        target = target[:, 1:]
    reduce_axes = list(range(2, prediction.ndim))
    intersection = torch.sum(prediction * target, dim=reduce_axes)
    total = torch.sum(target, dim=reduce_axes) + torch.sum(prediction, dim=reduce_axes)
    if absent_nan:
        return torch.where(total > 0, 2.0 * intersection / total.clamp_min(1e-30), torch.full_like(total, math.nan))
    return (2.0 * intersection + smooth) / (total + smooth)


def ignored(label: torch.Tensor, ignore_index: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(label, keep)``: ``label`` with its ``ignore_index`` voxels as background (any class
    would do: they are masked) and the float mask ``(N, 1, *spatial)`` of the voxels that count;
    ``(label, None)`` without an ignore label."""
    if ignore_index is None:
        return label, None
    is_ignored = label == ignore_index
    return torch.where(is_ignored, torch.zeros_like(label), label), (~is_ignored).float()


class Dice(nn.Module):
    """Per-sample, per-class Dice of logits against labels (reference semantics)."""

    def __init__(self, to_onehot_y: bool = True, use_softmax: bool = True, use_argmax: bool = False,
                 include_background: bool = False, absent_nan: bool = False, ignore_index: int | None = None):
        super().__init__()
        if use_softmax and use_argmax:
            raise ValueError("use_softmax and use_argmax are exclusive")
        self.ignore_index = ignore_index
        self.absent_nan = absent_nan
        self.to_onehot_y = to_onehot_y
        self.use_softmax = use_softmax
        self.use_argmax = use_argmax
        self.include_background = include_background

    def forward(self, logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        n_class = logits.shape[CHANNELS]
        logits = logits.float()
        if self.use_softmax:
            prediction = torch.softmax(logits, dim=CHANNELS)
        elif self.use_argmax:
            prediction = one_hot(torch.argmax(logits, dim=CHANNELS, keepdim=True), n_class)
        else:
            prediction = logits
        label, keep = ignored(label, self.ignore_index)
        target = one_hot(label, n_class) if self.to_onehot_y else label.float()
        if keep is not None:
            prediction, target = prediction * keep, target * keep
        if self.absent_nan:
            return dice_per_class(prediction, target, self.include_background, absent_nan=True)
        return dice_per_class(prediction, target, self.include_background)


class DiceCELoss(nn.Module):
    """``(mean(1 - dice(softmax(logits), onehot(label))) + cross_entropy) / 2``; with
    ``ignore_index``, both over the voxels not ignored (a patch of ignored voxels only: 0 for
    the cross-entropy)."""

    def __init__(self, to_onehot_y: bool = True, use_softmax: bool = True, include_background: bool = False,
                 ignore_index: int | None = None):
        super().__init__()
        self.ignore_index = ignore_index
        self.dice = Dice(to_onehot_y=to_onehot_y, use_softmax=use_softmax, use_argmax=False,
                         include_background=include_background, ignore_index=ignore_index)

    def forward(self, logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        dice_loss = torch.mean(1.0 - self.dice(logits, label))
        if self.ignore_index is None:
            cross_entropy = F.cross_entropy(logits.float(), label.squeeze(CHANNELS).long())
        else:
            kept, keep = ignored(label, self.ignore_index)
            per_voxel = F.cross_entropy(logits.float(), kept.squeeze(CHANNELS).long(), reduction="none")
            keep = keep.squeeze(CHANNELS)
            cross_entropy = (per_voxel * keep).sum() / keep.sum().clamp_min(1.0)
        return (dice_loss + cross_entropy) / 2


class DiceScore(nn.Module):
    """Dice of ``onehot(argmax(logits))`` against the one-hot label, averaged over the batch.

    Returns ``(C',)``: one score per foreground class (kidney, tumour). A class absent from
    both prediction and label scores 1.0 (the benchmark's); with ``absent_nan`` (own data,
    nnU-Net's Dice) it is NaN, and the batch mean leaves it out.
    """

    def __init__(self, to_onehot_y: bool = True, use_argmax: bool = True, include_background: bool = False,
                 absent_nan: bool = False, ignore_index: int | None = None):
        super().__init__()
        self.absent_nan = absent_nan
        self.dice = Dice(to_onehot_y=to_onehot_y, use_softmax=False, use_argmax=use_argmax,
                         include_background=include_background, absent_nan=absent_nan, ignore_index=ignore_index)

    def forward(self, logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        if self.absent_nan:
            return torch.nanmean(self.dice(logits, label), dim=0)
        return torch.mean(self.dice(logits, label), dim=0)


def label_map_dice(prediction, target, classes=(1, 2), smooth: float = SMOOTH) -> list[float]:
    """Dice per class of two integer label maps of one volume (numpy or torch, any shape).

    The same formula and smoothing as :class:`DiceScore` (a class absent from both scores
    1.0), counted with comparisons rather than one-hot maps, so that a full-resolution CT
    volume needs no float copy per class.
    """
    import numpy as np

    prediction, target = np.asarray(prediction), np.asarray(target)
    if prediction.shape != target.shape:
        raise ValueError(f"prediction {prediction.shape} and target {target.shape} differ in shape")
    scores = []
    for c in classes:
        p, t = prediction == c, target == c
        both = int(np.count_nonzero(p & t))
        total = int(np.count_nonzero(p)) + int(np.count_nonzero(t))
        scores.append((2.0 * both + smooth) / (total + smooth))
    return scores


def foreground_agreement(labels, expected) -> tuple[int, int]:
    """``(equal, total)`` over the voxels that either labelling calls kidney or tumour (label > 0):
    how far a faster computation (int8, another backend) keeps a network's labels. The one
    agreement metric: int8 calibration's accuracy control and the inference benchmarks use it."""
    labels, expected = torch.as_tensor(labels), torch.as_tensor(expected)
    union = (labels > 0) | (expected > 0)
    return int((labels == expected)[union].sum()), int(union.sum())
