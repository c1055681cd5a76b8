"""The training loop: epochs of named steps, evaluation on the MLPerf schedule, checkpoints.

``train`` reads top to bottom: train an epoch, evaluate when the schedule says so, decide the
run's status (a pure function), save. Everything it uses is built by ``runtime.build``.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import torch
from mlperf_logging.mllog import constants as C

from runtime import checkpoint as ckpt
from runtime import distributed as D
from data_loading.write_errors import write_failure
from runtime.build import Components
from runtime.clocked.evaluation import run_evaluation
from runtime.clocked.reporters import Reporters, epoch_metadata, start_clock, stop_clock
from runtime.labels import LabelSet
from runtime.plan import TrainingPlan
from runtime.run_files import DIVERGED_DICE, EVAL, RESULT, TRAIN
from runtime.outputs import OutputError
from runtime.schedule import EvalSchedule, learning_rate_at
from runtime.signals import PreemptionFlag

PREEMPT_CHECK_EVERY = 8  # steps between collective pre-emption checks when world size > 1


@dataclass(frozen=True)
class EpochResult:
    mean_loss: float  # over all ranks' batches (nan-safe: a diverged run shows nan)
    throughput: float  # global samples per second
    preempted: bool


@dataclass(frozen=True)
class RunResult:
    status: str  # success | aborted | preempted | finished
    epoch: int
    best_mean_dice: float


# -- pure decisions ---------------------------------------------------------------------------

def eval_schedule_of(training: TrainingPlan) -> EvalSchedule:
    """The run's evaluation epochs (the training section's, resolved with the data): the one the loop follows."""
    return EvalSchedule(training.start_eval_at, training.evaluate_every, training.fail_epoch)


def schedule_text(training: TrainingPlan) -> str:
    """The schedule line's evaluation part; says so when no evaluation falls within ``--epochs``."""
    first = eval_schedule_of(training).first_eval_epoch
    text = f"first eval at epoch {first}, then every {training.evaluate_every}"
    if first > training.epochs:
        text += f"; no evaluation within --epochs {training.epochs}"
    return text


def next_eval_epoch(epoch: int, schedule: EvalSchedule, last_epoch: int) -> int:
    """The first evaluation epoch at or after ``epoch`` (``last_epoch`` when there is none)."""
    return min(schedule.next_eval_epoch(epoch), last_epoch)


def run_status(epoch: int, mean_loss: float, mean_dice: float | None, fail_epoch: int,
               quality_threshold: float) -> tuple[str | None, str]:
    """``(status, why)`` after ``epoch``: "success", "aborted" or None (go on); ``mean_dice`` is
    None when the epoch was not evaluated. Reaching the target wins over everything else."""
    if mean_dice is not None and mean_dice >= quality_threshold:
        return "success", ""
    if not math.isfinite(mean_loss):
        return "aborted", f"training diverged: loss {mean_loss} in epoch {epoch}"
    if mean_dice is not None and mean_dice < DIVERGED_DICE:
        return "aborted", "training diverged: mean_dice below 1e-6"
    if epoch >= fail_epoch:
        return "aborted", f"not converged by epoch {fail_epoch}: the MLPerf run has failed"
    return None, ""


# -- steps ------------------------------------------------------------------------------------

