"""``build_components(plan, dist_info, data)``: everything a run computes with, built once from
a resolved plan (training: the optimizer and the train step too; evaluation only scores). Each
part is built from the plan's section it reads: the network from ``plan.network``
(:func:`build_model`), autocast from ``plan.precision`` (:func:`autocast_factory`), the optimizer's
step and the CUDA graph from ``plan.training``, the loaders from the data's terms of the plan
(:func:`loader_settings`). Used by ``runtime.clocked.start``, the benchmarks and the tests alike.

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
from data_loading.source import DataSource, EvalLoader, LoaderSettings, TrainLoader
from runtime import checkpoint as ckpt
from runtime import distributed as D
from runtime.compiling import compile_model
from runtime.levers.cpu.convert import apply_levers, levers_compile
from runtime.optimizers import make_optimizer
from runtime.plan import NetworkPlan, PrecisionPlan, RunPlan, TrainingPlan
from runtime.precision import autocast_context

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

    plan: RunPlan  # resolved (runtime.resolve)
    dist: D.DistInfo
    model: torch.nn.Module  # possibly DDP- and/or compile-wrapped
    optimizer: torch.optim.Optimizer | None
    scaler: torch.amp.GradScaler | None
    loss_fn: Callable
    score_fn: Callable
    autocast: Callable[[], object]
    step: TrainStep | None
    train_loader: TrainLoader | None  # None until with_loaders
    val_loader: EvalLoader | None
    # Evaluation bypasses DDP: its forward would broadcast buffers (batch norm) on every call,
    # and ranks slide different numbers of windows.
    eval_model: torch.nn.Module
    state: ckpt.TrainState = field(default_factory=ckpt.TrainState)


def autocast_factory(precision: PrecisionPlan, device: torch.device):
    """``(() -> context, scaler)`` for the resolved ``precision``; the scaler is enabled only for fp16."""
    scaler = torch.amp.GradScaler(device.type, enabled=precision.autocast == "fp16")
    return autocast_context(precision.autocast, device), scaler


def configure_backends(cudnn_benchmark: bool, cudnn_deterministic: bool, device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = cudnn_benchmark
        torch.backends.cudnn.deterministic = cudnn_deterministic


def build_model(network: NetworkPlan, device: torch.device, distributed: bool = False,
                channels_last: bool = False) -> torch.nn.Module:
    """The plan's ``network`` (one output per label of its label set) on ``device``: sync batch norm
    converted where ``distributed`` (one process runs batch norm: ``runtime.resolve.decide_architecture``),
    in the channels-last layout with ``channels_last`` (the precision section's)."""
    model = Unet3D(IN_CHANNELS, network.n_classes, normalization=network.normalization,
                   activation=network.activation, filters=network.filters)
    if network.normalization == "syncbatchnorm" and distributed:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last_3d)
    return model


def wrap_model(model: torch.nn.Module, compile: bool, dist_info: D.DistInfo) -> torch.nn.Module:
    """``model`` in DDP where the run is distributed, compiled with ``compile`` (the plan's)."""
    if dist_info.distributed:
        ids = [dist_info.device.index] if dist_info.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return compile_model(model, compile)


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


def graphed_train_step(model, loss_fn, optimizer, scaler, autocast, batch_shape: tuple[int, ...],
                       channels_last: bool, ga_steps: int, device: torch.device) -> TrainStep:
    """The whole step replayed from a CUDA graph (``runtime.resolve`` allowed it: ga_steps 1,
    world size 1), captured on an all-zero batch of ``batch_shape`` (the training batch: batch
    size, 1 channel, the patch; channels-last with ``channels_last``); the capture's warm-up
    steps are undone, so weights and optimizer state are those restored before."""
    from runtime.levers.gpu.graphs import GraphedTrainStep

    image = torch.zeros(batch_shape, dtype=torch.float32, device=device)
    if channels_last:
        image = image.contiguous(memory_format=torch.channels_last_3d)
    label = torch.zeros(batch_shape, dtype=torch.uint8, device=device)
    graphed = GraphedTrainStep(model, loss_fn, optimizer, image, label, autocast, scaler)
    # A padded step (the epoch's last, where the batch does not divide the cases) runs eagerly on
    # the same weights and optimizer state, which the graph reads in place.
    eager = eager_train_step(model, loss_fn, optimizer, scaler, autocast, ga_steps)

    def step(image, label, last_micro_batch=True, weights=None):
        if weights is None:
            return graphed(image, label)
        optimizer.zero_grad(set_to_none=True)  # the graph's gradients stay in its own pool
        return eager(image, label, last_micro_batch, weights)

    return step


