"""Pure functions of the training schedule (learning rate, evaluation epochs, sample counts);
standard library only at import."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def learning_rate_at(epoch: int, base_lr: float, init_lr: float, warmup_epochs: int,
                     decay_epochs: Sequence[int] = (), decay_factor: float = 1.0) -> float:
    """Learning rate used during ``epoch`` (1-based).

    Linear warm-up ``init + (base - init) * epoch / warmup`` for epochs 1..warmup, then the base
    rate multiplied by ``decay_factor`` once per milestone already passed (MultiStepLR stepped
    at the end of every epoch: a milestone ``m`` applies from epoch ``m + 1``).
    """
    if warmup_epochs > 0 and epoch <= warmup_epochs:
        return init_lr + (base_lr - init_lr) * epoch / warmup_epochs
    passed = sum(1 for m in decay_epochs if m <= epoch - 1)
    return base_lr * decay_factor ** passed


RULES_TRAIN_CASES = 168  # KiTS19's training cases: the constant of the rules' formulas


def samples_per_epoch(num_samples: int, world_size: int, batch_size: int, ga_steps: int = 1,
                      last_batch: str = "pad") -> int:
    """Global samples per epoch. ``pad`` (the rules): ``ceil(N / G) * G`` with the global batch
    ``G = batch_size * world_size * ga_steps``, a padded last batch counted (the rules' text,
    "Quality measure"). ``drop`` (the reference): every rank's full batches of its shard
    (``data_loading.sampler.batches_per_epoch``), incomplete batches dropped."""
    if last_batch == "pad":
        global_batch = batch_size * world_size * ga_steps
        return -(-num_samples // global_batch) * global_batch
    from data_loading.sampler import batches_per_epoch  # here: the sampler imports numpy, the report's
    # time-to-train prediction imports this module's EvalSchedule with the standard library only

    return world_size * batch_size * batches_per_epoch(num_samples, world_size, batch_size, 1, "drop")


def samples_trained_per_epoch(num_samples: int, world_size: int, batch_size: int, ga_steps: int = 1,
                              last_batch: str = "pad", semantics: str = "project") -> int:
    """Samples an epoch trains on all ranks: those whose gradients its optimizer steps apply, padding
    not counted (a padded sample weighs 0). The unit of the MLPerf log's ``epoch_num``, of the RCPs
    (``rcps_unet3d.json``: samples to converge = epochs x 168) and of the RCP checker, which reads
    ``eval_accuracy``'s ``epoch_num``; :func:`samples_per_epoch` (padding counted) is the rules'
    schedule formula's alone. ``pad``: every sample once, ``num_samples``. ``drop``: every rank's
    full batches; under the reference's semantics a last accumulation cut short is discarded
    (``training.loop``: zero_grad), so only whole steps of ``ga_steps`` batches count."""
    if last_batch == "pad":
        return num_samples
    from data_loading.sampler import batches_per_epoch  # numpy: imported where used (see samples_per_epoch)

    batches = batches_per_epoch(num_samples, world_size, batch_size, 1, "drop")
    if semantics == "reference":
        batches -= batches % ga_steps
    return world_size * batch_size * batches


@dataclass(frozen=True)
class EvalSchedule:
    """Which epochs evaluate: ``start_eval_at`` and every ``evaluate_every`` epochs after it, the
    current MLCommons code's rule (``next_eval_at`` starts at ``start_eval_at`` and grows by
    ``evaluate_every``) under both ``--semantics`` values."""

    start_eval_at: int
    evaluate_every: int
    fail_epoch: int  # a run not converged by this epoch has failed (MLPerf)

    def is_eval_epoch(self, epoch: int) -> bool:
        return epoch >= self.start_eval_at and (epoch - self.start_eval_at) % self.evaluate_every == 0

    def next_eval_epoch(self, epoch: int) -> int:
        """The first evaluation epoch at or after ``epoch``."""
        if epoch <= self.start_eval_at:
            return self.start_eval_at
        return self.start_eval_at + -(-(epoch - self.start_eval_at) // self.evaluate_every) * self.evaluate_every

    @property
    def first_eval_epoch(self) -> int:
        return self.next_eval_epoch(1)

    def evaluations_through(self, epoch: int) -> int:
        """How many epochs from 1 to ``epoch`` evaluate."""
        if epoch < self.start_eval_at:
            return 0
        return (epoch - self.start_eval_at) // self.evaluate_every + 1


def eval_schedule(samples_per_epoch_: int, num_train_cases: int = 168, start_eval_at: int | None = None,
                  evaluate_every: int | None = None) -> EvalSchedule:
    """MLPerf defaults: first evaluation after ~1000 epochs' worth of samples of a batch-1
    single-device run, then every ~20, scaled to ``samples_per_epoch_``; explicit values win."""
    if samples_per_epoch_ <= 0:
        raise ValueError("samples_per_epoch must be positive (is the batch larger than the shard?)")
    def epochs_for(samples_at_batch_1: int) -> int:  # ceil(k * N / spe), in integers (no float rounding)
        return -(-samples_at_batch_1 * num_train_cases // samples_per_epoch_)

    start = start_eval_at if start_eval_at is not None else epochs_for(1000)
    every = evaluate_every if evaluate_every is not None else epochs_for(20)
    return EvalSchedule(start, every, epochs_for(10000))


def rules_schedule(global_batch: int) -> EvalSchedule:
    """The rules' schedule for unet3d at ``global_batch`` (v4.0 ``training_rules.adoc``, "Quality
    measure"): first evaluation at ``ceil(1000 * 168 / spe)`` epochs, then every
    ``ceil(20 * 168 / spe)``, not converged after ``ceil(10000 * 168 / spe)``, with
    ``spe = ceil(168 / global_batch) * global_batch``."""
    return eval_schedule(samples_per_epoch(RULES_TRAIN_CASES, 1, global_batch), RULES_TRAIN_CASES)
