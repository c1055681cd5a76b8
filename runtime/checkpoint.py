"""Checkpoints: the one owner of their format. Atomic writes, the reference's keys, everything a
resume needs; every key is spelled here and nowhere else.

A checkpoint holds the reference's keys (``best_model_state_dict``, ``last_model_state_dict``,
``optimizer_state_dict``) so tools of either implementation read it, plus the training state of
:class:`TrainState`, the RNG states, the master seed and the run's config with the plan that ran
(``runtime.plan``: every decision of ``runtime.resolve``, plain data; :func:`saved_plan`).

Before the first evaluation there is no best: ``has_best`` is False and
``best_model_state_dict`` holds the last weights (tools that read the reference's keys get the
newest weights, not stale ones); a resume keeps no "best" from it, and evaluate and predict load
the last weights and say so (:func:`has_best`, :func:`weights_description`).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from data_loading.atomic import atomic_write
from runtime.plan import RunPlan, saved_values

FORMAT_VERSION = 2
# Reference checkpoints carry no version; ours from 1 on (2 adds ``has_best``). A newer version
# may hold keys this code does not know how to read, so it is refused rather than half-understood.
READABLE_VERSIONS = (None, 1, 2)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated or does not fit the model (one-line message)."""


@dataclass
class TrainState:
    """What a resume restores besides weights, optimizer, scaler and RNG states."""

    epoch: int = 0  # last epoch fully trained
    step_in_epoch: int = 0  # batches of epoch + 1 already trained (pre-empted mid-epoch)
    epoch_loss_sum: float = 0.0  # all ranks' loss sum over those batches
    best_mean_dice: float = -1.0
    best_epoch: int = 0
    best_state: dict | None = None  # CPU copy of the best weights
    last_eval: dict | None = None


@dataclass(frozen=True)
class Saved:
    """A checkpoint a run starts from: ``resume`` (all training state, ``--resume``) or only
    its weights (``--load_ckpt_path``: evaluation, warm start; ``pretrained``:
    ``--pretrained_weights``, training on data that may have another label set)."""

    path: str
    checkpoint: dict
    resume: bool
    pretrained: bool = False


def saved_for(config) -> Saved | None:
    """The checkpoint ``config`` starts from, read once (None: a fresh run, or ``--resume`` with
    no checkpoint written yet)."""
    if config.resume and os.path.isfile(config.save_ckpt_path):
        return Saved(config.save_ckpt_path, load_checkpoint(config.save_ckpt_path), resume=True)
    if config.load_ckpt_path:
        return Saved(config.load_ckpt_path, load_checkpoint(config.load_ckpt_path), resume=False)
    if config.pretrained_weights:
        return Saved(config.pretrained_weights, load_checkpoint(config.pretrained_weights), resume=False,
                     pretrained=True)
    return None


def saved_ensemble(config) -> list[Saved]:
    """Every checkpoint of ``--load_ckpt_path`` after the first (predict's ensemble), read once;
    [] for one checkpoint."""
    return [Saved(path, load_checkpoint(path), resume=False) for path in config.checkpoints[1:]]


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


def cpu_weights(model: torch.nn.Module) -> dict:
    """A CPU copy of the unwrapped model's state_dict (what a checkpoint stores)."""
    return {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()}


# -- reading ----------------------------------------------------------------------------------

def load_checkpoint(path: str) -> dict:
    """Load a checkpoint safely (``weights_only``); numpy scalars of reference checkpoints are
    allowed explicitly. Raises :class:`CheckpointError` with a one-line message."""
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} is a folder; give the checkpoint file")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as first:  # noqa: BLE001 - re-raised as a one-line error below
        checkpoint = _load_with_numpy_scalars(path, first)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"checkpoint {path!r} holds a {type(checkpoint).__name__}, not a dict of "
                              "weights and training state")
    version = checkpoint.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(f"checkpoint {path!r} has format_version {version!r}; this code reads "
                              f"version {FORMAT_VERSION} and reference checkpoints (update the code)")
    return checkpoint


