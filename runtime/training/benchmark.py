"""``--benchmark``: time training steps or sliding-window evaluations (no checkpoints, no
evaluation schedule), statistics from :mod:`runtime.training.latency`, and the predicted MLPerf
time to train (:mod:`runtime.results.time_to_train`). With ``--log_dir`` given, ``log.json`` there
gets one ``benchmark`` record with the reference's keys (``throughput_train``,
``latency_train_mean``, ``latency_train_90/95/99``; evaluate: ``_eval``), where the reference's
``--benchmark`` writes them.

Training times its steps after ``--warmup_steps``, then one evaluation pass over this rank's
evaluation volumes (the seconds one evaluation costs), and prints the predicted time to train at
this world size and global batch. Evaluation times volumes and prints the evaluations' part.
Before an evaluation is timed, every window batch it will run (``--sw_batch_size`` windows and
each volume's last, partial batch) is run once, untimed: a run pays a shape's first-run cost
(compilation, autotuning, new kernels) once, not at every evaluation.

A budget (``--benchmark_steps``, ``--benchmark_seconds``) stops the timing early; without one
every step of ``--epochs`` is timed, as before. With a budget, ``--epochs`` caps the run only when
given; training's evaluation pass times one volume (``--benchmark_steps`` alone) or volumes until
``--benchmark_seconds`` more have run, and is extrapolated to this rank's share by its windows.
"""
from __future__ import annotations

import itertools
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch

from data_loading.windows import window_geometry
from runtime import distributed as D
from runtime.config import UsageError
from data_loading.source import EvalLoader
from runtime.build import Components
from runtime.clocked.reporters import Reporters
from runtime.division import cost_reasons
from runtime.inference.predictor import build_predictor, options_from
from runtime.results import time_to_train as T
from runtime.schedule import eval_schedule, samples_per_epoch, samples_trained_per_epoch
from runtime.inference.sliding_window import sliding_window_inference
from runtime.plan import InferencePlan, RunPlan
from runtime.run_files import BENCHMARK
from runtime.training.latency import format_summary, latency_summary, reference_stats
from runtime.training.loop import set_learning_rate, step_inputs


