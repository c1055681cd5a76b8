"""The one way windows become logits, for evaluate, the benchmark mode, predict and the benchmarks.

:func:`build_predictor` takes a network (the trained model, or what a backend converted it to:
:mod:`runtime.inference.backends`) and returns ``predict(windows) -> logits`` for
:func:`runtime.inference.sliding_window.sliding_window_inference`: fp32 or in ``--amp``
autocast, channels-last windows with ``--channels_last``. With ``tta`` it returns the softmax
averaged over the 8 flips of the three spatial axes instead of the logits.

Evaluation scores the trained network itself (its logits are the benchmark's). Predict runs the
backend's conversion of it (the same logits up to float32 rounding, or int8's rounding with
``--int8``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from runtime.precision import autocast_context
from runtime.plan import InferencePlan, PrecisionPlan


FLIPS = [dims for n in range(4) for dims in itertools.combinations((2, 3, 4), n)]  # 8, () first
Predict = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PredictorOptions:
    """How the windows are computed (from a resolved plan: :func:`options_from`)."""

    channels_last: bool = False
    amp_dtype: str | None = None  # "bf16" / "fp16" autocast, None for fp32
    tta: bool = False


def options_from(precision: PrecisionPlan, inference: InferencePlan) -> PredictorOptions:
    """The predictor options of a resolved plan's sections (``runtime.plan``): the layout and the
    autocast type of ``precision``, and ``inference``'s ``tta`` (predict's ``--tta``; evaluation
    scores the logits)."""
    return PredictorOptions(channels_last=precision.channels_last, amp_dtype=precision.autocast, tta=inference.tta)


def build_predictor(model: torch.nn.Module, device: torch.device, options: PredictorOptions) -> Predict:
    """``windows (B, 1, *roi) -> (B, 3, *roi)`` float32 logits (softmax means with ``tta``) of
    ``model`` as it is (the caller sets eval mode and converts it: compiled, the PyTorch
    backend's inference copy, an OpenVINO module)."""
    autocast = autocast_context(options.amp_dtype, device)
    channels_last = options.channels_last

    def logits_of(batch: torch.Tensor) -> torch.Tensor:
        if channels_last:
            batch = batch.contiguous(memory_format=torch.channels_last_3d)
        with torch.no_grad(), autocast():
            return model(batch).float()

    def mirrored_probabilities(batch: torch.Tensor) -> torch.Tensor:
        total = torch.softmax(logits_of(batch), dim=1)
        for dims in FLIPS[1:]:
            total += torch.softmax(logits_of(batch.flip(dims)), dim=1).flip(dims)
        return total / len(FLIPS)

    return mirrored_probabilities if options.tta else logits_of
