"""``build_components(config, dist_info, data)``: everything a run computes with, built once from
a resolved config (training: the optimizer and the train step too; evaluation only scores).
Used by ``runtime.clocked.start``, the benchmarks and the tests alike.

``runtime.clocked.start.start_run`` builds in two parts around the MLPerf ``run_start``: the
model, optimizer and train step before it (``data`` None: no loaders, nothing of ``--data_dir`` touched), this
rank's loaders after it (:func:`with_loaders`).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from model.losses import DiceCELoss, DiceScore
from model.unet3d import IN_CHANNELS, Unet3D
from runtime import checkpoint as ckpt
from runtime import distributed as D
from runtime.config import Config
from runtime.compiling import compile_model
from runtime.labels import KITS19_LABELS
from runtime.levers.cpu.convert import apply_levers, levers_compile
from runtime.optimizers import make_optimizer
from runtime.plan import RunPlan
from runtime.inference.predictor import autocast_context

# step(image, label, last_micro_batch, weights=None) -> detached loss of the micro-batch, on the
# device; on the last micro-batch of an optimizer step the gradients are all-reduced and the update
# applied. ``weights``: the per-sample loss weights of a micro-batch of a padded step
# (data_loading.sampler.step_weights), None for every other batch (the step as it always was).
TrainStep = Callable[..., torch.Tensor]


@dataclass
class Components:
    """The model and what trains and scores it, plus this rank's loaders and training state. A
    run that does not train (evaluate, ``--benchmark``'s evaluation) has no optimizer, scaler or
    train step (None)."""

    config: Config  # resolved (runtime.resolve)
    dist: D.DistInfo
    model: torch.nn.Module  # possibly DDP- and/or compile-wrapped
    optimizer: torch.optim.Optimizer | None
    scaler: torch.amp.GradScaler | None
    loss_fn: Callable
    score_fn: Callable
    autocast: Callable[[], object]
    step: TrainStep | None
    train_loader: object  # None until with_loaders
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


def network_classes(config: Config) -> int:
    """The network's outputs: one per class of a resolved plan's label set (``runtime.labels``);
    KiTS19's 3 for a bare :class:`Config` (a tool that plans nothing)."""
    return config.label_set.n_classes if isinstance(config, RunPlan) else len(KITS19_LABELS)


def build_model(config: Config, device: torch.device, distributed: bool = False) -> torch.nn.Module:
    model = Unet3D(IN_CHANNELS, network_classes(config), normalization=config.normalization,
                   activation=config.activation, filters=config.filters)
    if config.normalization == "syncbatchnorm" and distributed:  # one process: batch norm (resolve.decide_architecture)
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last_3d)
    return model


def wrap_model(model: torch.nn.Module, config: Config, dist_info: D.DistInfo) -> torch.nn.Module:
    if dist_info.distributed:
        ids = [dist_info.device.index] if dist_info.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return compile_model(model, config.compile)


