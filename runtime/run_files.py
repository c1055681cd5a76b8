"""The files a run writes, and the records in them: their one owner.

The writers (``runtime/run_log.py``, ``runtime/training/``, ``runtime/evaluate/``) and the reader
(``runtime/report/``) take every name and key from here. Standard library only, so the report
reads runs without torch or numpy.

A ``--log_dir`` holds:

* ``unet3d.log``: the MLPerf log, ``:::MLLOG {json}`` lines (mlperf_logging's format). A resumed
  run writes each new attempt to ``unet3d.resumed-<%Y%m%d-%H%M%S>.log``.
* ``log.json``: one JSON object per line, ``{"time": <seconds since the Unix epoch>, "kind": <kind>,
  <that kind's keys>}``; :data:`RECORD_KEYS` lists the keys of each kind. ``MetricsWriter`` refuses
  a kind or key that is not listed there, so a new metric is declared here, and the report carries
  every key of an ``eval`` record (``EvalPoint.metrics``).
* ``eval_cases.csv`` (``--exec_mode evaluate``): one row per case, :data:`EVAL_CASES_COLUMNS`.
* ``curves.png`` (``--plot``).
* ``run_description.json`` (a training run, before ``run_start``): the machines of every process,
  the software, the code and the recipe (``runtime/host.py``); the submission package's system
  description and implementation README are built from it.
* ``previous-<time>/``: a new training run in a used folder moves the last run's files (and its
  checkpoint) there first (:func:`run_file_names`, ``runtime.outputs.move_previous_run``); the
  report and the package read each such folder as an attempt of its own (a crashed one is a
  failed run).

An attempt's MLPerf log holds :data:`RESUMED_FROM_CHECKPOINT` or :data:`CHECKPOINTS_ON_THE_CLOCK`
(this project's own keys, before ``run_start``), or :data:`NOT_CLOSED` (after ``run_start``: a log
that says closed on data that is not KiTS19's), when it is not an MLPerf result.

A report's ``--output`` holds ``summary.md``, ``summary.json`` and ``curves.png``.
"""
from __future__ import annotations

import fnmatch
import time
from typing import Iterable

# -- file names -------------------------------------------------------------------------------

METRICS_LOG = "log.json"
MLPERF_LOG = "unet3d.log"
CURVES_PNG = "curves.png"
EVAL_CASES_CSV = "eval_cases.csv"
SUMMARY_MD = "summary.md"
SUMMARY_JSON = "summary.json"
RUN_DESCRIPTION = "run_description.json"
RESUMED_TIME_FORMAT = "%Y%m%d-%H%M%S"  # sorts in time order, so the attempts sort by name


def resumed_log_name(stamp: str | None = None) -> str:
    """The MLPerf log of a resumed attempt, ``stamp`` (default: the local time now) in its name."""
    return f"unet3d.resumed-{time.strftime(RESUMED_TIME_FORMAT) if stamp is None else stamp}.log"


RESUMED_LOG_GLOB = resumed_log_name("*")

# A new training run in a used --log_dir moves every file of the last run (these names, and the
# resumed attempts' logs) into a folder of its own, ``previous-<time of the last run's newest
# file>[.n]``, so that a folder holds one run's files; the report and the package read each of
# those folders as one more attempt of the folder (``runtime.results.runs.folder_runs``).
PREVIOUS_RUN_PREFIX = "previous-"


def run_file_names(names: Iterable[str]) -> list[str]:
    """The names among ``names`` (a folder's entries) that are files of a training run."""
    own = (MLPERF_LOG, METRICS_LOG, EVAL_CASES_CSV, CURVES_PNG, RUN_DESCRIPTION)
    return sorted(name for name in names if name in own or fnmatch.fnmatchcase(name, RESUMED_LOG_GLOB))

# -- the MLPerf log: the lines and keys the report reads (mlperf_logging's names) ----------------

MLLOG_PREFIX = ":::MLLOG "
RUN_START = "run_start"
RUN_STOP = "run_stop"
SEED = "seed"
CACHE_CLEAR = "cache_clear"  # true only when the page cache was dropped before the run
SUBMISSION_DIVISION = "submission_division"
# read for the predicted time to train (runtime/results/time_to_train.py)
GLOBAL_BATCH_SIZE = "global_batch_size"
SAMPLES_PER_EPOCH = "samples_per_epoch"  # padding counted: the rules' schedule formula's unit
SAMPLES_TRAINED_PER_EPOCH = "samples_trained_per_epoch"  # padding not counted: the unit of every epoch_num
# the seed event's metadata "source": "os" (drawn from the OS: by main.py for --seed -1, or by its
# launcher, run_and_time.sh or `runs`, which say so in UNET3D_SEED_SOURCE=os) or "given" (by hand)
SEED_SOURCE = "source"
SEED_SOURCE_ENV = "UNET3D_SEED_SOURCE"
SEED_FROM_OS, SEED_GIVEN = "os", "given"
TRAIN_SAMPLES = "train_samples"
EVAL_START = "eval_start"
EVAL_STOP = "eval_stop"
# Events of this project's own (not mlperf_logging's) that make an attempt not a result: the
# report, the score and the submission package leave out a log that holds either.
# value: the checkpoint's path; metadata {"epoch": the epoch it resumed after, "step_in_epoch": batches of the next}
RESUMED_FROM_CHECKPOINT = "resumed_from_checkpoint"
# value: the --save_ckpt_path written between run_start and run_stop (the reference's timed run
# writes none); logged before run_start by a run that will save checkpoints on the clock
CHECKPOINTS_ON_THE_CLOCK = "checkpoints_on_the_clock"
# value: why the run is not closed, in words (runtime.division.data_reasons: synthetic data, not
# KiTS19's 168/42 cases); logged after run_start by a run whose submission_division, logged from
# the flags before init_stop, says closed but whose data, first read after run_start, is not
# the closed benchmark's
NOT_CLOSED = "not_closed"
NOT_A_RESULT_EVENTS = (RESUMED_FROM_CHECKPOINT, CHECKPOINTS_ON_THE_CLOCK, NOT_CLOSED)

