"""The training loop: named steps, evaluation on the MLPerf schedule, checkpoints, resume."""
from __future__ import annotations

import dataclasses
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
from mlperf_logging.mllog import constants as C

from runtime import distributed as D
from runtime.arguments import Config
from runtime.benchmark import format_summary, latency_summary
from runtime.checkpoint import atomic_save, rng_state, unwrap
from runtime.inference import evaluate
from runtime.logging import MetricsWriter, MLPerfLogger
from runtime.schedule import EvalSchedule, learning_rate_at
from runtime.signals import PreemptionFlag

PREEMPT_CHECK_EVERY = 8  # steps between collective pre-emption checks when world size > 1


@dataclass
class Components:
    """Everything the loop needs, built once by :mod:`runtime.app`."""

    config: Config
    dist: D.DistInfo
    model: torch.nn.Module  # possibly DDP- and/or compile-wrapped
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loss_fn: Callable
    score_fn: Callable
    autocast: Callable[[], object]
    mlperf: MLPerfLogger
    metrics: MetricsWriter
    preempt: PreemptionFlag = field(default_factory=PreemptionFlag)
    progress: Callable = lambda it, **_: it
    graphed_step: Callable | None = None  # built at the first batch with --cuda_graphs
    # Evaluation bypasses DDP: its forward would broadcast buffers (batch norm) on every call,
    # and ranks slide different numbers of windows.
    eval_model: torch.nn.Module | None = None


@dataclass
class TrainState:
    """What a resume restores besides weights and optimizer state."""

    epoch: int = 0  # last epoch fully trained
    step_in_epoch: int = 0  # batches of epoch + 1 already trained (pre-empted mid-epoch)
    epoch_loss_sum: float = 0.0
    best_mean_dice: float = -1.0
    best_epoch: int = 0
    best_state: dict | None = None  # CPU copy of the best weights
    last_eval: dict | None = None


@dataclass(frozen=True)
class RunResult:
    status: str  # success | aborted | preempted | finished
    epoch: int
    best_mean_dice: float


def train_step(c: Components, image: torch.Tensor, label: torch.Tensor, sync_grads: bool,
               apply_update: bool) -> torch.Tensor:
    """Forward, backward and (every ``ga_steps`` micro-batches) the optimizer step.

    Returns the detached micro-batch loss on the device: no host synchronisation here.
    """
    cfg = c.config
    if cfg.cuda_graphs and apply_update and sync_grads:  # supported only without accumulation/DDP
        if c.graphed_step is None:
            from runtime.graphs import GraphedTrainStep

            c.graphed_step = GraphedTrainStep(c.model, c.loss_fn, c.optimizer, image, label, c.autocast,
                                              c.scaler)
        return c.graphed_step(image, label)
    no_sync = getattr(c.model, "no_sync", None)
    ctx = no_sync() if (no_sync is not None and not sync_grads) else nullcontext()
    with ctx:
        with c.autocast():
            logits = c.model(image)
            loss = c.loss_fn(logits, label) / cfg.ga_steps
        c.scaler.scale(loss).backward()
    if apply_update:
        c.scaler.step(c.optimizer)
        c.scaler.update()
        c.optimizer.zero_grad(set_to_none=True)
    return loss.detach() * cfg.ga_steps


def step_inputs(c: Components, image: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch on the training device, the image in the model's memory format (no-op copies when
    the loader already delivered it there)."""
    image = image.to(c.dist.device, non_blocking=True)
    label = label.to(c.dist.device, non_blocking=True)
    if c.config.channels_last:
        image = image.contiguous(memory_format=torch.channels_last_3d)
    return image, label


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def checkpoint_payload(c: Components, state: TrainState, master_seed: int, status: str) -> dict:
    """A checkpoint that tools expecting the reference's keys can read and that resumes a run."""
    model = unwrap(c.model)
    last = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return {
        "format_version": 1,
        "best_model_state_dict": state.best_state if state.best_state is not None else last,
        "last_model_state_dict": last,
        "optimizer_state_dict": c.optimizer.state_dict(),
        "scaler_state_dict": c.scaler.state_dict(),
        "epoch": state.epoch,
        "step_in_epoch": state.step_in_epoch,
        "epoch_loss_sum": state.epoch_loss_sum,
        "best_mean_dice": state.best_mean_dice,
        "best_epoch": state.best_epoch,
        "last_eval": state.last_eval,
        "master_seed": master_seed,
        "rng": rng_state(c.dist.device),
        "status": status,
        "config": {k: (list(v) if isinstance(v, tuple) else v)
                   for k, v in dataclasses.asdict(c.config).items()},
    }