def _numpy_scalar_types() -> list:
    import numpy as np

    scalar = getattr(getattr(np, "_core", np), "multiarray").scalar
    return [scalar, np.dtype, type(np.dtype("float64")), type(np.dtype("float32")), type(np.dtype("int64"))]


def _load_with_numpy_scalars(path: str, first: BaseException) -> dict:
    """Reference checkpoints hold numpy scalars, which ``weights_only`` loading refuses unless
    allowed: with ``safe_globals`` (torch >= 2.5) for this load only, or ``add_safe_globals``
    (torch 2.4). Torch 2.3 has neither: one line says so instead of blaming the file."""
    serialization = torch.serialization
    allow_for_this_load = getattr(serialization, "safe_globals", None)
    allow_from_now_on = getattr(serialization, "add_safe_globals", None)
    try:
        if allow_for_this_load is not None:
            with allow_for_this_load(_numpy_scalar_types()):
                return torch.load(path, map_location="cpu", weights_only=True)
        if allow_from_now_on is not None:
            allow_from_now_on(_numpy_scalar_types())
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - reported as one line below
        pass
    reason = str(first).strip().splitlines()[0] if str(first).strip() else type(first).__name__
    if allow_for_this_load is None and allow_from_now_on is None and "numpy" in str(first):
        raise CheckpointError(f"checkpoint {path!r} holds numpy values, which torch {torch.__version__} "
                              "cannot load safely (weights_only needs torch >= 2.4); re-save it with a "
                              "newer torch") from None
    raise CheckpointError(f"cannot read checkpoint {path!r} (truncated or not a torch "
                          f"checkpoint): {reason[:200]}") from None


def has_best(checkpoint: dict) -> bool:
    """Whether ``best_model_state_dict`` holds weights an evaluation chose.

    Ours from format 2 say it (``has_best``); format 1 wrote ``best_epoch`` 0 until the first
    evaluation (and the last weights as "best", stale after a resume); a reference checkpoint's
    best weights are the evaluated ones."""
    if "has_best" in checkpoint:
        return bool(checkpoint["has_best"])
    if checkpoint.get("format_version") is not None:
        return int(checkpoint.get("best_epoch") or 0) > 0
    return isinstance(checkpoint.get("best_model_state_dict"), dict)


def weights_key(checkpoint: dict, prefer: str = "best") -> str | None:
    """The key of the weights to load (None: a bare state_dict): ``prefer`` "best" takes the
    best weights only when :func:`has_best`, else the last ones."""
    best_first = prefer == "best" and has_best(checkpoint)
    order = (["best_model_state_dict", "last_model_state_dict"] if best_first
             else ["last_model_state_dict", "best_model_state_dict"]) + ["model_state_dict", "state_dict"]
    return next((key for key in order if isinstance(checkpoint.get(key), dict)), None)


def weights_description(checkpoint: dict, prefer: str = "best") -> str:
    """What :func:`model_state_from` loads, for the user: best or last weights, and of when."""
    key = weights_key(checkpoint, prefer)
    ours = checkpoint.get("format_version") is not None
    if key == "best_model_state_dict" and has_best(checkpoint):
        if ours:
            return (f"the best weights (epoch {int(checkpoint.get('best_epoch', 0))}, mean_dice "
                    f"{float(checkpoint.get('best_mean_dice', float('nan'))):.4f})")
        return "the best weights (best_model_state_dict)"
    if key in ("last_model_state_dict", "best_model_state_dict"):
        when = f"epoch {int(checkpoint['epoch'])}" if "epoch" in checkpoint else key
        why = "; no evaluation yet, so no best" if not has_best(checkpoint) else ""
        return f"the last weights ({when}{why})"
    return f"the weights ({key or 'a bare state_dict'})"


def model_state_from(checkpoint: dict, prefer: str = "best") -> dict:
    """The model weights in a checkpoint: ours, the reference's, or a bare state_dict
    (:func:`weights_key` decides which)."""
    key = weights_key(checkpoint, prefer)
    if key is not None:
        return clean_state_dict(checkpoint[key])
    if checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        return clean_state_dict(checkpoint)
    raise CheckpointError("checkpoint holds no model state_dict (expected 'best_model_state_dict')")