def step_inputs(components: Components, image: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch on the training device, the image in the model's memory format (no-op copies when
    the loader already delivered it there)."""
    image = image.to(components.dist.device, non_blocking=True)
    label = label.to(components.dist.device, non_blocking=True)
    if components.plan.precision.channels_last:
        image = image.contiguous(memory_format=torch.channels_last_3d)
    return image, label


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def save_checkpoint(components: Components, status: str, required: bool = True) -> str | None:
    """Rank 0 writes ``--save_ckpt_path`` atomically (nothing when the path is empty).

    A failed write (full disk, quota, read-only, ...: ``write_failure``) leaves the previous
    checkpoint intact and no temporary file; it raises :class:`OutputError` when ``required``,
    else returns the reason (None: saved, or nothing to save).
    """
    plan, failed = components.plan, None
    cfg = plan.config
    if cfg.save_ckpt_path and components.dist.is_main:
        try:
            ckpt.save(cfg.save_ckpt_path, components.model, components.optimizer, components.scaler,
                      components.state, plan, components.dist.device, status)
        except Exception as err:  # noqa: BLE001 - a write failure is one line, anything else a bug
            reason = write_failure(err)
            if reason is None:
                raise
            if required:
                raise OutputError(f"cannot write the checkpoint {cfg.save_ckpt_path!r}: {reason} "
                                  "(the previous one is unchanged)") from None
            failed = reason
    D.barrier()
    return failed


def periodic_save_due(epochs_since: int, minutes_since: float, every_epochs: int, every_minutes: float) -> bool:
    """A "last" checkpoint is due after ``every_epochs`` epochs or ``every_minutes`` minutes
    (each 0 = off) since the last save."""
    return (every_epochs > 0 and epochs_since >= every_epochs) or (every_minutes > 0 and minutes_since >= every_minutes)


class PeriodicCheckpoints:
    """Saves between evaluations, so that a crash before the first evaluation (epoch ~1000 under
    the MLPerf schedule) loses at most ``--ckpt_every_epochs`` epochs or ``--ckpt_every_minutes``.
    Rank 0 decides (clocks differ between ranks) and every rank follows."""

    def __init__(self, components: Components, out: Reporters):
        self.components, self.out = components, out
        self.last_epoch, self.last_time, self.warned = components.state.epoch, time.time(), False

    def saved(self, epoch: int) -> None:
        self.last_epoch, self.last_time = epoch, time.time()

    def maybe_save(self, epoch: int) -> None:
        cfg = self.components.plan.config
        if not cfg.checkpoints_on_the_clock:
            return
        due = periodic_save_due(epoch - self.last_epoch, (time.time() - self.last_time) / 60,
                                cfg.ckpt_every_epochs, cfg.ckpt_every_minutes)
        if not D.broadcast_int(int(due), self.components.dist.device):
            return
        reason = save_checkpoint(self.components, "running", required=False)
        if reason is None:
            self.saved(epoch)
        elif not self.warned:
            self.warned = True
            self.out.say(f"warning: cannot write the periodic checkpoint {cfg.save_ckpt_path!r} ({reason}); "
                         "training goes on, the previous checkpoint is unchanged")


def should_stop_for_preemption(preempt: PreemptionFlag, dist_info: D.DistInfo, step: int,
                               last_of_epoch: bool) -> bool:
    """Local flag at world size 1; at larger sizes all ranks agree every few steps and at the end
    of every epoch (a collective every step would cost a host sync per step)."""
    if not dist_info.distributed:
        return bool(preempt)
    if step % PREEMPT_CHECK_EVERY and not last_of_epoch:
        return False
    flag = torch.tensor([1.0 if preempt else 0.0], device=dist_info.device)
    return bool(D.all_reduce_sum(flag).item() > 0)


def train_epoch(components: Components, out: Reporters, epoch: int) -> EpochResult:
    """One epoch of this rank's batches (skipping those a pre-empted attempt already trained)."""
    cfg, state, loader = components.plan.config, components.state, components.train_loader
    set_learning_rate(components.optimizer, learning_rate_at(
        epoch, cfg.learning_rate, cfg.init_learning_rate, cfg.lr_warmup_epochs, cfg.lr_decay_epochs,
        cfg.lr_decay_factor))
    loader.set_epoch(epoch)
    loss_sum = torch.zeros((), dtype=torch.float64, device=components.dist.device)
    if components.dist.is_main:  # the all-ranks partial sum of a pre-empted epoch, counted once
        loss_sum += state.epoch_loss_sum
    skip, state.epoch_loss_sum = state.step_in_epoch, 0.0
    start, steps_done = time.time(), 0
    for step, (image, label) in enumerate(out.progress(loader, desc=f"epoch {epoch}", total=len(loader))):
        if step < skip:  # resumed mid-epoch: these batches were trained before pre-emption
            continue
        image, label = step_inputs(components, image, label)
        last = step + 1 == len(loader)
        boundary = (step + 1) % cfg.ga_steps == 0 or (last and cfg.semantics == "project")
        weights = loader.step_weights(step)  # None but in a padded step (--last_batch pad)
        if weights is None:
            loss_sum += components.step(image, label, boundary)
        else:
            loss_sum += components.step(image, label, boundary, weights)
        steps_done += 1
        if last and not boundary:  # the reference drops the epoch's last partial accumulation
            components.optimizer.zero_grad(set_to_none=True)
        if (boundary or last) and should_stop_for_preemption(out.preempt, components.dist, step + 1, last):
            state.step_in_epoch = step + 1
            state.epoch_loss_sum = float(D.all_reduce_sum(loss_sum.clone()).item())
            return EpochResult(math.nan, 0.0, preempted=True)
    # One host sync per epoch: the summed loss of all ranks, each batch's the mean of its real
    # samples' losses times their share of the batch (a full batch: its mean).
    world = components.dist.world_size
    trained = loader.samples_trained
    padded = trained != len(loader) * world * cfg.batch_size
    batches = trained / cfg.batch_size if padded else max(1, len(loader) * world)
    mean_loss = float(D.all_reduce_sum(loss_sum).item()) / batches
    throughput = steps_done * cfg.batch_size * world / max(time.time() - start, 1e-9)
    state.epoch, state.step_in_epoch = epoch, 0
    return EpochResult(mean_loss, throughput, preempted=False)


