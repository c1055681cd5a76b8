"""Checkpoints: atomic writes, the reference's keys, everything a resume needs."""
from __future__ import annotations

import os
from typing import Any

import torch

from data_loading.atomic import atomic_write

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated or does not fit the model (one-line message)."""


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under DDP and torch.compile wrappers."""
    while True:
        if hasattr(model, "module"):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def clean_state_dict(state: dict) -> dict:
    """Strip ``module.`` / ``_orig_mod.`` prefixes left by DDP or torch.compile."""
    out = {}
    for key, value in state.items():
        for prefix in ("module.", "_orig_mod."):
            while key.startswith(prefix):
                key = key[len(prefix):]
        out[key] = value
    return out


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to a temporary file in the same folder, then rename over ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, lambda handle: torch.save(obj, handle))


def load_checkpoint(path: str) -> dict:
    """Load a checkpoint safely (``weights_only``); numpy scalars of reference checkpoints are
    allowed explicitly. Raises :class:`CheckpointError` with a one-line message."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as first:  # noqa: BLE001 - re-raised as a one-line error below
        try:
            import numpy as np

            allowed = [np.dtype, type(np.dtype("float64")), type(np.dtype("float32")),
                       type(np.dtype("int64"))]
            scalar = getattr(getattr(np, "_core", np), "multiarray").scalar
            with torch.serialization.safe_globals([scalar, *allowed]):
                return torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001
            reason = str(first).strip().splitlines()[0] if str(first).strip() else type(first).__name__
            raise CheckpointError(f"cannot read checkpoint {path!r} (truncated or not a torch "
                                  f"checkpoint): {reason[:200]}") from None


def model_state_from(checkpoint: dict, prefer: str = "best") -> dict:
    """The model weights in a checkpoint: ours, the reference's, or a bare state_dict."""
    order = (["best_model_state_dict", "last_model_state_dict"] if prefer == "best"
             else ["last_model_state_dict", "best_model_state_dict"]) + ["model_state_dict", "state_dict"]
    for key in order:
        if isinstance(checkpoint.get(key), dict):
            return clean_state_dict(checkpoint[key])
    if checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        return clean_state_dict(checkpoint)
    raise CheckpointError("checkpoint holds no model state_dict (expected 'best_model_state_dict')")


def load_model_weights(model: torch.nn.Module, state: dict, path: str) -> None:
    """Load ``state`` into ``model`` strictly, with a one-line error on any mismatch."""
    target = unwrap(model)
    own = target.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    wrong = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or wrong:
        detail = (f"{len(missing)} missing, {len(unexpected)} unexpected, {len(wrong)} wrong-shape keys"
                  + (f" (first wrong: {wrong[0]} {tuple(state[wrong[0]].shape)} vs "
                     f"{tuple(own[wrong[0]].shape)})" if wrong else "")
                  + (f" (first missing: {missing[0]})" if missing and not wrong else ""))
        raise CheckpointError(f"checkpoint {path!r} does not match the model (--filters/--normalization?): "
                              f"{detail}")
    target.load_state_dict(state)


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