def save_checkpoint(c: Components, state: TrainState, master_seed: int, status: str) -> None:
    """Rank 0 writes ``--save_ckpt_path`` atomically (nothing when the path is empty)."""
    if c.config.save_ckpt_path and c.dist.is_main:
        atomic_save(checkpoint_payload(c, state, master_seed, status), c.config.save_ckpt_path)
    D.barrier()


def should_stop_for_preemption(c: Components, step: int, last_of_epoch: bool) -> bool:
    """Local flag at world size 1; at larger sizes all ranks agree every few steps and at the end
    of every epoch (a collective every step would cost a host sync per step)."""
    if not D.is_dist():
        return bool(c.preempt)
    if step % PREEMPT_CHECK_EVERY and not last_of_epoch:
        return False
    flag = torch.tensor([1.0 if c.preempt else 0.0], device=c.dist.device)
    return bool(D.all_reduce_sum(flag).item() > 0)


def run_evaluation(c: Components, val_loader, epoch: int) -> dict:
    cfg = c.config
    # Evaluation bypasses DDP; with batch norm every rank must use rank 0's running statistics
    # (the ones the checkpoint holds), not the ones its own last training forward left.
    D.broadcast_buffers(unwrap(c.model))
    c.mlperf.start(C.EVAL_START, metadata={"epoch_num": epoch})
    metrics = evaluate(c.eval_model or c.model, val_loader, c.loss_fn, c.score_fn, cfg.val_input_shape, cfg.overlap,
                       cfg.sw_batch_size, c.dist.device, c.autocast,
                       progress=lambda it: c.progress(it, desc=f"eval {epoch}", total=len(val_loader)))
    c.mlperf.event(C.EVAL_ACCURACY, value=metrics["mean_dice"], metadata={"epoch_num": epoch})
    c.mlperf.end(C.EVAL_STOP, metadata={"epoch_num": epoch})
    return metrics


def train(c: Components, train_loader, val_loader, schedule: EvalSchedule, state: TrainState,
          master_seed: int) -> RunResult:
    """Train until the target, divergence, pre-emption or ``--epochs``."""
    cfg, dist_info = c.config, c.dist
    say = print if dist_info.is_main else (lambda *a, **k: None)
    global_batch = cfg.batch_size * dist_info.world_size
    status = "finished"
    c.model.train()
    block_open = False
    for epoch in range(state.epoch + 1, cfg.epochs + 1):
        if not block_open:
            next_eval = epoch if schedule.is_eval_epoch(epoch) else min(
                [e for e in range(epoch, cfg.epochs + 1) if schedule.is_eval_epoch(e)] or [cfg.epochs])
            c.mlperf.start(C.BLOCK_START, metadata={"first_epoch_num": epoch,
                                                     "epoch_count": next_eval - epoch + 1})
            block_first, block_open = epoch, True
        c.mlperf.start(C.EPOCH_START, metadata={"epoch_num": epoch})
        lr = learning_rate_at(epoch, cfg.learning_rate, cfg.init_learning_rate, cfg.lr_warmup_epochs,
                              cfg.lr_decay_epochs, cfg.lr_decay_factor)
        set_learning_rate(c.optimizer, lr)
        train_loader.set_epoch(epoch)
        loss_sum = torch.zeros((), dtype=torch.float64, device=dist_info.device)
        if dist_info.is_main:  # the all-ranks partial sum of a pre-empted epoch, counted once
            loss_sum += state.epoch_loss_sum
        skip, state.epoch_loss_sum = state.step_in_epoch, 0.0
        epoch_start, steps_done, preempted = time.time(), 0, False
        batches = c.progress(train_loader, desc=f"epoch {epoch}", total=len(train_loader))
        for step, (image, label) in enumerate(batches):
            if step < skip:  # resumed mid-epoch: these batches were trained before pre-emption
                continue
            image, label = step_inputs(c, image, label)
            boundary = (step + 1) % cfg.ga_steps == 0 or step + 1 == len(train_loader)
            loss_sum += train_step(c, image, label, sync_grads=boundary, apply_update=boundary)
            steps_done += 1
            if boundary and should_stop_for_preemption(c, step + 1, step + 1 == len(train_loader)):
                state.step_in_epoch = step + 1
                state.epoch_loss_sum = float(D.all_reduce_sum(loss_sum.clone()).item())
                preempted = True
                break
        if preempted:
            say(f"pre-empted ({c.preempt.received or 'signal on another rank'}) in epoch {epoch} "
                f"after {state.step_in_epoch} batches: saving {cfg.save_ckpt_path or '(no --save_ckpt_path)'}")
            save_checkpoint(c, state, master_seed, "preempted")
            status = "preempted"
            break
        # One host sync per epoch: the summed loss of all ranks.
        mean_loss = float(D.all_reduce_sum(loss_sum).item()) / max(1, len(train_loader) * dist_info.world_size)
        elapsed = time.time() - epoch_start
        throughput = steps_done * global_batch / max(elapsed, 1e-9)
        state.epoch, state.step_in_epoch = epoch, 0
        c.mlperf.end(C.EPOCH_STOP, metadata={"epoch_num": epoch})
        c.metrics.write("train", epoch=epoch, loss=mean_loss, lr=lr, throughput=throughput)
        say(f"epoch {epoch}/{cfg.epochs}  loss {mean_loss:.4f}  lr {lr:.3g}  {throughput:.2f} samples/s")
        if not math.isfinite(mean_loss):
            say(f"training diverged: loss {mean_loss} in epoch {epoch}")
            status = "aborted"
        elif epoch >= schedule.fail_epoch and not schedule.is_eval_epoch(epoch):
            say(f"not converged by epoch {schedule.fail_epoch}: the MLPerf run has failed")
            status = "aborted"
        if status == "aborted" or schedule.is_eval_epoch(epoch) or epoch == cfg.epochs:
            if schedule.is_eval_epoch(epoch):
                metrics = run_evaluation(c, val_loader, epoch)
                state.last_eval = metrics
                c.metrics.write("eval", epoch=epoch, **metrics)
                say(f"eval epoch {epoch}: mean_dice {metrics['mean_dice']:.4f} (kidney "
                    f"{metrics['l1_dice']:.4f}, tumour {metrics['l2_dice']:.4f}) eval_loss "
                    f"{metrics['eval_loss']:.4f}")
                if metrics["mean_dice"] > state.best_mean_dice:
                    state.best_mean_dice, state.best_epoch = metrics["mean_dice"], epoch
                    state.best_state = {k: v.detach().cpu().clone()
                                        for k, v in unwrap(c.model).state_dict().items()}
                if metrics["mean_dice"] >= cfg.quality_threshold:
                    status = "success"
                elif metrics["mean_dice"] < 1e-6:
                    say("training diverged: mean_dice below 1e-6")
                    status = "aborted"
                elif epoch >= schedule.fail_epoch:
                    say(f"not converged by epoch {schedule.fail_epoch}: the MLPerf run has failed")
                    status = "aborted"
            c.mlperf.end(C.BLOCK_STOP, metadata={"first_epoch_num": block_first})
            block_open = False
            save_checkpoint(c, state, master_seed, status)
            if status in ("success", "aborted"):
                break
    return RunResult(status, state.epoch, state.best_mean_dice)