OUTPUT_LAYER = "output."  # model.unet3d.Unet3D's output layer: one channel per label


def load_model_weights(model: torch.nn.Module, state: dict, path: str, skip: str = "") -> None:
    """Load ``state`` into ``model`` strictly, with a one-line error on any mismatch; the
    parameters whose names start with ``skip`` (e.g. :data:`OUTPUT_LAYER`) are kept as they are."""
    target = unwrap(model)
    own = target.state_dict()
    if skip:
        state = {k: v for k, v in state.items() if not k.startswith(skip)}
        state.update({k: v for k, v in own.items() if k.startswith(skip)})
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    wrong = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if not (missing or unexpected or wrong):
        bad = next((k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
        if bad is not None:
            raise CheckpointError(f"checkpoint {path!r} holds non-finite weights ({bad}): the run it "
                                  "comes from diverged; use an earlier checkpoint")
    if missing or unexpected or wrong:
        detail = (f"{len(missing)} missing, {len(unexpected)} unexpected, {len(wrong)} wrong-shape keys"
                  + (f" (first wrong: {wrong[0]} {tuple(state[wrong[0]].shape)} vs "
                     f"{tuple(own[wrong[0]].shape)})" if wrong else "")
                  + (f" (first missing: {missing[0]})" if missing and not wrong else ""))
        raise CheckpointError(f"checkpoint {path!r} does not match the model (--filters/--normalization?): "
                              f"{detail}")
    target.load_state_dict(state)


def load_weights(model: torch.nn.Module, path: str, checkpoint: dict | None = None,
                 prefer: str = "best") -> None:
    """The ``prefer``-red weights of the checkpoint at ``path`` into ``model`` (``checkpoint``:
    the already-loaded dict, to avoid reading the file again)."""
    checkpoint = load_checkpoint(path) if checkpoint is None else checkpoint
    load_model_weights(model, model_state_from(checkpoint, prefer=prefer), path)


def saved_seed(checkpoint: dict) -> int | None:
    """The master seed a checkpoint's run used (None for reference checkpoints)."""
    seed = checkpoint.get("master_seed")
    return None if seed is None else int(seed)


def saved_config(checkpoint: dict) -> dict:
    """The config a checkpoint's run used, as a plain dict ({} for reference checkpoints)."""
    config = checkpoint.get("config")
    return config if isinstance(config, dict) else {}


def saved_plan(checkpoint: dict) -> dict[str, dict]:
    """The decisions the checkpoint's run made, by name (``{"precision": {"name", "value", "why",
    "asked"}, ...}``); {} for reference checkpoints and those written before the plan."""
    plan = saved_config(checkpoint).get("plan")
    return {d["name"]: d for d in plan if isinstance(d, dict) and "name" in d} if isinstance(plan, list) else {}


# The flags that define the network: a checkpoint records them (the reference's records none).
ARCHITECTURE = ("filters", "normalization", "activation")


@dataclass(frozen=True)
class TrainedNetwork:
    """What a checkpoint says of the network it holds, read once from it (:func:`trained_network`):
    ``architecture`` the network flags it recorded (``filters``, ``normalization``,
    ``activation``; {} for the reference's), ``label_set`` its classes and the Dice it was scored
    with (``runtime.labels``), ``target_spacing`` the mm per axis its data was resampled to,
    ``patch`` its training ``--input_shape`` (None, with ``patch_problem`` saying why, when it
    records no usable one), ``seed`` its run's master seed, :attr:`weights` the weights evaluate
    and predict load (the best, else the last; :func:`weights_description`), read when asked.

    A checkpoint written before label sets, spacings or the Dice were recorded, and the MLCommons
    reference's, holds KiTS19's network: its labels, its spacing, the benchmark's Dice."""

    path: str
    architecture: dict
    label_set: Any  # runtime.labels.LabelSet
    target_spacing: tuple[float, ...]
    patch: tuple[int, ...] | None
    patch_problem: str
    seed: int | None
    checkpoint: dict = field(compare=False, repr=False)

    @cached_property
    def weights(self) -> dict:
        """The weights evaluate and predict load (the best, else the last)."""
        return model_state_from(self.checkpoint, prefer="best")

    @cached_property
    def weights_sha256(self) -> str:
        """sha256 of :attr:`weights` (:func:`weights_digest`): what predict records beside each output."""
        return weights_digest(self.weights)


def trained_network(saved: Saved) -> TrainedNetwork:
    """The :class:`TrainedNetwork` of the checkpoint ``saved`` (read once: every accessor of the
    saved config and plan is here)."""
    from runtime.spacing import KITS19_SPACING, as_spacing

    config, plan = saved_config(saved.checkpoint), saved_plan(saved.checkpoint)
    architecture = {name: tuple(config[name]) if isinstance(config[name], list) else config[name]
                    for name in ARCHITECTURE if name in config}
    spacing = plan.get("target_spacing")
    patch, problem = _training_patch(config)
    return TrainedNetwork(saved.path, architecture, _label_set(plan),
                          as_spacing(spacing["value"]) if spacing and spacing.get("value") else KITS19_SPACING,
                          patch, problem, saved_seed(saved.checkpoint), saved.checkpoint)


def _label_set(plan: dict):
    """The label set a checkpoint's run decided (its ``labels``, ``dice`` and ``ignore_label``
    decisions). One written before the Dice was recorded was scored with nnU-Net's where its labels
    came from a description (the decision's reason names it) or are not KiTS19's, else the
    benchmark's; one before labels were recorded, and the reference's, is KiTS19's."""
    from runtime.labels import BENCHMARK, DEFINITIONS, KITS19_SET, NNUNET, LabelSet, as_labels

    made = plan.get("labels")
    if made is None or not made.get("value"):
        return KITS19_SET
    labels = as_labels(made["value"])
    dice = (plan.get("dice") or {}).get("value")
    if dice not in DEFINITIONS:
        described = "the description of" in str(made.get("why", ""))  # the data stage's own-data reason
        dice = BENCHMARK if labels == KITS19_SET.labels and not described else NNUNET
    ignore = (plan.get("ignore_label") or {}).get("value")
    return LabelSet(labels, dice, None if ignore is None else int(ignore))


def _training_patch(config: dict) -> tuple[tuple[int, ...] | None, str]:
    """``(patch, "")``: the ``--input_shape`` a checkpoint's run trained with, or ``(None, why
    not)`` (a reference checkpoint or one that records none, or a shape no window can have)."""
    from model.unet3d import SHAPE_DIVISOR

    patch = config.get("input_shape")
    if patch is None:
        return None, "the checkpoint records no training patch"
    try:
        patch = tuple(int(s) for s in patch)
    except (TypeError, ValueError):
        return None, f"the checkpoint's training patch {patch!r} is no shape"
    if len(patch) != 3 or not all(s > 0 and s % SHAPE_DIVISOR == 0 for s in patch):
        return None, f"the checkpoint's training patch {list(patch)} is no window of 3 multiples of {SHAPE_DIVISOR}"
    return patch, ""


def restore(checkpoint: dict, path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scaler: torch.amp.GradScaler, device: torch.device) -> TrainState:
    """Put a saved run back: last weights, optimizer, scaler and RNG states; returns its state."""
    if "optimizer_state_dict" not in checkpoint or "epoch" not in checkpoint:
        raise CheckpointError(f"checkpoint {path!r} has no training state to resume")
    load_model_weights(model, model_state_from(checkpoint, prefer="last"), path)
    load_optimizer_state(optimizer, checkpoint, path)
    if checkpoint.get("scaler_state_dict"):
        scaler.load_state_dict(checkpoint["scaler_state_dict"])
    if checkpoint.get("rng"):
        set_rng_state(checkpoint["rng"], device)
    return TrainState(epoch=int(checkpoint["epoch"]), step_in_epoch=int(checkpoint.get("step_in_epoch", 0)),
                      epoch_loss_sum=float(checkpoint.get("epoch_loss_sum", 0.0)),
                      best_mean_dice=float(checkpoint.get("best_mean_dice", -1.0)),
                      best_epoch=int(checkpoint.get("best_epoch", 0)),
                      best_state=checkpoint.get("best_model_state_dict") if has_best(checkpoint) else None,
                      last_eval=checkpoint.get("last_eval"))


# The hyper-parameters that tell the optimizers apart in a saved param group (reference
# checkpoints carry no config naming theirs).
OPTIMIZER_KEYS = {"SGD": {"momentum", "nesterov", "dampening"}, "Adam": {"betas", "eps", "amsgrad"},
                  "Lamb": {"betas", "eps"}}
OPTIMIZER_NAMES = {"SGD": "sgd", "Adam": "adam", "Lamb": "lamb"}


def load_optimizer_state(optimizer: torch.optim.Optimizer, checkpoint: dict, path: str) -> None:
    """The saved optimizer state, refused with one line when it belongs to another optimizer
    (``load_state_dict`` would take the other's hyper-parameters and fail at the first step)."""
    state = checkpoint["optimizer_state_dict"]
    groups = state.get("param_groups") if isinstance(state, dict) else None
    expected = OPTIMIZER_KEYS.get(type(optimizer).__name__, set()) | {"lr", "weight_decay"}
    saved = saved_config(checkpoint).get("optimizer")
    mine = OPTIMIZER_NAMES.get(type(optimizer).__name__)
    if not groups or any(not expected <= set(group) for group in groups) or (saved and mine and saved != mine):
        saved = saved or "another optimizer"
        raise CheckpointError(f"optimizer state in {path!r} ({saved}) does not fit --optimizer "
                              f"{mine or type(optimizer).__name__}; resume with the run's own --optimizer")
    # load_state_dict takes the saved groups' kernel choice too: keep this run's (its resolved
    # fused_optimizer decision; a fused step saved on one device or torch need not exist on another)
    kernels = [{k: group[k] for k in ("fused", "foreach") if k in group} for group in optimizer.param_groups]
    try:
        optimizer.load_state_dict(state)
        for group, own in zip(optimizer.param_groups, kernels):
            group.update(own)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"optimizer state in {path!r} does not fit this model and optimizer: "
                              f"{type(exc).__name__} {exc}") from None


# -- writing ----------------------------------------------------------------------------------

def payload(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
            state: TrainState, plan: RunPlan, device: torch.device, status: str) -> dict:
    """A checkpoint that tools expecting the reference's keys can read and that resumes a run of ``plan``."""
    last = {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
    return {
        "format_version": FORMAT_VERSION,
        # before the first evaluation: no best (has_best False), the reference's key gets the last
        "best_model_state_dict": state.best_state if state.best_state is not None else last,
        "has_best": state.best_state is not None,
        "last_model_state_dict": last,
        "optimizer_state_dict": optimizer.state_dict(),
        "scaler_state_dict": scaler.state_dict(),
        "epoch": state.epoch,
        "step_in_epoch": state.step_in_epoch,
        "epoch_loss_sum": state.epoch_loss_sum,
        "best_mean_dice": state.best_mean_dice,
        "best_epoch": state.best_epoch,
        "last_eval": state.last_eval,
        "master_seed": plan.seed,
        "rng": rng_state(device),
        "status": status,
        "config": saved_values(plan),  # the flags with the decided values overlaid, and the plan
    }


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to a temporary file in the same folder, then rename over ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, lambda handle: torch.save(obj, handle))


def save(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scaler: torch.amp.GradScaler, state: TrainState, plan: RunPlan, device: torch.device,
         status: str) -> None:
    """Write the run's checkpoint to ``path`` atomically (the caller decides which rank)."""
    atomic_save(payload(model, optimizer, scaler, state, plan, device, status), path)


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def weights_digest(state: dict) -> str:
    """sha256 over a state dict: the name, dtype, shape and bytes of every tensor, by name."""
    digest = hashlib.sha256()
    for name, value in sorted(state.items()):
        if not torch.is_tensor(value):
            digest.update(f"{name}|{value!r}|".encode())
            continue
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
