"""MLPerf logging (``<log_dir>/unet3d.log``) and the JSON-lines metrics file (``log.json``); the
files' names and the records' kinds and keys are ``runtime/run_files.py``'s.

Loggers are built once, by the runtime, on rank 0; on other ranks they are silent no-ops.
Nothing is configured at import.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any

from mlperf_logging import mllog
from mlperf_logging.mllog import constants as C

from data_loading.write_errors import append_bytes, failure_reason
from model.unet3d import weight_init_tensor_names
from runtime.outputs import OutputError
from runtime.plan import NetworkPlan, RunPlan
from runtime.run_files import (CHECKPOINTS_ON_THE_CLOCK, METRICS_LOG, MLPERF_LOG, NOT_CLOSED,
                               RESUMED_FROM_CHECKPOINT, SEED_FROM_OS, SEED_GIVEN, SEED_SOURCE, SEED_SOURCE_ENV,
                               check_record)


CACHE_CLEARED_ENV = "UNET3D_CACHE_CLEARED"
IN_RAM = ("tmpfs", "ramfs")  # file systems whose files live in RAM: no page-cache drop evicts them


def _unescape(field: str) -> str:
    """A path of ``/proc/self/mountinfo`` (``\\040`` for a space, octal escapes)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_type(path: str, mountinfo: str | None = None) -> str:
    """The type of the file system that holds ``path`` by its name: the mount of
    ``/proc/self/mountinfo`` (``mountinfo``: its text) with the longest mount point above the
    absolute path. The path itself is never touched (no stat, no link resolved: before
    ``run_start`` nothing touches the data); '' when unknown."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as handle:
                mountinfo = handle.read()
        except OSError:
            return ""
    target = os.path.normpath(os.path.abspath(path))
    best, kind = -1, ""
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = _unescape(fields[4])
        after = line.split(" - ", 1)[1].split()
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best and after:
            best, kind = len(point), after[0]
    return kind


def cache_cleared(data_dir: str = "", mountinfo: str | None = None) -> tuple[bool, str]:
    """Whether the data of this run is cold, and the one line to say when the program knows
    better than its launcher: the job scripts and run_and_time.sh drop the page cache
    (scripts/lib/drop_page_cache.sh: after the last write to the data, or not counted) and say
    so in ``UNET3D_CACHE_CLEARED=1`` (0 when they could not; unset when the program was started
    some other way). Data on tmpfs or ramfs (``data_dir``'s file system by its name,
    :func:`filesystem_type`) is in RAM whatever was dropped: false, with the reason. The MLPerf
    log's ``cache_clear`` records this, never a claim nobody made."""
    if os.environ.get(CACHE_CLEARED_ENV, "") != "1":
        return False, ""
    kind = filesystem_type(data_dir, mountinfo) if data_dir else ""
    if kind in IN_RAM:
        return False, (f"cache_clear false: --data_dir {data_dir} is on {kind}, in RAM, which no page-cache drop "
                       "evicts (the rules: data starts on durable storage, \"This explicitly excludes RAM\"), so a "
                       "closed run is no result; keep the dataset on a disk")
    return True, ""


def seed_source(plan: RunPlan) -> tuple[str, str]:
    """Where the run's master seed came from, and the one line a closed run with a hand-given seed
    says: ``"os"`` when main.py drew it (``--seed -1``: ``os.urandom`` on rank 0, the plan's seed
    decision asked for -1) or its launcher did and says so (``UNET3D_SEED_SOURCE=os``:
    run_and_time.sh for its default seed, ``python -m runtime.submission runs``), else
    ``"given"``. The rules (``training_rules.adoc``, "Random numbers"): closed-division random
    number generators are seeded from the clock, the OS's randomness or an RNG seeded from them."""
    decision = plan.decision("seed")
    asked = decision.asked if decision is not None else plan.seed
    if (isinstance(asked, int) and asked < 0) or os.environ.get(SEED_SOURCE_ENV, "") == SEED_FROM_OS:
        return SEED_FROM_OS, ""
    if plan.division != "closed":
        return SEED_GIVEN, ""
    return SEED_GIVEN, (f"seed {plan.seed} was given by hand: the rules want closed-division seeds from the clock, "
                        "the OS's randomness or an RNG seeded from them (training_rules.adoc, \"Random numbers\"); "
                        "leave --seed out (or -1) to draw one from the OS; the submission package names this run")


