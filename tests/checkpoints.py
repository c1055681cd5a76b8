"""Checkpoint files for tests, so that no test spells a checkpoint key.

:func:`write_checkpoint` writes one through the project's own writer
(``runtime.checkpoint.save``): when the format changes, every test reads the new format at once.
The layouts this project only reads, never writes, each have a named writer: the MLCommons
reference's (:func:`reference_format_checkpoint`), a bare DDP-prefixed state_dict
(:func:`ddp_state_dict_checkpoint`) and files that are not checkpoints at all
(:func:`broken_checkpoint`).
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

from runtime import checkpoint as ckpt
from runtime.arguments import Config
from runtime.build import autocast_factory, build_model
from runtime.optimizers import make_optimizer
from runtime.plan import InferencePlan, PrecisionPlan, RunPlan, TrainingPlan
from runtime.resolve import network_of_flags

CPU = torch.device("cpu")
BROKEN = ("not_a_dict", "no_model", "truncated", "garbage")


def architecture(filters, normalization: str = "instancenorm", activation: str = "relu") -> Config:
    """The default config with these network flags: what :func:`write_checkpoint` saves."""
    return dataclasses.replace(Config(), filters=tuple(filters), normalization=normalization,
                               activation=activation)


def flags_plan(config: Config) -> RunPlan:
    """A plan of ``config``'s flags alone, each section's values the flags' as given, with no
    decision (what a test that plans nothing saves: the flags, and an empty plan; what a test of
    a builder hands it)."""
    return RunPlan(config=config, decisions=(), device="cpu", host_memory=False, network=network_of_flags(config),
                   precision=PrecisionPlan(config.amp, config.amp_dtype, int8=config.int8,
                                           channels_last=config.channels_last, compile=config.compile),
                   inference=InferencePlan(config.backend, tuple(config.val_input_shape), config.overlap,
                                           config.sw_batch_size, tta=config.tta, cache_dir=config.cache_dir,
                                           checkpoints=config.checkpoints),
                   training=TrainingPlan(config.fused_optimizer, False, config.cuda_graphs, config.epochs,
                                         start_eval_at=config.start_eval_at, evaluate_every=config.evaluate_every),
                   seed=config.seed, division=config.submission_division)


def unet(config: Config, seed: int = 0) -> torch.nn.Module:
    """The network ``config`` describes, initialised from ``seed`` (the global RNG untouched),
    in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(network_of_flags(config), CPU).eval()


def _optimizer_and_scaler(config: Config, model: torch.nn.Module):
    """A fresh optimizer and gradient scaler of ``config``, built as a training run builds them."""
    _, scaler = autocast_factory(flags_plan(config).precision, CPU)
    optimizer = make_optimizer(config.optimizer, model.parameters(), config.learning_rate, config.momentum,
                               config.weight_decay, config.lamb_betas)
    return optimizer, scaler


def checkpoint_dict(config: Config, model: torch.nn.Module | None = None, seed: int = 0,
                    status: str = "finished") -> dict:
    """What a training run of ``config`` saves before its first evaluation (no best weights:
    evaluate and predict load the last ones), with the weights of ``model`` (default:
    ``unet(config, seed)``), as ``runtime.checkpoint.payload`` builds it."""
    model = unet(config, seed) if model is None else model
    return ckpt.payload(model, *_optimizer_and_scaler(config, model), ckpt.TrainState(), flags_plan(config), CPU,
                        status)


def write_checkpoint(path, config: Config, model: torch.nn.Module | None = None, seed: int = 0,
                     status: str = "finished") -> torch.nn.Module:
    """:func:`checkpoint_dict` written to ``path`` by ``runtime.checkpoint.save`` (atomically, as
    a run saves it). Returns the model whose weights it holds."""
    model = unet(config, seed) if model is None else model
    ckpt.save(str(path), model, *_optimizer_and_scaler(config, model), ckpt.TrainState(), flags_plan(config), CPU,
              status)
    return model


def _state(weights) -> dict:
    return ckpt.cpu_weights(weights) if isinstance(weights, torch.nn.Module) else dict(weights)


def reference_format(best, last=None, best_score: float | None = None) -> dict:
    """A checkpoint in the MLCommons reference's layout: no format version, no config (the
    architecture comes from the flags), the ``best`` weights (a module or a state_dict) and, when
    given, the ``last`` ones under the reference's keys; ``best_score`` stored as the numpy
    scalar the reference saves."""
    checkpoint = {"best_model_state_dict": _state(best)}
    if last is not None:
        checkpoint["last_model_state_dict"] = _state(last)
    if best_score is not None:
        checkpoint["best_score"] = np.float64(best_score)
    return checkpoint


def format_1(best, last, epoch: int, best_epoch: int, best_mean_dice: float | None = None) -> dict:
    """A checkpoint of this project's format version 1, which had no ``has_best``: before the
    first evaluation ``best_epoch`` was 0 and the "best" weights stale."""
    checkpoint = {**reference_format(best, last), "format_version": 1, "best_epoch": best_epoch, "epoch": epoch}
    if best_mean_dice is not None:
        checkpoint["best_mean_dice"] = best_mean_dice
    return checkpoint


def reference_format_checkpoint(path, best, best_score: float | None = None) -> None:
    """:func:`reference_format` of ``best`` (a module or a state_dict) written to ``path``."""
    torch.save(reference_format(best, best_score=best_score), str(path))


def ddp_state_dict_checkpoint(path, weights) -> None:
    """A bare state_dict whose keys carry DDP's ``module.`` prefix, as other tools save it."""
    torch.save({f"module.{key}": value for key, value in _state(weights).items()}, str(path))


def broken_checkpoint(path, kind: str, source=None) -> None:
    """A file at ``path`` that is no usable checkpoint: ``not_a_dict`` (a pickled list),
    ``no_model`` (training state without any model state_dict), ``truncated`` (the first 1000
    bytes of the checkpoint file ``source``), ``garbage`` (bytes that are no torch file)."""
    if kind == "not_a_dict":
        torch.save([1, 2, 3], str(path))
    elif kind == "no_model":
        torch.save({"epoch": 3}, str(path))
    elif kind == "truncated":
        with open(source, "rb") as handle:
            head = handle.read(1000)
        assert os.path.getsize(source) > len(head), "the source must be longer than the cut"
        with open(path, "wb") as handle:
            handle.write(head)
    elif kind == "garbage":
        with open(path, "wb") as handle:
            handle.write(b"not a checkpoint at all")
    else:
        raise ValueError(f"broken_checkpoint: kind {kind!r} is not one of {BROKEN}")
