"""The MLPerf time to train a run can expect, from its measured speed: what ``--benchmark`` prints
and the run report shows beside a real run's time.

An MLPerf unet3d result is the time from ``run_start`` to reaching mean Dice 0.908, and the
score is the mean of 40 such runs less the 4 fastest and the 4 slowest. One run takes

    samples trained to converge / training throughput + evaluations x seconds per evaluation

(evaluation is synchronous; initialisation is not timed). The epochs a run needs at a global
batch come from MLCommons' reference convergence points (RCPs), which ship in the installed
``mlperf-logging`` package (``rcp_checker/training_4.0.0/rcps_unet3d.json``, read where the
package is installed, never copied): per global batch, the samples to converge of many reference
runs (samples = epochs x 168). At a global batch without an RCP the prediction follows what the
official RCP checker (``rcp_checker.check_directory``) holds such a run to: between two RCPs (of
its pruned set) their interpolation, made here from their quantiles (the checker interpolates
their means linearly in the global batch); below the smallest RCP the smallest, as a lower bound
(the checker accepts a run there only if it converges no faster); above the largest none (the
checker fails it: "Missing RCP"). The output says which. A run converges at the first evaluation
epoch by which it has trained an RCP run's samples, so the evaluations it pays for follow from
its schedule (``start_eval_at``, ``evaluate_every``). Each reference run gives one run time: their
mean and 5th-95th percentiles are one run's band; the expected score is the mean of the 40-run
rule over draws from them (exact order statistics), its band the 5th-95th percentiles of that
rule over many drawn sets of 40.

Standard library only at import (the report reads runs without numpy): numpy is imported where
the score's band is drawn.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

RCP_RULESET = "training_4.0.0"  # unet3d's last round (MLPerf Training v4.0)
RCP_FILE = "rcps_unet3d.json"
RCP_SAMPLES_PER_EPOCH = 168  # the RCP file's samples = epochs x 168 (KiTS19's training cases)
TRAIN_CASES = 168
EVAL_CASES = 42
SUBMISSION_RUNS = 40  # MLPerf's unet3d result: 40 runs ...
DROPPED_EACH_END = 4  # ... less the 4 fastest and the 4 slowest
BAND = (5.0, 95.0)  # percentiles of the bands
BAND_SETS = 20000  # sets of 40 runs drawn for the score's band
BAND_SEED = 0


class TimeToTrainError(RuntimeError):
    """No prediction can be made (the RCP file is missing or unreadable, or an input is not a
    positive number); the message is one line."""


# ------------------------------------------------------------------------------- the RCPs

MEASURED, INTERPOLATED, LOWER_BOUND = "measured", "interpolated", "lower bound"


@dataclass(frozen=True)
class Rcp:
    """One reference convergence point: a global batch and the samples to converge of each of
    its reference runs. ``kind``: measured (a record of the file), interpolated (between the
    records at the global batches ``between``) or lower bound (the smallest record, standing
    for a smaller global batch that has none)."""

    name: str
    global_batch: int
    samples: tuple[int, ...]
    kind: str = MEASURED
    between: tuple[int, ...] = ()

    @property
    def epochs(self) -> tuple[float, ...]:
        return tuple(s / RCP_SAMPLES_PER_EPOCH for s in self.samples)


def rcp_path():
    """The installed mlperf-logging's unet3d RCP file (an ``importlib.resources`` path)."""
    from importlib import resources

    try:
        return resources.files("mlperf_logging") / "rcp_checker" / RCP_RULESET / RCP_FILE
    except ModuleNotFoundError:
        raise TimeToTrainError("mlperf-logging is not installed (pip install -r requirements.txt): its "
                               "reference convergence points give the epochs to converge") from None


def load_rcps(path=None) -> dict[int, Rcp]:
    """The unet3d RCPs by global batch, from ``path`` (default: :func:`rcp_path`)."""
    path = rcp_path() if path is None else path
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
        rcps = {}
        for name, record in records.items():
            if record.get("Benchmark") != "unet3d":
                continue
            samples = tuple(int(s) for s in record["Epochs to converge"])
            if not samples or min(samples) <= 0:
                raise ValueError(f"{name}: no positive sample count")
            rcps[int(record["BS"])] = Rcp(name, int(record["BS"]), samples)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise TimeToTrainError(f"cannot read the unet3d RCPs {path}: {error}") from None
    if not rcps:
        raise TimeToTrainError(f"no unet3d RCP in {path}")
    return rcps