# -- log.json ---------------------------------------------------------------------------------

RECORD_HEADER = ("time", "kind")  # in every record, written by MetricsWriter itself
TRAIN = "train"  # after every training epoch
EVAL = "eval"  # after every evaluation; ``--exec_mode evaluate`` adds the checkpoint's path
RESULT = "result"  # training's status at its end (MLPerf's run_stop knows success and aborted only)
BACKEND = "backend"  # ``--exec_mode evaluate``: the backend used and why (``--backend``)
BENCHMARK = "benchmark"  # ``--benchmark --log_dir``: the timing, once, at its end, in the reference's keys
# The reference's --benchmark statistics (its PerformanceCallback, mode "train"; this project's
# evaluate --benchmark the same with "eval"): samples/s (mean of each timed step's) and step
# latency in ms (mean, 90th, 95th, 99th percentile).
BENCHMARK_STATS = ("throughput_train", "latency_train_mean", "latency_train_90", "latency_train_95", "latency_train_99",
                   "throughput_eval", "latency_eval_mean", "latency_eval_90", "latency_eval_95", "latency_eval_99")

RECORD_KEYS: dict[str, tuple[str, ...]] = {
    TRAIN: ("epoch", "loss", "lr", "throughput"),  # throughput: samples/s over the epoch, all ranks
    # l1: kidney, l2: tumour; eval_cases: the number of cases scored, over all ranks
    EVAL: ("epoch", "checkpoint", "mean_dice", "l1_dice", "l2_dice", "eval_loss", "eval_cases"),
    RESULT: ("status", "epoch", "epochs"),  # status: success | aborted | preempted | finished
    BACKEND: ("backend", "why"),
    # timed_iterations: steps (volumes) timed; eval_seconds: one evaluation of the 42 cases, where timed
    BENCHMARK: (*BENCHMARK_STATS, "timed_iterations", "eval_seconds"),
}


# keys declared by their ending: an own-data run's Dice per label, named after its labels
# (``runtime.labels.dice_keys``: "kidney_dice", "cyst_dice"; KiTS19's are l1_dice and l2_dice)
RECORD_KEY_SUFFIXES: dict[str, tuple[str, ...]] = {EVAL: ("_dice",)}


def check_record(kind: str, keys: Iterable[str]) -> None:
    """ValueError unless ``kind`` and every one of ``keys`` are declared in :data:`RECORD_KEYS`
    (a programming error: the writer and the report would disagree on the file)."""
    if kind not in RECORD_KEYS:
        raise ValueError(f"log.json record kind {kind!r} is not declared in runtime/run_files.py RECORD_KEYS")
    suffixes = RECORD_KEY_SUFFIXES.get(kind, ())
    unknown = [key for key in keys if key not in RECORD_KEYS[kind] and not key.endswith(suffixes)]
    if unknown:
        raise ValueError(f"log.json {kind!r} record: key(s) {', '.join(map(repr, unknown))} not declared in "
                         "runtime/run_files.py RECORD_KEYS")


# -- eval_cases.csv ---------------------------------------------------------------------------

EVAL_CASES_COLUMNS = ("case", "kidney_dice", "tumour_dice", "mean_dice", "eval_loss", "scan_kidney_dice",
                      "scan_tumour_dice", "scan_mean_dice")

# -- thresholds -------------------------------------------------------------------------------

QUALITY_THRESHOLD = 0.908  # the benchmark's target mean Dice (--quality_threshold's default)

# -- MLPerf's messaging guidelines: said beside every score the report and the package write ------

UNVERIFIED = ("Unverified: 3D U-Net left MLPerf Training after v4.0 and no MLCommons round reviews its results, so a "
              "score made now is unverified under the MLPerf results messaging guidelines. Result not verified by "
              "MLCommons Association.")
DIVERGED_DICE = 1e-6  # training stops a run as diverged when an evaluation's mean Dice is below this