def maybe_evaluate(components: Components, out: Reporters, schedule: EvalSchedule, epoch: int) -> dict | None:
    """Evaluate on the schedule's epochs (None otherwise); keeps the best weights."""
    if not schedule.is_eval_epoch(epoch):
        return None
    state = components.state
    metrics = run_evaluation(components, out, epoch)
    state.last_eval = metrics
    out.metrics.write(EVAL, epoch=epoch, **metrics)
    if out.curves is not None:
        out.curves.request()  # drawn in a background thread: the next step does not wait
    out.say(f"eval epoch {epoch}: mean_dice {metrics['mean_dice']:.4f} "
            f"({per_label_text(metrics, components.plan.network.label_set)}) "
            f"eval_loss {metrics['eval_loss']:.4f}")
    if metrics["mean_dice"] > state.best_mean_dice:
        state.best_mean_dice, state.best_epoch = metrics["mean_dice"], epoch
        state.best_state = ckpt.cpu_weights(components.model)
    return metrics


def per_label_text(metrics: dict, label_set: LabelSet) -> str:
    """``kidney 0.9000, tumour 0.8000`` (KiTS19's words) or ``kidney 0.9000, tumor 0.8000, cyst nan``
    (the run's labels, ``runtime.labels``)."""
    if label_set.benchmark_data:
        return f"kidney {metrics['l1_dice']:.4f}, tumour {metrics['l2_dice']:.4f}"
    return ", ".join(f"{name} {metrics[key]:.4f}" for (name, _), key in zip(label_set.foreground, label_set.keys))


def report_epoch(components: Components, out: Reporters, epoch: int, result: EpochResult) -> None:
    lr = components.optimizer.param_groups[0]["lr"]
    out.mlperf.end(C.EPOCH_STOP, metadata=epoch_metadata(out, epoch))
    out.metrics.write(TRAIN, epoch=epoch, loss=result.mean_loss, lr=lr, throughput=result.throughput)
    out.say(f"epoch {epoch}/{components.plan.training.epochs}  loss {result.mean_loss:.4f}  lr {lr:.3g}  "
            f"{result.throughput:.2f} samples/s")


class MLPerfBlocks:
    """MLPerf ``block_start``/``block_stop`` pairs: a block runs from an epoch to the next
    evaluation (or the last epoch). ``first_epoch_num`` is an ``epoch_num`` (samples trained: its
    first epoch's, as that ``epoch_start`` says); ``epoch_count`` counts epochs (the block's
    length; rulesets 1.0.0-2.1.0 require it, above 0, by that name)."""

    def __init__(self, out: Reporters, schedule: EvalSchedule, last_epoch: int):
        self.out, self.schedule, self.last_epoch = out, schedule, last_epoch
        self.first: int | None = None

    def begin(self, epoch: int) -> None:
        mlperf = self.out.mlperf
        at = epoch_metadata(self.out, epoch)
        if self.first is None:
            count = next_eval_epoch(epoch, self.schedule, self.last_epoch) - epoch + 1
            mlperf.start(C.BLOCK_START, metadata={"first_epoch_num": at["epoch_num"], "epoch_count": count,
                                                  "first_epoch": epoch})
            self.first = epoch
        mlperf.start(C.EPOCH_START, metadata=at)

    def end(self) -> None:
        self.out.mlperf.end(C.BLOCK_STOP, metadata={"first_epoch_num": epoch_metadata(self.out, self.first)["epoch_num"],
                                                    "first_epoch": self.first})
        self.first = None