@lru_cache(maxsize=1)
def installed_rcps() -> dict[int, Rcp]:
    """:func:`load_rcps` of the installed package, read once per process."""
    return load_rcps()


def olympic_mean(values: Sequence[float], drop: int = DROPPED_EACH_END) -> float:
    """The mean less the ``drop`` smallest and largest: the RCP checker's "RCP Mean" of unet3d."""
    kept = sorted(values)[drop:len(values) - drop]
    return sum(kept) / len(kept)


def pruned(rcps: dict[int, Rcp]) -> dict[int, Rcp]:
    """The RCPs the official checker keeps for its default (pruned) pass (``RCP_Checker.
    _prune_rcps``): none below the global batch that converges fastest, then, from the smallest up,
    each dropped that converges slower than the interpolation of its two neighbours."""
    means = {batch: olympic_mean(rcp.samples) for batch, rcp in rcps.items()}
    fastest = min(means, key=lambda batch: (means[batch], batch))
    kept = sorted(batch for batch in rcps if batch >= fastest)
    i = 1
    while i < len(kept) - 1:
        low, batch, high = kept[i - 1], kept[i], kept[i + 1]
        if means[batch] > means[low] + (means[high] - means[low]) * (batch - low) / (high - low):
            del kept[i]
            i -= 1
        i += 1
    return {batch: rcps[batch] for batch in kept}


def interpolated(low: Rcp, high: Rcp, global_batch: int) -> Rcp:
    """An RCP at ``global_batch`` between ``low`` and ``high``: each quantile interpolated linearly
    in the global batch (its mean about the interpolation of theirs, the checker's)."""
    weight = (global_batch - low.global_batch) / (high.global_batch - low.global_batch)
    count = max(len(low.samples), len(high.samples))
    quantiles = [100.0 * i / (count - 1) for i in range(count)]
    samples = tuple(round((1 - weight) * percentile(low.samples, q) + weight * percentile(high.samples, q))
                    for q in quantiles)
    return Rcp(f"unet3d_interp_{global_batch}", global_batch, samples, INTERPOLATED,
               (low.global_batch, high.global_batch))


def rcp_for(rcps: dict[int, Rcp], global_batch: int) -> Rcp:
    """The RCP a run at ``global_batch`` is predicted from: the one at that batch; else, as the
    official checker decides, the interpolation of the nearest below and above it among the
    pruned RCPs, or below the smallest the smallest, as a lower bound; none above the largest
    (the checker fails such a run: one line)."""
    if global_batch in rcps:
        return rcps[global_batch]
    kept = pruned(rcps)
    below = [batch for batch in kept if batch < global_batch]
    above = [batch for batch in kept if batch > global_batch]
    if below and above:
        return interpolated(kept[max(below)], kept[min(above)], global_batch)
    if above:
        smallest = kept[min(above)]
        return Rcp(smallest.name, smallest.global_batch, smallest.samples, LOWER_BOUND, (smallest.global_batch,))
    known = ", ".join(str(batch) for batch in sorted(rcps))
    raise TimeToTrainError(f"no RCP at global batch {global_batch} or above (mlperf-logging {RCP_RULESET} has them "
                           f"at {known}): rcp_checker fails such a run (\"Missing RCP\") unless its submission "
                           "brings RCPs of its own")


def rcp_basis(rcp: Rcp, global_batch: int) -> str:
    """What a prediction stands on, in a few words."""
    if rcp.kind == INTERPOLATED:
        return f"interpolated between the RCPs at global batches {rcp.between[0]} and {rcp.between[1]}"
    if rcp.kind == LOWER_BOUND:
        return f"a lower bound: no RCP at global batch {global_batch}, the smallest (at {rcp.global_batch}) bounds it"
    return f"RCP at global batch {rcp.global_batch}"


# --------------------------------------------------------------------------- one run's time