def build_optimizer(training: TrainingPlan, flags, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer of ``flags`` (``--optimizer`` and its hyper-parameters) over ``model``'s
    parameters, with the step the ``training`` section decided (fused, or foreach:
    ``runtime.resolve.decide_fused_optimizer``)."""
    return make_optimizer(flags.optimizer, model.parameters(), flags.learning_rate, flags.momentum,
                          flags.weight_decay, flags.lamb_betas, fused=training.fused_optimizer,
                          foreach=training.foreach_optimizer)


def build_components(plan: RunPlan, dist_info: D.DistInfo, data: DataSource | None = None,
                     saved: ckpt.Saved | None = None) -> Components:
    """Model, loss, optimizer, scaler, train step and this rank's loaders for a resolved
    ``plan`` (a plan with no training section: model, loss, metric and loaders only). ``data``:
    the data source (``loaders(settings, world, rank, device)``; ``plan`` resolved with its
    data), or None: no loaders yet (:func:`with_loaders` adds them).

    ``saved``: a resumed run (weights, optimizer, scaler, RNG and training state restored) or
    a checkpoint whose (best) weights are loaded (``--load_ckpt_path``).
    The seed of this rank is set before the weights are initialised.
    """
    device, flags, precision, training = dist_info.device, plan.config, plan.precision, plan.training
    configure_backends(flags.cudnn_benchmark, flags.cudnn_deterministic, device)
    torch.manual_seed(D.rank_seed(plan.seed, dist_info.rank))
    model = build_model(plan.network, device, dist_info.distributed, precision.channels_last)
    apply_levers(model, precision.levers, precision.compile)
    autocast, scaler = autocast_factory(precision, device)
    optimizer = build_optimizer(training, flags, model) if training is not None else None
    state = ckpt.TrainState()
    if saved is not None and saved.resume:
        state = ckpt.restore(saved.checkpoint, saved.path, model, optimizer, scaler, device)
    elif saved is not None and saved.pretrained:  # --pretrained_weights: the plan says which layers
        skip = ckpt.OUTPUT_LAYER if training.pretrained == "every layer but the output" else ""
        ckpt.load_model_weights(model, ckpt.model_state_from(saved.checkpoint), saved.path, skip=skip)
    elif saved is not None:
        ckpt.load_weights(model, saved.path, saved.checkpoint)
    label_set = plan.network.label_set
    loss_fn = DiceCELoss(to_onehot_y=True, use_softmax=True, include_background=flags.include_background,
                         ignore_index=label_set.ignore)
    score_fn = DiceScore(to_onehot_y=True, use_argmax=True, include_background=flags.include_background,
                         absent_nan=not label_set.benchmark_data, ignore_index=label_set.ignore)
    wrapped = wrap_model(model, precision.compile, dist_info)
    if training is None:
        step = None
    elif training.cuda_graphs:
        step = graphed_train_step(wrapped, loss_fn, optimizer, scaler, autocast, training_batch(plan),
                                  precision.channels_last, flags.ga_steps, device)
    else:
        step = eager_train_step(wrapped, loss_fn, optimizer, scaler, autocast, flags.ga_steps)
    components = Components(plan=plan, dist=dist_info, model=wrapped, optimizer=optimizer,
                            scaler=scaler if training is not None else None, loss_fn=loss_fn, score_fn=score_fn,
                            autocast=autocast, step=step, train_loader=None, val_loader=None,
                            eval_model=compile_model(model, precision.compile) if dist_info.distributed else wrapped,
                            state=state)
    return components if data is None else with_loaders(components, data)


def training_batch(plan: RunPlan) -> tuple[int, ...]:
    """The shape of one training batch: ``--batch_size`` samples of 1 channel, the network's patch."""
    return (plan.config.batch_size, 1, *plan.network.patch)


def compiles_lazily(plan: RunPlan) -> bool:
    """Whether the run's first steps compile: ``--compile``, or a lever that compiles (the
    channels-last CPU fused norm kernels). Not with ``--cuda_graphs``, whose capture has already
    run its warm-up steps."""
    precision, graphed = plan.precision, plan.training is not None and plan.training.cuda_graphs
    return bool(precision.compile or levers_compile(precision.levers)) and not graphed


def warm_up(components: Components) -> bool:
    """Where the run's first steps compile (:func:`compiles_lazily`): one training step's forward
    and backward on an all-zero batch of the training shape (training), and one window batch of
    the evaluation, run before the MLPerf clock starts, as NVIDIA's v4.0 code warms up on
    synthetic data. Nothing the run computes changes: no optimizer step, the gradients dropped,
    the buffers (batch norm's running statistics) put back. Returns whether it ran."""
    from runtime.inference.predictor import build_predictor, options_from

    plan, device = components.plan, components.dist.device
    if not compiles_lazily(plan):
        return False
    inference = plan.inference
    memory_format = torch.channels_last_3d if plan.precision.channels_last else torch.contiguous_format
    buffers = {name: buffer.clone() for name, buffer in ckpt.unwrap(components.model).named_buffers()}
    if plan.training is not None:
        shape = training_batch(plan)
        image = torch.zeros(shape, device=device).contiguous(memory_format=memory_format)
        components.step(image, torch.zeros(shape, dtype=torch.uint8, device=device), False)
        components.optimizer.zero_grad(set_to_none=True)
    model = components.eval_model
    model.eval()
    try:
        with torch.no_grad():
            build_predictor(model, device, options_from(plan.precision, inference))(
                torch.zeros((inference.window_batch, 1, *inference.window), device=device))
    finally:
        model.train()
    with torch.no_grad():
        for name, buffer in ckpt.unwrap(components.model).named_buffers():
            buffer.copy_(buffers[name])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return True


def loader_settings(plan: RunPlan) -> LoaderSettings:
    """How the data source builds this rank's loaders for ``plan`` (resolved with its data:
    ``runtime.resolve.resolve_data``), in the data's terms (``data_loading.source``)."""
    if plan.data is None or plan.seed is None:
        raise ValueError("the plan must be resolved with its data (runtime.resolve.resolve_data) before "
                         "its loaders are built")
    flags = plan.config
    return LoaderSettings(
        trains=plan.training is not None, seed=plan.seed, cache=plan.data.cache, patch=tuple(flags.input_shape),
        batch_size=flags.batch_size, ga_steps=flags.ga_steps, last_batch=flags.last_batch, crop=flags.semantics,
        oversampling=flags.oversampling, brightness=flags.brightness, num_workers=flags.num_workers,
        prefetch=flags.prefetch, window=plan.inference.window, overlap=plan.inference.overlap)


def with_loaders(components: Components, data: DataSource, plan: RunPlan | None = None) -> Components:
    """``components`` with this rank's loaders of ``data`` (``data.loaders``: the cases listed,
    the training labels read, the volumes checked and, with ``--cache device``, uploaded) and
    ``plan`` (default ``components.plan``), resolved with the data
    (``runtime.resolve.resolve_data``)."""
    dist_info = components.dist
    plan = components.plan if plan is None else plan
    loaders = data.loaders(loader_settings(plan), dist_info.world_size, dist_info.rank, dist_info.device)
    return replace(components, plan=plan, train_loader=loaders.train, val_loader=loaders.eval)