def stop_for_preemption(components: Components, out: Reporters, epoch: int) -> RunResult:
    cfg, state = components.plan.config, components.state
    when = "" if cfg.checkpoints_on_the_clock else " after run_stop"
    out.say(f"pre-empted ({out.preempt.received or 'signal on another rank'}) in epoch {epoch} after "
            f"{state.step_in_epoch} batches: " + (f"saving {cfg.save_ckpt_path}{when}" if cfg.save_ckpt_path else
                                                  "nothing saved, no --save_ckpt_path was given"))
    if cfg.checkpoints_on_the_clock:  # else run_training saves it after run_stop
        save_checkpoint(components, "preempted")
    return RunResult("preempted", state.epoch, state.best_mean_dice)


def train(components: Components, out: Reporters) -> RunResult:
    """Train until the target, divergence, pre-emption or ``--epochs``."""
    cfg, training, state = components.plan.config, components.plan.training, components.state
    schedule = eval_schedule_of(training)
    blocks = MLPerfBlocks(out, schedule, training.epochs)
    periodic = PeriodicCheckpoints(components, out)
    components.model.train()
    status = None
    for epoch in range(state.epoch + 1, training.epochs + 1):
        blocks.begin(epoch)
        result = train_epoch(components, out, epoch)
        if result.preempted:
            return stop_for_preemption(components, out, epoch)
        report_epoch(components, out, epoch, result)
        metrics = maybe_evaluate(components, out, schedule, epoch)
        status, why = run_status(epoch, result.mean_loss, metrics and metrics["mean_dice"], schedule.fail_epoch,
                                 cfg.quality_threshold)
        if why:
            out.say(why)
        if status or metrics or epoch == training.epochs:
            blocks.end()
            if cfg.checkpoints_on_the_clock:  # else once, after run_stop (run_training)
                save_checkpoint(components, status or "finished")
            periodic.saved(epoch)
        else:
            periodic.maybe_save(epoch)
        if status:
            break
    return RunResult(status or "finished", state.epoch, state.best_mean_dice)


def run_training(components: Components, out: Reporters) -> int:
    """The timed MLPerf run of a built ``components`` (the clock started, the loaders built:
    ``runtime.clocked.start.start_run``): the hyper-parameters, the epochs, run stop, the RUN_SUMMARY line;
    returns the exit code."""
    plan = components.plan
    cfg, training = plan.config, plan.training
    if out.run_start is None:  # a caller that built its loaders itself
        start_clock(out)
    out.mlperf.hyperparameters(plan, components.dist.world_size)
    out.epoch_samples = training.samples_trained_per_epoch or 0  # the unit of every epoch_num (set by start_run too)
    run_start = out.run_start
    out.say(f"training: {plan.data.num_train_cases} cases, {training.samples_per_epoch} samples/epoch, "
            f"{schedule_text(training)}; seed {plan.seed}")
    result = train(components, out)
    D.barrier()
    mlperf_status = "success" if result.status == "success" else "aborted"
    stop_clock(out, mlperf_status, result.epoch)
    # MLPerf knows success and aborted only; the report tells a run that ran its --epochs apart
    out.metrics.write(RESULT, status=result.status, epoch=result.epoch, epochs=training.epochs)
    # A name of its own: the reference's RESULT line (its run_and_time.sh) has other fields.
    out.say(f"RUN_SUMMARY,image_segmentation,{plan.seed},{time.time() - run_start:.1f},{result.status},"
            f"best_mean_dice={result.best_mean_dice:.4f},epochs={result.epoch}")
    sys.stdout.flush()
    if not cfg.checkpoints_on_the_clock:  # the reference's timed run: the weights after run_stop
        save_checkpoint(components, result.status)
    if result.status == "preempted":
        # Saved: a requeued job resumes (exit 0). Nothing to resume from: say it with the exit code.
        return 0 if cfg.save_ckpt_path else 128 + (out.preempt.number or 15)
    return 0 if result.status in ("success", "finished") else 3
