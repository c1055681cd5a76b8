"""Dice + cross-entropy training loss and the Dice score of the benchmark.

All functions take logits ``(N, C, *spatial)`` (layout ``NCDHW``) or ``(N, *spatial, C)``
(layout ``NDHWC``) and integer labels with a channel axis of size 1 in the same layout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMOOTH = 1e-6


def _channel_axis(layout: str) -> int:
    if layout == "NCDHW":
        return 1
    if layout == "NDHWC":
        return -1
    raise ValueError(f"unknown layout {layout!r}; choose NCDHW or NDHWC")


def one_hot(label: torch.Tensor, n_class: int, channel_axis: int) -> torch.Tensor:
    """Integer labels with a size-1 channel axis -> float one-hot with ``n_class`` channels."""
    encoded = F.one_hot(label.squeeze(channel_axis).long(), n_class)  # channels last
    if channel_axis == 1:
        encoded = encoded.movedim(-1, 1)
    return encoded.float()


def dice_per_class(prediction: torch.Tensor, target: torch.Tensor, channel_axis: int,
                   include_background: bool, smooth: float = SMOOTH) -> torch.Tensor:
    """Dice ``(2·Σ(p·t) + s) / (Σt + Σp + s)`` per sample and class -> ``(N, C')``.

    ``prediction`` and ``target`` are per-class maps of the same shape; the background class
    (index 0) is dropped unless ``include_background``.
    """
    if not include_background:
        prediction = prediction.narrow(channel_axis, 1, prediction.shape[channel_axis] - 1)
        target = target.narrow(channel_axis, 1, target.shape[channel_axis] - 1)
    ch = channel_axis % prediction.ndim
    reduce_axes = [d for d in range(1, prediction.ndim) if d != ch]
    intersection = torch.sum(prediction * target, dim=reduce_axes)
    total = torch.sum(target, dim=reduce_axes) + torch.sum(prediction, dim=reduce_axes)
    return (2.0 * intersection + smooth) / (total + smooth)


class Dice(nn.Module):
    """Per-sample, per-class Dice of logits against labels (reference semantics)."""

    def __init__(self, to_onehot_y: bool = True, use_softmax: bool = True, use_argmax: bool = False,
                 layout: str = "NCDHW", include_background: bool = False):
        super().__init__()
        if use_softmax and use_argmax:
            raise ValueError("use_softmax and use_argmax are exclusive")
        self.to_onehot_y = to_onehot_y
        self.use_softmax = use_softmax
        self.use_argmax = use_argmax
        self.channel_axis = _channel_axis(layout)
        self.include_background = include_background

    def forward(self, logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        n_class = logits.shape[self.channel_axis]
        logits = logits.float()
        if self.use_softmax:
            prediction = torch.softmax(logits, dim=self.channel_axis)
        elif self.use_argmax:
            prediction = one_hot(torch.argmax(logits, dim=self.channel_axis, keepdim=True), n_class,
                                 self.channel_axis)
        else:
            prediction = logits
        target = one_hot(label, n_class, self.channel_axis) if self.to_onehot_y else label.float()
        return dice_per_class(prediction, target, self.channel_axis, self.include_background)


class DiceCELoss(nn.Module):
    """``(mean(1 - dice(softmax(logits), onehot(label))) + cross_entropy) / 2``."""

    def __init__(self, to_onehot_y: bool = True, use_softmax: bool = True, layout: str = "NCDHW",
                 include_background: bool = False):
        super().__init__()
        self.dice = Dice(to_onehot_y=to_onehot_y, use_softmax=use_softmax, use_argmax=False,
                         layout=layout, include_background=include_background)
        self.channel_axis = _channel_axis(layout)

    def forward(self, logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        dice_loss = torch.mean(1.0 - self.dice(logits, label))
        target = label.squeeze(self.channel_axis).long()
        scores = logits.float() if self.channel_axis == 1 else logits.float().movedim(-1, 1)
        cross_entropy = F.cross_entropy(scores, target)
        return (dice_loss + cross_entropy) / 2


class DiceScore(nn.Module):
    """Dice of ``onehot(argmax(logits))`` against the one-hot label, averaged over the batch.

    Returns ``(C',)``: one score per foreground class (kidney, tumour). A class absent from
    both prediction and label scores 1.0.
    """

    def __init__(self, to_onehot_y: bool = True, use_argmax: bool = True, layout: str = "NCDHW",
                 include_background: bool = False):
        super().__init__()
        self.dice = Dice(to_onehot_y=to_onehot_y, use_softmax=False, use_argmax=use_argmax,
                         layout=layout, include_background=include_background)

    def forward(self, logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
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
