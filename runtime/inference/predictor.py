"""The one way windows become logits, for evaluate, the benchmark mode, predict and the benchmarks.

:func:`build_predictor` takes a trained model and returns ``predict(windows) -> logits`` for
:func:`runtime.inference.sliding_window.sliding_window_inference`: eager or compiled, fp32 or in
``--amp`` autocast, channels-last, and with ``inference_copy`` the inference form of the network
(:func:`runtime.inference.torch_copy.prepare_for_inference`: layout-preserving norms, in-place ReLU,
int8 convolutions with ``int8``). With ``tta`` it returns the softmax averaged over the 8 flips
of the three spatial axes instead of the logits.

Evaluation scores the trained network itself (no inference copy): its logits are the
benchmark's. Predict and the benchmarks use the copy (the same logits up to float32 rounding
without int8).
"""
from __future__ import annotations

import itertools
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from runtime.inference.torch_copy import prepare_for_inference
from runtime.compiling import compile_model

FLIPS = [dims for n in range(4) for dims in itertools.combinations((2, 3, 4), n)]  # 8, () first
Predict = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PredictorOptions:
    """How the windows are computed (from a resolved config: :func:`options_from`)."""

    channels_last: bool = False
    int8: bool = False
    amp_dtype: str | None = None  # "bf16" / "fp16" autocast, None for fp32
    compile: bool = False
    tta: bool = False


def options_from(config) -> PredictorOptions:
    """The predictor options of a resolved :class:`runtime.arguments.Config` (``--tta`` is
    predict's: evaluation scores the logits)."""
    return PredictorOptions(channels_last=config.channels_last, int8=config.int8,
                            amp_dtype=config.amp_dtype if config.amp else None,
                            compile=config.compile, tta=config.tta and config.exec_mode == "predict")


def autocast_context(amp_dtype: str | None, device: torch.device) -> Callable[[], object]:
    """``() -> context`` for the (resolved) autocast type, a null context for fp32."""
    if amp_dtype is None:
        return nullcontext
    dtype = torch.float16 if amp_dtype == "fp16" else torch.bfloat16
    return partial(torch.autocast, device_type=device.type, dtype=dtype)


def build_predictor(model: torch.nn.Module, device: torch.device, options: PredictorOptions,
                    inference_copy: bool = False) -> Predict:
    """``windows (B, 1, *roi) -> (B, 3, *roi)`` float32 logits (softmax means with ``tta``).

    ``model`` is used as it is (already compiled, or an OpenVINO module) unless
    ``inference_copy``: then its inference copy (channels-last or int8 asked) is made and
    compiled with ``options.compile``; ``model`` itself is not changed. The caller sets eval mode.
    """
    if inference_copy:
        if options.channels_last or options.int8:
            model = prepare_for_inference(model, channels_last=True, int8=options.int8)
        model = compile_model(model.eval(), options.compile)
    autocast = autocast_context(options.amp_dtype, device)
    channels_last = options.channels_last or options.int8

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
