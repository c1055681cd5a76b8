"""Pure functions of the training schedule (learning rate, evaluation epochs, sample counts);
standard library only at import."""
from __future__ import annotations

import math
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


def samples_per_epoch(num_samples: int, world_size: int, batch_size: int) -> int:
    """Global samples trained per epoch: every rank trains the same number of full batches of
    its shard (``batches_per_epoch``; no padding duplicates, incomplete batches dropped)."""
    from data_loading.sampler import batches_per_epoch  # here: the sampler imports numpy, the report's
    # time-to-train prediction imports this module's EvalSchedule with the standard library only

    return world_size * batch_size * batches_per_epoch(num_samples, world_size, batch_size)


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
    scale = num_train_cases / samples_per_epoch_
    start = start_eval_at if start_eval_at is not None else math.ceil(1000 * scale)
    every = evaluate_every if evaluate_every is not None else math.ceil(20 * scale)
    return EvalSchedule(start, every, math.ceil(10000 * scale))
