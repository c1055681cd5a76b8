"""``build_components(config, dist_info, data)``: everything a run computes with, built once from
a resolved config. Used by ``runtime.app.run``, the benchmarks and the tests alike.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from model.bf16_guard import bf16_weight_grad_ok, protect_shallow_convolutions
from model.losses import DiceCELoss, DiceScore
from model.unet3d import Unet3D
from runtime import checkpoint as ckpt
from runtime import distributed as D
from runtime.arguments import Config
from runtime.compiling import compile_model
from runtime.optimizers import make_optimizer
from runtime.predictor import autocast_context

# step(image, label, sync_grads, apply_update) -> detached loss of the micro-batch, on the device
TrainStep = Callable[[torch.Tensor, torch.Tensor, bool, bool], torch.Tensor]


@dataclass
class Components:
    """The model and what trains and scores it, plus this rank's loaders and training state."""

    config: Config  # resolved (runtime.resolve)
    dist: D.DistInfo
    model: torch.nn.Module  # possibly DDP- and/or compile-wrapped
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loss_fn: Callable
    score_fn: Callable
    autocast: Callable[[], object]
    step: TrainStep
    train_loader: object
    val_loader: object
    # Evaluation bypasses DDP: its forward would broadcast buffers (batch norm) on every call,
    # and ranks slide different numbers of windows.
    eval_model: torch.nn.Module
    state: ckpt.TrainState = field(default_factory=ckpt.TrainState)


def autocast_factory(config: Config, device: torch.device):
    """``(() -> context, scaler)`` for the configured (resolved) mixed precision; the scaler is
    enabled only for fp16."""
    amp_dtype = config.amp_dtype if config.amp else None
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == "fp16")
    return autocast_context(amp_dtype, device), scaler


def configure_backends(config: Config, device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = config.cudnn_benchmark
        torch.backends.cudnn.deterministic = config.cudnn_deterministic


def build_model(config: Config, device: torch.device, distributed: bool = False) -> torch.nn.Module:
    model = Unet3D(1, 3, normalization=config.normalization, activation=config.activation,
                   filters=config.filters)
    if config.normalization == "syncbatchnorm" and distributed:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last_3d)
    return model


def guard_bf16_training(model: torch.nn.Module, config: Config, device: torch.device, say: bool) -> None:
    """bf16 training on a CPU whose oneDNN gets 2-deep convolutions' weight gradients wrong:
    those convolutions run in float32 (:mod:`model.bf16_guard`)."""
    if not (config.is_train and config.amp and config.amp_dtype == "bf16" and device.type == "cpu"):
        return
    if bf16_weight_grad_ok():
        return
    protect_shallow_convolutions(model)
    if say:
        print("bf16: this CPU's oneDNN computes wrong weight gradients for convolutions over 2-voxel-deep "
              "inputs; those run in float32")


def wrap_model(model: torch.nn.Module, config: Config, dist_info: D.DistInfo) -> torch.nn.Module:
    if dist_info.distributed:
        ids = [dist_info.device.index] if dist_info.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return compile_model(model, config.compile)


def eager_train_step(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                     scaler: torch.amp.GradScaler, autocast: Callable[[], object], ga_steps: int) -> TrainStep:
    """Forward, backward and (when ``apply_update``) the optimizer step; DDP's gradient
    all-reduce is skipped unless ``sync_grads`` (gradient accumulation). No host sync."""

    def step(image, label, sync_grads: bool, apply_update: bool) -> torch.Tensor:
        no_sync = getattr(model, "no_sync", None)
        with no_sync() if (no_sync is not None and not sync_grads) else nullcontext():
            with autocast():
                loss = loss_fn(model(image), label) / ga_steps
            scaler.scale(loss).backward()
        if apply_update:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach() * ga_steps

    return step


def graphed_train_step(model, loss_fn, optimizer, scaler, autocast, config: Config,
                       device: torch.device) -> TrainStep:
    """The whole step replayed from a CUDA graph (``runtime.resolve`` allowed it: ga_steps 1,
    world size 1), captured on an all-zero batch of the training shape; the capture's warm-up
    steps are undone, so weights and optimizer state are those restored before."""
    from runtime.graphs import GraphedTrainStep

    shape = (config.batch_size, 1, *config.input_shape)
    image = torch.zeros(shape, dtype=torch.float32, device=device)
    if config.channels_last:
        image = image.contiguous(memory_format=torch.channels_last_3d)
    label = torch.zeros(shape, dtype=torch.uint8, device=device)
    graphed = GraphedTrainStep(model, loss_fn, optimizer, image, label, autocast, scaler)
    return lambda image, label, sync_grads=True, apply_update=True: graphed(image, label)


def build_components(config: Config, dist_info: D.DistInfo, data,
                     saved: ckpt.Saved | None = None) -> Components:
    """Model, loss, optimizer, scaler, train step and this rank's loaders for a resolved
    ``config``. ``data``: the data source (``loaders(config, world, rank, device)``).

    ``saved``: a resumed run (weights, optimizer, scaler, RNG and training state restored) or
    a checkpoint whose (best) weights are loaded (``--load_ckpt_path``).
    The seed of this rank is set before the weights are initialised.
    """
    device = dist_info.device
    configure_backends(config, device)
    torch.manual_seed(D.rank_seed(config.seed, dist_info.rank))
    model = build_model(config, device, dist_info.distributed)
    guard_bf16_training(model, config, device, dist_info.is_main)
    autocast, scaler = autocast_factory(config, device)
    optimizer = make_optimizer(config.optimizer, model.parameters(), config.learning_rate,
                               config.momentum, config.weight_decay, config.lamb_betas,
                               fused=config.fused_optimizer)
    state = ckpt.TrainState()
    if saved is not None and saved.resume:
        state = ckpt.restore(saved.checkpoint, saved.path, model, optimizer, scaler, device)
    elif saved is not None:
        ckpt.load_weights(model, saved.path, saved.checkpoint)
    loss_fn = DiceCELoss(to_onehot_y=True, use_softmax=True, include_background=config.include_background)
    score_fn = DiceScore(to_onehot_y=True, use_argmax=True, include_background=config.include_background)
    wrapped = wrap_model(model, config, dist_info)
    if config.cuda_graphs:
        step = graphed_train_step(wrapped, loss_fn, optimizer, scaler, autocast, config, device)
    else:
        step = eager_train_step(wrapped, loss_fn, optimizer, scaler, autocast, config.ga_steps)
    train_loader, val_loader = data.loaders(config, dist_info.world_size, dist_info.rank, device)
    return Components(config=config, dist=dist_info, model=wrapped, optimizer=optimizer, scaler=scaler,
                      loss_fn=loss_fn, score_fn=score_fn, autocast=autocast, step=step,
                      train_loader=train_loader, val_loader=val_loader,
                      eval_model=compile_model(model, config.compile) if dist_info.distributed else wrapped,
                      state=state)