@dataclass(frozen=True)
class Schedule:
    """A run's epochs and evaluations (``runtime.schedule``'s, resolved for the run)."""

    samples_per_epoch: int  # global samples computed per epoch (a padded last batch counted): the time's unit
    start_eval_at: int
    evaluate_every: int
    # global samples trained per epoch (padding not counted): the RCPs' unit; None: samples_per_epoch
    samples_trained_per_epoch: int | None = None

    @property
    def trained_per_epoch(self) -> int:
        return self.samples_trained_per_epoch or self.samples_per_epoch

    def eval_schedule(self):
        """The evaluation epochs as the training loop decides them (one rule, in runtime.schedule)."""
        from runtime.schedule import EvalSchedule

        return EvalSchedule(self.start_eval_at, self.evaluate_every, 0)

    @property
    def first_eval_epoch(self) -> int:
        return self.eval_schedule().first_eval_epoch

    def converged_epoch(self, samples: int) -> int:
        """The first evaluation epoch by whose end ``samples`` samples have been trained (an RCP's
        samples to converge count samples trained: padding, which trains nothing, never counts)."""
        return self.eval_schedule().next_eval_epoch(-(-samples // self.trained_per_epoch))

    def evaluations(self, epoch: int) -> int:
        """Evaluations run up to and including epoch ``epoch``."""
        return self.eval_schedule().evaluations_through(epoch)


@dataclass(frozen=True)
class RunTime:
    epochs: int
    evaluations: int
    train_seconds: float
    eval_seconds: float

    @property
    def seconds(self) -> float:
        return self.train_seconds + self.eval_seconds


def run_time(samples: int, schedule: Schedule, train_throughput: float, eval_seconds: float) -> RunTime:
    """One run that converges after ``samples`` samples trained: its epochs, evaluations and time
    (an epoch takes its samples computed, padding included, at the measured throughput, which
    counts every sample computed)."""
    epoch = schedule.converged_epoch(samples)
    evaluations = schedule.evaluations(epoch)
    return RunTime(epoch, evaluations, epoch * schedule.samples_per_epoch / train_throughput,
                   evaluations * eval_seconds)


# ------------------------------------------------------------------------------- statistics

def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (numpy's default method)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def expected_trimmed_mean(values: Sequence[float], runs: int = SUBMISSION_RUNS,
                          drop: int = DROPPED_EACH_END) -> float:
    """The expected mean of ``runs`` independent draws from ``values`` (each equally likely) less
    the ``drop`` smallest and ``drop`` largest: exact, from the order statistics' distribution
    (the k-th smallest of ``runs`` is at most v when at least k draws are)."""
    if runs <= 2 * drop:
        raise ValueError(f"{runs} runs less {drop} at each end leave none")
    ordered = sorted(values)
    distinct = sorted(set(ordered))
    cdf = [sum(1 for v in ordered if v <= value) / len(ordered) for value in distinct]
    total = 0.0
    for k in range(drop + 1, runs - drop + 1):
        below = 0.0  # P(k-th smallest <= the previous value)
        for value, p in zip(distinct, cdf):
            at_most = sum(math.comb(runs, i) * p ** i * (1 - p) ** (runs - i) for i in range(k, runs + 1))
            total += value * (at_most - below)
            below = at_most
    return total / (runs - 2 * drop)


def trimmed_mean_band(values: Sequence[float], runs: int = SUBMISSION_RUNS, drop: int = DROPPED_EACH_END,
                      band: tuple[float, float] = BAND, sets: int = BAND_SETS,
                      seed: int = BAND_SEED) -> tuple[float, float]:
    """Percentiles ``band`` of the trimmed mean over ``sets`` sets of ``runs`` draws from
    ``values`` (a fixed seed: the same band every time)."""
    import numpy as np

    draws = np.random.default_rng(seed).choice(np.asarray(values, dtype=np.float64), size=(sets, runs))
    means = np.sort(draws, axis=1)[:, drop:runs - drop].mean(axis=1)
    low, high = np.percentile(means, band)
    return float(low), float(high)


# ----------------------------------------------------------------------------- the prediction

@dataclass(frozen=True)
class Prediction:
    global_batch: int
    world_size: int
    rcp: Rcp
    schedule: Schedule
    train_throughput: float  # samples/s, all ranks
    eval_seconds: float  # one evaluation of the 42 cases, all ranks
    runs: tuple[RunTime, ...]  # one per reference run of the RCP
    score_s: float  # expected score: mean of 40 runs less the 4 fastest and 4 slowest
    score_band_s: tuple[float, float]
    # what of the measured run is not the benchmark's (its network, patch, window, overlap), in
    # words: the prediction is then that configuration's, not the benchmark's
    differs: tuple[str, ...] = ()

    @property
    def run_mean_s(self) -> float:
        return sum(r.seconds for r in self.runs) / len(self.runs)

    @property
    def run_band_s(self) -> tuple[float, float]:
        seconds = [r.seconds for r in self.runs]
        return percentile(seconds, BAND[0]), percentile(seconds, BAND[1])

    def mean_of(self, field: str) -> float:
        return sum(getattr(r, field) for r in self.runs) / len(self.runs)

    def as_dict(self) -> dict:
        low, high = self.run_band_s
        return {"global_batch": self.global_batch, "world_size": self.world_size, "rcp": self.rcp.name,
                "rcp_global_batch": self.rcp.global_batch, "rcp_runs": len(self.rcp.samples),
                "rcp_kind": self.rcp.kind, "rcp_basis": rcp_basis(self.rcp, self.global_batch),
                "train_throughput": self.train_throughput, "eval_seconds": self.eval_seconds,
                "run_mean_s": self.run_mean_s, "run_p5_s": low, "run_p95_s": high,
                "score_s": self.score_s, "score_p5_s": self.score_band_s[0], "score_p95_s": self.score_band_s[1],
                "evaluations_mean": self.mean_of("evaluations"), "not_the_benchmark": list(self.differs)}


def _positive(value: float, what: str) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise TimeToTrainError(f"no time to train predicted: {what} is {value!r}, not a positive number")
    return float(value)


def predict(train_throughput: float, eval_seconds: float, global_batch: int, schedule: Schedule,
            world_size: int = 1, rcps: dict[int, Rcp] | None = None, differs: Sequence[str] = ()) -> Prediction:
    """The time to train at ``train_throughput`` samples/s and ``eval_seconds`` per evaluation
    (both over all ranks), for ``global_batch`` on ``schedule``, from :func:`rcp_for`'s RCP
    (``rcps``: default the installed package's); ``differs``: what of the measured run is not the
    benchmark's (``runtime.division.cost_reasons``), said with the prediction."""
    train_throughput = _positive(train_throughput, "the training throughput")
    eval_seconds = _positive(eval_seconds, "the seconds per evaluation")
    rcp = rcp_for(installed_rcps() if rcps is None else rcps, global_batch)
    runs = tuple(run_time(s, schedule, train_throughput, eval_seconds) for s in rcp.samples)
    seconds = [r.seconds for r in runs]
    return Prediction(global_batch, world_size, rcp, schedule, train_throughput, eval_seconds, runs,
                      expected_trimmed_mean(seconds), trimmed_mean_band(seconds), tuple(differs))


# --------------------------------------------------------------------------------- as text

def duration_text(seconds: float) -> str:
    """Minutes (MLPerf's unit) up to 2 hours, then hours, then days."""
    minutes = seconds / 60.0
    if minutes < 120:
        return f"{minutes:.2f} min"
    if minutes < 72 * 60:
        return f"{minutes / 60:.1f} h"
    return f"{minutes / 1440:.1f} days"


def band_text(low: float, high: float) -> str:
    return f"{duration_text(low)} - {duration_text(high)}"


def rcp_text(rcp: Rcp, global_batch: int, rcps_batches: Sequence[int] = ()) -> str:
    """The RCP line: which reference runs, and when the run's global batch has none, what stands
    in for them and why (never silently another batch's)."""
    epochs = rcp.epochs
    spread = (f"epochs to converge mean {sum(epochs) / len(epochs):.0f}, 5th-95th percentile "
              f"{percentile(epochs, BAND[0]):.0f}-{percentile(epochs, BAND[1]):.0f}")
    known = ", ".join(str(b) for b in sorted(rcps_batches)) or "?"
    if rcp.kind == INTERPOLATED:
        return (f"RCP {rcp.name}: no RCP at global batch {global_batch} (mlperf-logging {RCP_RULESET} has them at "
                f"{known}): interpolated between those at {rcp.between[0]} and {rcp.between[1]}, as rcp_checker "
                f"interpolates; {spread}")
    if rcp.kind == LOWER_BOUND:
        return (f"RCP {rcp.name} as a LOWER BOUND: no RCP at global batch {global_batch} (mlperf-logging "
                f"{RCP_RULESET} has them at {known}); rcp_checker accepts a run below the smallest only if it "
                f"converges no faster than the one at {rcp.global_batch} ({len(epochs)} reference runs: {spread})")
    return f"RCP {rcp.name} ({len(epochs)} reference runs, mlperf-logging {RCP_RULESET}): {spread}"


def schedule_text(schedule: Schedule) -> str:
    trained = ("" if schedule.trained_per_epoch == schedule.samples_per_epoch else
               f" ({schedule.trained_per_epoch} trained, the rest padding; the RCPs count samples trained)")
    return (f"{schedule.samples_per_epoch} samples per epoch{trained}, evaluations from epoch "
            f"{schedule.first_eval_epoch} every {schedule.evaluate_every}")


def differs_line(differs: Sequence[str]) -> list[str]:
    """The line that says the measured run is not the benchmark's, and what of it is not (none when
    it is the benchmark's network, patch and window)."""
    if not differs:
        return []
    return [f"  NOT the benchmark's network or shapes: {'; '.join(differs)}: the times measured are this "
            "configuration's, so the prediction is its time to train, not the benchmark's"]


def prediction_lines(p: Prediction, rcps_batches: Sequence[int] = ()) -> list[str]:
    low, high = p.run_band_s
    bound = "; a lower bound" if p.rcp.kind == LOWER_BOUND else ""
    return [
        f"time to train (MLPerf, predicted): global batch {p.global_batch} on {p.world_size} rank(s), "
        f"{p.train_throughput:.4g} samples/s, {p.eval_seconds:.4g} s per evaluation of the {EVAL_CASES} cases; "
        + schedule_text(p.schedule),
        *differs_line(p.differs),
        "  " + rcp_text(p.rcp, p.global_batch, rcps_batches),
        f"  one run: mean {duration_text(p.run_mean_s)} (5th-95th percentile {band_text(low, high)}) = "
        f"training {duration_text(p.mean_of('train_seconds'))} + {p.mean_of('evaluations'):.1f} evaluations x "
        f"{p.eval_seconds:.4g} s = {duration_text(p.mean_of('eval_seconds'))}{bound}",
        f"  score (mean of {SUBMISSION_RUNS} runs less the {DROPPED_EACH_END} fastest and {DROPPED_EACH_END} "
        f"slowest): {duration_text(p.score_s)} expected (5th-95th percentile {band_text(*p.score_band_s)}); "
        f"initialisation not timed{bound}",
    ]


def evaluation_share_lines(eval_seconds: float, global_batch: int, schedule: Schedule, world_size: int = 1,
                           rcps: dict[int, Rcp] | None = None, differs: Sequence[str] = ()) -> list[str]:
    """``--exec_mode evaluate --benchmark``: the evaluations' part of the time to train (the
    training part needs the training throughput)."""
    eval_seconds = _positive(eval_seconds, "the seconds per evaluation")
    rcps = installed_rcps() if rcps is None else rcps
    rcp = rcp_for(rcps, global_batch)
    counts = [schedule.evaluations(schedule.converged_epoch(s)) for s in rcp.samples]
    mean = sum(counts) / len(counts)
    low, high = percentile(counts, BAND[0]), percentile(counts, BAND[1])
    bound = "; a lower bound" if rcp.kind == LOWER_BOUND else ""
    return [
        f"time to train (MLPerf, predicted): its evaluations at global batch {global_batch} on {world_size} "
        f"rank(s), {eval_seconds:.4g} s per evaluation of the {EVAL_CASES} cases; " + schedule_text(schedule),
        *differs_line(differs),
        "  " + rcp_text(rcp, global_batch, list(rcps)),
        f"  evaluations in one run: mean {mean:.1f} = {duration_text(mean * eval_seconds)} (5th-95th percentile "
        f"{low:.0f}-{high:.0f} = {band_text(low * eval_seconds, high * eval_seconds)}); the training part: "
        f"--exec_mode train --benchmark measures it and predicts the whole{bound}",
    ]