def benchmark_train(c: Components, train_loader) -> dict:
    """Time every training iteration after ``--warmup_steps`` (device-synchronised)."""
    cfg, dev = c.config, c.dist.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    set_learning_rate(c.optimizer, cfg.learning_rate)
    times, seen = [], 0
    c.model.train()
    for epoch in range(1, cfg.epochs + 1):
        train_loader.set_epoch(epoch)
        for image, label in c.progress(train_loader, desc=f"benchmark epoch {epoch}", total=len(train_loader)):
            sync()
            tick = time.perf_counter()
            image, label = step_inputs(c, image, label)
            train_step(c, image, label, sync_grads=True, apply_update=True)
            sync()
            if seen >= cfg.warmup_steps:
                times.append(time.perf_counter() - tick)
            seen += 1
    summary = latency_summary(times, cfg.batch_size * c.dist.world_size)
    if c.dist.is_main:
        print(format_summary("throughput_train", summary, "samples"))
    return summary


def benchmark_evaluate(c: Components, val_loader) -> dict:
    """Time the sliding-window evaluation of each volume after ``--warmup_steps`` volumes."""
    from runtime.inference import sliding_window_inference

    cfg, dev = c.config, c.dist.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = c.eval_model or c.model
    model.eval()
    times, seen = [], 0

    def predict(x):
        with c.autocast():
            return model(x)

    with torch.no_grad():
        for _ in range(cfg.epochs):
            for image, label, _case in c.progress(val_loader, desc="benchmark eval", total=len(val_loader)):
                sync()
                tick = time.perf_counter()
                sliding_window_inference(predict, image.to(dev), label.to(dev), cfg.val_input_shape,
                                         cfg.overlap, cfg.sw_batch_size)
                sync()
                if seen >= cfg.warmup_steps:
                    times.append(time.perf_counter() - tick)
                seen += 1
    summary = latency_summary(times, c.dist.world_size)
    if c.dist.is_main:
        print(format_summary("throughput_eval", summary, "volumes"))
    return summary
