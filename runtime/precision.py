"""Autocast as a run's precision plan decides it: one context factory for the training step
(``runtime.build``), the window predictor (``runtime.inference.predictor``) and the CUDA graph's
capture alike. Nothing here touches a device at import."""
from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Callable

import torch


def autocast_context(amp_dtype: str | None, device: torch.device) -> Callable[[], object]:
    """``() -> context`` for the (resolved) autocast type ("bf16", "fp16"; the plan's
    ``precision.autocast``), a null context for float32 (None)."""
    if amp_dtype is None:
        return nullcontext
    dtype = torch.float16 if amp_dtype == "fp16" else torch.bfloat16
    return partial(torch.autocast, device_type=device.type, dtype=dtype)