class _AppendHandler(logging.Handler):
    """Appends each record to ``path`` as one whole line (:func:`append_bytes`: a failed write
    cuts the file back, so the log never ends in half a line). Nothing is buffered, so closing
    writes nothing and cannot fail. A write failure (disk full, quota, read-only) stops the run
    with one line, instead of logging's default: a traceback on stderr and the event lost."""

    def __init__(self, path: str):
        super().__init__(logging.INFO)
        self.baseFilename = path

    def emit(self, record: logging.LogRecord) -> None:
        line = (self.format(record) + "\n").encode("utf-8")
        try:
            append_bytes(self.baseFilename, line)
        except OSError as err:
            raise OutputError(f"cannot write the MLPerf log {self.baseFilename!r}: {failure_reason(err)}") from None


class MLPerfLogger:
    """``:::MLLOG`` lines through ``mlperf_logging.mllog``, written by rank 0 only."""

    def __init__(self, log_dir: str, enabled: bool, name: str | None = None):
        self.enabled = enabled
        self._handlers: list[logging.Handler] = []
        self._logger = None
        if not enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, name or MLPERF_LOG)
        base = logging.getLogger(f"unet3d.mlperf.{id(self)}")
        base.setLevel(logging.INFO)
        base.propagate = False
        handler = _AppendHandler(self.path)
        base.addHandler(handler)
        self._handlers = [handler]
        self._base = base
        self._logger = mllog.mllog.MLLogger(logger=base, default_stack_offset=2,
                                            root_dir=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def event(self, key: str, value: Any = None, metadata: dict | None = None) -> None:
        if self._logger:
            self._logger.event(key=key, value=value, metadata=metadata)

    def start(self, key: str, value: Any = None, metadata: dict | None = None) -> None:
        if self._logger:
            self._logger.start(key=key, value=value, metadata=metadata)

    def end(self, key: str, value: Any = None, metadata: dict | None = None) -> None:
        if self._logger:
            self._logger.end(key=key, value=value, metadata=metadata)

    def close(self) -> None:
        for handler in self._handlers:
            handler.close()
            self._base.removeHandler(handler)
        self._handlers = []
        self._logger = None

    def not_a_result(self, resumed_from: tuple[str, int, int] | None, checkpoints_to: str,
                     weights_only: bool = False) -> None:
        """This project's own events (runtime/run_files.py) that make this attempt not an MLPerf
        result: ``resumed_from`` (checkpoint path, epoch and batches trained before it) when the
        attempt started from a checkpoint (``weights_only``: its weights alone, a warm start
        with --load_ckpt_path), ``checkpoints_to`` (the --save_ckpt_path) when it writes
        checkpoints between run_start and run_stop. The report and the package leave such an
        attempt out."""
        if resumed_from is not None:
            path, epoch, step = resumed_from
            metadata = {"epoch": epoch, "step_in_epoch": step}
            if weights_only:
                metadata["weights_only"] = True
            self.event(RESUMED_FROM_CHECKPOINT, value=path, metadata=metadata)
        if checkpoints_to:
            self.event(CHECKPOINTS_ON_THE_CLOCK, value=checkpoints_to)

    def not_closed(self, reasons: str) -> None:
        """The log's ``submission_division`` (logged from the flags before ``init_stop``) says
        closed, but the data, first read after ``run_start``, is not the closed benchmark's:
        ``reasons`` in words (``runtime.division.data_reasons``). The report, the score and the
        package leave such a log out (``runtime/run_files.py``'s ``NOT_CLOSED``)."""
        if reasons:
            self.event(NOT_CLOSED, value=reasons)

    # -- the benchmark's fixed records ---------------------------------------------------------
    def submission_info(self, plan: RunPlan) -> None:
        """The submission's records and the master seed (``plan`` resolved by
        ``runtime.resolve.resolve``: the seed drawn, the division decided from the flags), before
        ``init_start``. The division cannot wait for the data's case counts (known after
        ``run_start``): the 4.0.0 checker sets the initialisation time limit it checks at
        ``init_stop`` from it (no division logged before ``init_stop`` fails every log). A
        closed log whose data then is not KiTS19's 168/42 fails its ``train_samples`` /
        ``eval_samples`` checks; ``resolve_data`` says so in one line."""
        flags = plan.config
        cleared, why = cache_cleared(flags.data_dir)
        if why and self.enabled:
            print(why)
        self.event(C.CACHE_CLEAR, value=cleared)
        self.event(C.SUBMISSION_BENCHMARK, value=C.UNET3D)
        self.event(C.SUBMISSION_ORG, value=flags.submission_org)
        self.event(C.SUBMISSION_DIVISION, value=plan.division)
        self.event(C.SUBMISSION_STATUS, value=flags.submission_status)
        self.event(C.SUBMISSION_PLATFORM, value=flags.submission_platform)
        # The one seed every other is derived from (per rank, per epoch's shuffle, per sample:
        # data_loading/sampler.py, runtime/distributed.py); the checker wants exactly one. Its
        # metadata says where it came from (the package names closed runs with a hand-given one).
        source, said = seed_source(plan)
        if said and self.enabled:
            print(said)
        self.event(C.SEED, value=plan.seed, metadata={SEED_SOURCE: source})

    def weights_initialization(self, network: NetworkPlan) -> None:
        for name in weight_init_tensor_names(len(network.filters), network.normalization):
            self.event(C.WEIGHTS_INITIALIZATION, metadata={"tensor": name})

    def hyperparameters(self, plan: RunPlan, world_size: int) -> None:
        """The run's hyper-parameters, every one the rules list for unet3d (closed: global batch
        size, base and initial learning rate, momentum, warm-up and decay epochs, decay factor,
        weight decay); ``plan`` resolved with its data (case and sample counts)."""
        config, data, training = plan.config, plan.data, plan.training
        self.event(C.GLOBAL_BATCH_SIZE, value=config.batch_size * world_size * config.ga_steps)
        self.event(C.GRADIENT_ACCUMULATION_STEPS, value=config.ga_steps)
        self.event(C.OPT_NAME, value=config.optimizer)
        self.event(C.OPT_BASE_LR, value=config.learning_rate)
        self.event("opt_initial_learning_rate", value=config.init_learning_rate)
        self.event(C.OPT_LR_WARMUP_EPOCHS, value=config.lr_warmup_epochs)
        self.event(C.OPT_LR_DECAY_BOUNDARY_EPOCHS, value=list(config.lr_decay_epochs))
        self.event(C.OPT_LR_DECAY_FACTOR, value=config.lr_decay_factor)
        self.event(C.OPT_WEIGHT_DECAY, value=config.weight_decay)
        self.event("opt_momentum", value=config.momentum)
        self.event("oversampling", value=config.oversampling)
        self.event("training_input_shape", value=list(config.input_shape))
        self.event("validation_input_shape", value=list(plan.inference.window))
        self.event("validation_overlap", value=plan.inference.overlap)
        self.event(C.TRAIN_SAMPLES, value=data.num_train_cases if data else None)
        self.event(C.EVAL_SAMPLES, value=data.num_eval_cases if data else None)
        # padding counted: the schedule's unit
        self.event("samples_per_epoch", value=training.samples_per_epoch if training else None)
        # padding not counted: the unit of every epoch_num in this log (runtime.schedule)
        self.event("samples_trained_per_epoch", value=training.samples_trained_per_epoch if training else None)


class MetricsWriter:
    """One JSON object per line in ``<log_dir>/log.json`` (rank 0 only); each record's kind and
    keys are checked against ``run_files.RECORD_KEYS`` on every rank, enabled or not, so a key the
    report does not know fails the first test that writes it."""

    def __init__(self, log_dir: str, enabled: bool):
        self.enabled = enabled
        self.path = os.path.join(log_dir, METRICS_LOG)
        if enabled:
            os.makedirs(log_dir, exist_ok=True)

    def write(self, kind: str, **values: Any) -> None:
        check_record(kind, values)
        if not self.enabled:
            return
        record = {"time": time.time(), "kind": kind, **values}
        try:
            append_bytes(self.path, (json.dumps(record) + "\n").encode("utf-8"))
        except OSError as err:  # the file is cut back to its last whole line
            raise OutputError(f"cannot write {self.path!r}: {failure_reason(err)}") from None