def _synchronizer(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


@dataclass(frozen=True)
class Budget:
    """``--benchmark_steps`` (timed iterations) and ``--benchmark_seconds`` (timed seconds);
    0 = no limit."""

    steps: int = 0
    seconds: float = 0.0

    @classmethod
    def of(cls, plan: RunPlan) -> "Budget":
        return cls(plan.config.benchmark_steps, plan.config.benchmark_seconds)

    @property
    def given(self) -> bool:
        return bool(self.steps or self.seconds)

    def spent(self, timed: int, seconds: float) -> str | None:
        """Why the timing stops after ``timed`` iterations of ``seconds`` in all (None: go on)."""
        if self.steps and timed >= self.steps:
            return f"--benchmark_steps {self.steps}"
        if self.seconds and seconds >= self.seconds:
            return f"--benchmark_seconds {self.seconds:g}"
        return None

    def epochs(self, plan: RunPlan) -> int | None:
        """The epochs to run: ``--epochs`` (training's as planned: ``auto`` decided), or no limit
        when a budget ends the run and ``--epochs`` was not given."""
        if self.given and "epochs" not in plan.config.explicit:
            return None
        return planned_epochs(plan)


def planned_epochs(plan: RunPlan) -> int:
    """``--epochs``: the training section's (``auto`` decided), else the flag (evaluate's passes)."""
    return plan.training.epochs if plan.training is not None else plan.config.epochs


def agreed_stop(reason: str | None, budget: Budget, device: torch.device) -> str | None:
    """Rank 0's decision on every rank: a seconds budget is spent at different steps on
    different ranks, and every rank must take the same steps (DDP)."""
    if not budget.seconds:
        return reason  # counts: the same on every rank
    stop = D.broadcast_int(int(reason is not None), device)
    return (reason or f"--benchmark_seconds {budget.seconds:g} (rank 0)") if stop else None


def check_something_to_time(iterations: int, what: str, plan: RunPlan) -> None:
    """A :class:`UsageError` before any work when ``--warmup_steps`` would leave no iteration
    timed (the benchmark would run to its end and then have no number)."""
    warmup = plan.config.warmup_steps
    if iterations <= warmup:
        raise UsageError(f"--benchmark: {what} x --epochs {planned_epochs(plan)} = {iterations} iterations, none left "
                         f"to time after --warmup_steps {warmup}; lower --warmup_steps or raise --epochs")


def epochs_of(loader, epochs: int | None, what: str, plan: RunPlan) -> Iterable[int]:
    """The epochs to iterate (checked to leave something to time): 1..epochs or unbounded."""
    if epochs is not None:
        check_something_to_time(len(loader) * epochs, f"{len(loader)} {what} per epoch", plan)
        return range(1, epochs + 1)
    if len(loader) == 0:
        raise UsageError(f"--benchmark: no {what} on this rank to time")
    return itertools.count(1)


@contextmanager
def iterate(loader) -> Iterator[Iterator]:
    """``loader``'s iterator, closed on leaving (a prefetch thread, workers released when the
    budget stops the timing inside an epoch)."""
    iterator = iter(loader)
    try:
        yield iterator
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def timed_loop(epochs: Iterable[int], items_of: Callable[[int], Iterable], time_one: Callable[[object], float],
               warmup: int, stop: Callable[[list[float]], str | None],
               said: Callable[[int, float], None] | None = None) -> tuple[list[float], str | None]:
    """The one timing loop of ``--benchmark``: ``time_one(item)``'s seconds for every item of
    each epoch's ``items_of(epoch)``, the first ``warmup`` untimed, until the epochs end or
    ``stop(times)`` (asked after every item) gives its reason; ``(times, the reason or None)``.
    ``said(seen, seconds)``: after each item (its per-step line)."""
    times: list[float] = []
    seen = 0
    for epoch in epochs:
        with iterate(items_of(epoch)) as items:
            for item in items:
                seconds = time_one(item)
                if seen >= warmup:
                    times.append(seconds)
                seen += 1
                if said is not None:
                    said(seen, seconds)
                reason = stop(times)
                if reason:
                    return times, reason
    return times, None


def stopped_line(reason: str | None, timed: int, unit: str) -> list[str]:
    return [f"benchmark budget: timing stopped after {timed} timed {unit} ({reason})"] if reason else []


# ------------------------------------------------------------------------------------ training

def time_training(components: Components, out: Reporters, budget: Budget) -> tuple[list[float], str | None]:
    """Every training step's seconds after ``--warmup_steps`` (device-synchronised), until the
    epochs or the budget end; ``(times, why the budget stopped it or None)``."""
    plan, loader, device = components.plan, components.train_loader, components.dist.device
    cfg = plan.config
    epochs = epochs_of(loader, budget.epochs(plan), "batches", plan)
    sync = _synchronizer(device)
    set_learning_rate(components.optimizer, cfg.learning_rate)
    components.model.train()

    def batches(epoch: int):
        loader.set_epoch(epoch)
        return loader

    def step(batch) -> float:
        sync()
        tick = time.perf_counter()
        components.step(*step_inputs(components, *batch))
        sync()
        return time.perf_counter() - tick

    def said(seen: int, seconds: float) -> None:
        out.say(f"{'warm-up' if seen <= cfg.warmup_steps else 'timed'} step {seen}: {seconds * 1e3:.1f} ms",
                file=sys.stderr, flush=True)

    return timed_loop(epochs, batches, step, cfg.warmup_steps, said=said,
                      stop=lambda times: agreed_stop(budget.spent(len(times), sum(times)) if times else None,
                                                     budget, device))


def rank_windows(loader: EvalLoader, roi: Sequence[int], overlap: float) -> int | None:
    """The sliding windows of all this rank's evaluation volumes, from their shapes (None when
    the loader does not tell its volumes' shapes)."""
    shapes = loader.volume_shapes()
    if shapes is None:
        return None
    return sum(window_geometry(shape, roi, overlap).n_windows for shape in shapes)


def window_batch_sizes(shapes: Sequence[Sequence[int]], roi: Sequence[int], overlap: float,
                       sw_batch_size: int) -> list[int]:
    """Every number of windows the sliding window puts through the network at once over volumes
    of ``shapes``: ``sw_batch_size`` (a volume with that many windows or more) and each volume's
    last, partial batch (its windows modulo ``sw_batch_size``), ascending."""
    sizes = set()
    for shape in shapes:
        windows = window_geometry(shape, roi, overlap).n_windows
        if windows >= sw_batch_size:
            sizes.add(sw_batch_size)
        if windows % sw_batch_size:
            sizes.add(windows % sw_batch_size)
    return sorted(sizes)


class ShapesSeen:
    """A predictor that records the input shapes it has run: the first run of a shape pays a
    one-time cost (``torch.compile``'s recompilation, cuDNN's autotuning, oneDNN's primitives
    for a new batch size: 308.8 s instead of 3.26 s for one CPU evaluation in channels-last),
    which no evaluation of a run pays again."""

    def __init__(self, predict):
        self.predict, self.shapes, self.new = predict, set(), False

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        shape = tuple(batch.shape)
        if shape not in self.shapes:
            self.shapes.add(shape)
            self.new = True
        return self.predict(batch)


def warm_window_batches(predict: ShapesSeen, loader: EvalLoader, inference: InferencePlan, device: torch.device,
                        sync) -> list[int]:
    """Runs every window batch this rank's timed evaluation will run once, untimed: each batch
    size of :func:`window_batch_sizes` over the loader's volume shapes (the window batch alone
    when the loader does not tell them: :func:`timed_volume_warm` then re-times a volume that met
    a new one). Returns the sizes run."""
    shapes = loader.volume_shapes()
    sizes = ([inference.window_batch] if shapes is None else
             window_batch_sizes(shapes, inference.window, inference.overlap, inference.window_batch))
    for size in sizes:
        predict(torch.zeros((size, 1, *inference.window), device=device))
    sync()
    return sizes


def share_seconds(times: Sequence[float], windows: Sequence[int], volumes: int, total_windows: int | None) -> float:
    """This rank's share of one evaluation: measured when every volume was timed, else the
    timed seconds per window times the share's windows (per volume without the shapes)."""
    if len(times) >= volumes:
        return float(sum(times))
    if total_windows is not None and sum(windows) > 0:
        return sum(times) / sum(windows) * total_windows
    return sum(times) / len(times) * volumes


def eval_volumes(out: Reporters, loader):
    """The evaluation volumes, with their progress line."""
    return out.progress(loader, desc="benchmark eval volumes", total=len(loader), always=True)


def timed_volume(predict, image, inference: InferencePlan, sync) -> float:
    """Seconds of one volume's sliding-window inference, the device synchronised around it."""
    sync()
    tick = time.perf_counter()
    sliding_window_inference(predict, image, inference.window, inference.overlap, inference.window_batch)
    sync()
    return time.perf_counter() - tick


def timed_volume_warm(predict: ShapesSeen, image, inference: InferencePlan, sync) -> float:
    """:func:`timed_volume`, timed again when its run met a window batch shape not run before
    (what it timed was that shape's one-time cost, not an evaluation's)."""
    predict.new = False
    seconds = timed_volume(predict, image, inference, sync)
    if predict.new:
        seconds = timed_volume(predict, image, inference, sync)
    return seconds

def time_evaluation_pass(components: Components, out: Reporters, budget: Budget) -> tuple[float | None, str]:
    """Seconds one evaluation of every evaluation case takes on all ranks (the slowest rank's
    share), and how it was found. None when no rank has an evaluation volume."""
    plan, device, loader = components.plan, components.dist.device, components.val_loader
    inference = plan.inference
    sync = _synchronizer(device)
    model = components.eval_model
    model.eval()
    predict = ShapesSeen(build_predictor(model, device, options_from(plan.precision, inference)))
    windows: list[int] = []
    def volume(item) -> float:
        image = item[0]
        seconds = timed_volume_warm(predict, image.to(device), inference, sync)
        windows.append(window_geometry(image.shape[2:], inference.window, inference.overlap).n_windows)
        return seconds

    try:
        with torch.no_grad():
            if len(loader):
                warm_window_batches(predict, loader, inference, device, sync)
            # one pass; a budget times one volume (steps alone) or volumes until its seconds have run
            times, _ = timed_loop([1], lambda epoch: eval_volumes(out, loader), volume, 0, stop=lambda times: (
                "the budget" if budget.given and (not budget.seconds or sum(times) >= budget.seconds) else None))
    finally:
        model.train()
    share = (share_seconds(times, windows, len(loader), rank_windows(loader, inference.window, inference.overlap))
             if times else 0.0)
    shares = D.all_gather_objects((share, len(times), len(loader)))
    timed, volumes = sum(s[1] for s in shares), sum(s[2] for s in shares)
    if volumes == 0:
        return None, "no evaluation case in the data"
    how = (f"{timed} of {volumes} evaluation volumes timed" + ("" if timed >= volumes else
                                                                ", the rest extrapolated by their windows"))
    return max(s[0] for s in shares), how


def benchmark_schedule(plan: RunPlan, world_size: int) -> T.Schedule:
    """The run's schedule on KiTS19's 168 training cases (the RCPs' data) at this world size and
    batch; ``--start_eval_at`` / ``--evaluate_every`` when given."""
    cfg = plan.config
    spe = samples_per_epoch(T.TRAIN_CASES, world_size, cfg.batch_size, cfg.ga_steps, cfg.last_batch)
    if spe <= 0:
        raise T.TimeToTrainError(f"KiTS19's {T.TRAIN_CASES} training cases make no full batch of {cfg.batch_size} "
                                 f"on each of {world_size} ranks")
    given = {name: getattr(cfg, name) if name in cfg.explicit else None for name in ("start_eval_at", "evaluate_every")}
    schedule = eval_schedule(spe, T.TRAIN_CASES, given["start_eval_at"], given["evaluate_every"])
    trained = samples_trained_per_epoch(T.TRAIN_CASES, world_size, cfg.batch_size, cfg.ga_steps, cfg.last_batch,
                                        cfg.semantics)
    return T.Schedule(spe, schedule.start_eval_at, schedule.evaluate_every, trained)


def global_batch(plan: RunPlan, world_size: int) -> int:
    return plan.config.batch_size * world_size * plan.config.ga_steps


def measured_differences(plan: RunPlan) -> list[str]:
    """What makes this run's step or evaluation cost other than the benchmark's
    (``runtime.division.cost_reasons``): the network that runs, the patch, the window and overlap."""
    return cost_reasons(plan.network.architecture, plan.config.input_shape, plan.inference.window,
                        plan.inference.overlap)


def per_benchmark_evaluation(seconds: float, num_eval_cases: int | None) -> tuple[float, str]:
    """``seconds`` for this data's evaluation cases as seconds for the benchmark's 42."""
    if not num_eval_cases or num_eval_cases == T.EVAL_CASES:
        return seconds, ""
    return (seconds * T.EVAL_CASES / num_eval_cases,
            f" (this data has {num_eval_cases} evaluation cases: scaled to {T.EVAL_CASES})")


def say_prediction(out: Reporters, lines) -> None:
    """The prediction's lines (rank 0), or one line saying why there is none."""
    if not out.is_main:
        return
    try:
        for line in lines():
            out.say(line)
    except T.TimeToTrainError as error:
        out.say(f"time to train: not predicted: {error}")


def write_record(out: Reporters, times: Sequence[float], items: int, mode: str, eval_seconds: float | None) -> None:
    """``log.json``'s benchmark record (``--log_dir`` given; rank 0): the reference's statistics
    of ``times`` (:func:`~runtime.training.latency.reference_stats`), where its ``--benchmark``
    writes them, and the seconds of one evaluation where measured."""
    extra = {} if eval_seconds is None else {"eval_seconds": eval_seconds}
    out.metrics.write(BENCHMARK, **reference_stats(times, items, mode), timed_iterations=len(times), **extra)


def benchmark_train(components: Components, out: Reporters) -> dict:
    """Time the training steps, then one evaluation pass; print both and the predicted MLPerf
    time to train."""
    plan, world = components.plan, components.dist.world_size
    cfg = plan.config
    budget = Budget.of(plan)
    times, reason = time_training(components, out, budget)
    summary = latency_summary(times, cfg.batch_size * world)
    out.say(format_summary("throughput_train", summary, "samples"))
    for line in stopped_line(reason, len(times), "steps"):
        out.say(line)
    eval_seconds, how = time_evaluation_pass(components, out, budget)
    if eval_seconds is None:
        write_record(out, times, cfg.batch_size * world, "train", None)
        out.say(f"time to train: not predicted: {how} (nothing to time an evaluation with)")
        return summary
    eval_seconds, scaled = per_benchmark_evaluation(eval_seconds, plan.data.num_eval_cases if plan.data else None)
    out.say(f"evaluation: {eval_seconds:.4g} s per evaluation on {world} rank(s) ({how}){scaled}")
    summary = {**summary, "eval_seconds": eval_seconds}
    write_record(out, times, cfg.batch_size * world, "train", eval_seconds)

    def lines():
        rcps = T.installed_rcps()
        prediction = T.predict(summary["throughput"], eval_seconds, global_batch(plan, world),
                               benchmark_schedule(plan, world), world, rcps, measured_differences(plan))
        summary["time_to_train"] = prediction.as_dict()
        return T.prediction_lines(prediction, list(rcps))

    say_prediction(out, lines)
    return summary


# ---------------------------------------------------------------------------------- evaluation

def benchmark_evaluate(components: Components, out: Reporters) -> dict:
    """Time the sliding-window evaluation of each volume after ``--warmup_steps`` volumes; print
    the evaluations' part of the time to train."""
    plan, dev, loader = components.plan, components.dist.device, components.val_loader
    inference, world = plan.inference, components.dist.world_size
    budget = Budget.of(plan)
    epochs = epochs_of(loader, budget.epochs(plan), "evaluation volumes", plan)
    sync = _synchronizer(dev)
    components.eval_model.eval()
    predict = ShapesSeen(build_predictor(components.eval_model, dev, options_from(plan.precision, inference)))
    with torch.no_grad():
        if len(loader):
            warm_window_batches(predict, loader, inference, dev, sync)
        times, reason = timed_loop(epochs, lambda epoch: eval_volumes(out, loader),
                                   lambda item: timed_volume_warm(predict, item[0].to(dev), inference, sync),
                                   plan.config.warmup_steps, stop=lambda times: budget.spent(len(times), sum(times))
                                   if times else None)
    summary = latency_summary(times, world)
    out.say(format_summary("throughput_eval", summary, "volumes"))
    for line in stopped_line(reason, len(times), "volumes"):
        out.say(line)
    eval_seconds = T.EVAL_CASES / summary["throughput"]
    out.say(f"evaluation: {eval_seconds:.4g} s per evaluation of the {T.EVAL_CASES} cases on {world} rank(s) "
            "(from the throughput)")
    summary = {**summary, "eval_seconds": eval_seconds}
    write_record(out, times, world, "eval", eval_seconds)
    say_prediction(out, lambda: T.evaluation_share_lines(eval_seconds, global_batch(plan, world),
                                                         benchmark_schedule(plan, world), world,
                                                         differs=measured_differences(plan)))
    return summary