def weighted_loss(loss_fn: Callable, logits: torch.Tensor, label: torch.Tensor,
                  weights) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_j weights[j] * loss_fn(sample j), sum of the real samples' losses / batch)`` for a
    micro-batch of a padded step: each sample's loss is ``loss_fn`` on that sample alone (the
    batch loss of ``model.losses`` is the mean of these), a padding sample (weight 0) adds
    nothing. The second value is the batch's share of the epoch's mean loss, as a full batch's
    mean is. A batch of padding only still backpropagates (a zero loss): under DDP every rank's
    backward must run for the gradient all-reduce."""
    real = [j for j, w in enumerate(weights) if w > 0]
    losses = [loss_fn(logits[j:j + 1], label[j:j + 1]) for j in real]
    if not losses:
        zero = logits.float().sum() * 0.0
        return zero, zero.detach()
    per_sample = torch.stack(losses)
    w = torch.tensor([weights[j] for j in real], dtype=per_sample.dtype, device=per_sample.device)
    return (per_sample * w).sum(), per_sample.detach().sum() / len(weights)


def eager_train_step(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                     scaler: torch.amp.GradScaler, autocast: Callable[[], object], ga_steps: int) -> TrainStep:
    """Forward, backward and, on the ``last_micro_batch`` of an optimizer step, DDP's gradient
    all-reduce and the optimizer step (gradient accumulation: the others skip both). No host sync.
    ``weights`` (a padded step's micro-batch): the loss is :func:`weighted_loss`, whose weights
    already hold the accumulation's and DDP's factors."""

    def step(image, label, last_micro_batch: bool = True, weights=None) -> torch.Tensor:
        no_sync = getattr(model, "no_sync", None)
        with no_sync() if (no_sync is not None and not last_micro_batch) else nullcontext():
            with autocast():
                if weights is None:
                    loss = loss_fn(model(image), label) / ga_steps
                else:
                    loss, reported = weighted_loss(loss_fn, model(image), label, weights)
            scaler.scale(loss).backward()
        if last_micro_batch:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach() * ga_steps if weights is None else reported

    return step


def graphed_train_step(model, loss_fn, optimizer, scaler, autocast, config: Config,
                       device: torch.device) -> TrainStep:
    """The whole step replayed from a CUDA graph (``runtime.resolve`` allowed it: ga_steps 1,
    world size 1), captured on an all-zero batch of the training shape; the capture's warm-up
    steps are undone, so weights and optimizer state are those restored before."""
    from runtime.levers.gpu.graphs import GraphedTrainStep

    shape = (config.batch_size, 1, *config.input_shape)
    image = torch.zeros(shape, dtype=torch.float32, device=device)
    if config.channels_last:
        image = image.contiguous(memory_format=torch.channels_last_3d)
    label = torch.zeros(shape, dtype=torch.uint8, device=device)
    graphed = GraphedTrainStep(model, loss_fn, optimizer, image, label, autocast, scaler)
    # A padded step (the epoch's last, where the batch does not divide the cases) runs eagerly on
    # the same weights and optimizer state, which the graph reads in place.
    eager = eager_train_step(model, loss_fn, optimizer, scaler, autocast, config.ga_steps)

    def step(image, label, last_micro_batch=True, weights=None):
        if weights is None:
            return graphed(image, label)
        optimizer.zero_grad(set_to_none=True)  # the graph's gradients stay in its own pool
        return eager(image, label, last_micro_batch, weights)

    return step


def build_components(plan: RunPlan, dist_info: D.DistInfo, data=None,
                     saved: ckpt.Saved | None = None) -> Components:
    """Model, loss, optimizer, scaler, train step and this rank's loaders for a resolved
    ``plan`` (a run that does not train: model, loss, metric and loaders only). ``data``: the
    data source (``loaders(plan, world, rank, device)``; ``plan`` resolved with its data), or
    None: no loaders yet (:func:`with_loaders` adds them).

    ``saved``: a resumed run (weights, optimizer, scaler, RNG and training state restored) or
    a checkpoint whose (best) weights are loaded (``--load_ckpt_path``).
    The seed of this rank is set before the weights are initialised.
    """
    device = dist_info.device
    configure_backends(plan, device)
    torch.manual_seed(D.rank_seed(plan.seed, dist_info.rank))
    model = build_model(plan, device, dist_info.distributed)
    apply_levers(model, plan.levers, plan.compile)
    autocast, scaler = autocast_factory(plan, device)
    trains = plan.mode.trains
    # the step as planned (runtime.resolve.decide_fused_optimizer)
    optimizer = make_optimizer(plan.optimizer, model.parameters(), plan.learning_rate,
                               plan.momentum, plan.weight_decay, plan.lamb_betas,
                               fused=plan.fused_optimizer, foreach=plan.foreach_optimizer) if trains else None
    state = ckpt.TrainState()
    if saved is not None and saved.resume:
        state = ckpt.restore(saved.checkpoint, saved.path, model, optimizer, scaler, device)
    elif saved is not None and saved.pretrained:  # --pretrained_weights: the plan says which layers
        skip = ckpt.OUTPUT_LAYER if plan.pretrained == "every layer but the output" else ""
        ckpt.load_model_weights(model, ckpt.model_state_from(saved.checkpoint), saved.path, skip=skip)
    elif saved is not None:
        ckpt.load_weights(model, saved.path, saved.checkpoint)
    label_set = plan.label_set
    loss_fn = DiceCELoss(to_onehot_y=True, use_softmax=True, include_background=plan.include_background,
                         ignore_index=label_set.ignore)
    score_fn = DiceScore(to_onehot_y=True, use_argmax=True, include_background=plan.include_background,
                         absent_nan=not label_set.benchmark_data, ignore_index=label_set.ignore)
    wrapped = wrap_model(model, plan, dist_info)
    if not trains:
        step = None
    elif plan.cuda_graphs:
        step = graphed_train_step(wrapped, loss_fn, optimizer, scaler, autocast, plan, device)
    else:
        step = eager_train_step(wrapped, loss_fn, optimizer, scaler, autocast, plan.ga_steps)
    components = Components(config=plan, dist=dist_info, model=wrapped, optimizer=optimizer,
                            scaler=scaler if trains else None, loss_fn=loss_fn, score_fn=score_fn,
                            autocast=autocast, step=step, train_loader=None, val_loader=None,
                            eval_model=compile_model(model, plan.compile) if dist_info.distributed else wrapped,
                            state=state)
    return components if data is None else with_loaders(components, data)


def compiles_lazily(config: Config, device: torch.device) -> bool:
    """Whether the run's first steps compile: ``--compile``, or a lever that compiles (the
    channels-last CPU fused norm kernels). Not with ``--cuda_graphs``, whose capture has already
    run its warm-up steps."""
    return bool(config.compile or levers_compile(config.levers)) and not config.cuda_graphs


def warm_up(components: Components) -> bool:
    """Where the run's first steps compile (:func:`compiles_lazily`): one training step's forward
    and backward on an all-zero batch of the training shape (training), and one window batch of
    the evaluation, run before the MLPerf clock starts, as NVIDIA's v4.0 code warms up on
    synthetic data. Nothing the run computes changes: no optimizer step, the gradients dropped,
    the buffers (batch norm's running statistics) put back. Returns whether it ran."""
    from runtime.inference.predictor import build_predictor, options_from

    config, device = components.config, components.dist.device
    if not compiles_lazily(config, device):
        return False
    memory_format = torch.channels_last_3d if config.channels_last else torch.contiguous_format
    buffers = {name: buffer.clone() for name, buffer in ckpt.unwrap(components.model).named_buffers()}
    if config.mode.trains:
        shape = (config.batch_size, 1, *config.input_shape)
        image = torch.zeros(shape, device=device).contiguous(memory_format=memory_format)
        components.step(image, torch.zeros(shape, dtype=torch.uint8, device=device), False)
        components.optimizer.zero_grad(set_to_none=True)
    model = components.eval_model
    model.eval()
    try:
        with torch.no_grad():
            build_predictor(model, device, options_from(config))(
                torch.zeros((config.sw_batch_size, 1, *config.val_input_shape), device=device))
    finally:
        model.train()
    with torch.no_grad():
        for name, buffer in ckpt.unwrap(components.model).named_buffers():
            buffer.copy_(buffers[name])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return True


def with_loaders(components: Components, data, config: Config | None = None) -> Components:
    """``components`` with this rank's loaders of ``data`` (``data.loaders``: the cases listed,
    the training labels read, the volumes checked and, with ``--cache device``, uploaded) and
    ``config`` (default ``components.config``), resolved with the data
    (``runtime.resolve.resolve_data``)."""
    dist_info = components.dist
    config = components.config if config is None else config
    train_loader, val_loader = data.loaders(config, dist_info.world_size, dist_info.rank, dist_info.device)
    return replace(components, config=config, train_loader=train_loader, val_loader=val_loader)
