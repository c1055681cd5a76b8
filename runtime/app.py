"""One lifecycle for every exec mode.

:func:`run` checks the mode's outputs, starts the process group, installs the signal handlers,
locks the outputs (rank 0 holds the locks, every rank learns the outcome), runs the mode's body
(which resolves the config once and builds what it computes with) and tears everything down in
reverse order; a run refused before it wrote anything leaves no empty folder behind.

A mode is one entry of :data:`MODES` (:class:`Mode`): the outputs it writes, whether a signal
stops it at once (nothing to save) or at the next step (training saves), what it checks before
the process group starts, and its body. docs/development.md: "An exec mode".
"""
from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable

import torch
from mlperf_logging.mllog import constants as C

from runtime import checkpoint as ckpt
from runtime import distributed as D
from runtime.arguments import Config
from runtime.build import Components, build_components, warm_up, with_loaders
from runtime.evaluation_report import explain_scores, write_case_scores
from runtime.run_files import BACKEND, EVAL, resumed_log_name
from runtime.run_log import MetricsWriter, MLPerfLogger
from runtime.host_memory import reuse_freed_memory
from runtime.outputs import (OutputError, RunLock, check_output_dir, check_output_file, checkpoint_lock,
                             move_previous_run, remove_if_empty)
from runtime.predict.body import predict_body, predict_source
from runtime.progress import make_progress
from runtime.resolve import resolve, resolve_data, window_line
from runtime.signals import PreemptionFlag
from runtime.training.loop import (Reporters, abort_clock_on_error, run_evaluation, run_training, start_clock)


@dataclass(frozen=True)
class Output:
    """A path a mode writes: a folder (its lock file inside) or, ``is_file``, one file (a lock
    file beside it)."""

    path: str
    flag: str
    is_file: bool = False

    def check(self) -> str | None:
        """Create/prove writable; the outermost folder created (see ``remove_if_empty``)."""
        return check_output_file(self.path, self.flag) if self.is_file else check_output_dir(self.path, self.flag)

    def folder(self) -> str:
        return os.path.dirname(os.path.abspath(self.path)) if self.is_file else self.path

    def lock(self, enabled: bool) -> RunLock:
        if self.is_file:
            return checkpoint_lock(self.path, enabled=enabled)
        return RunLock(self.path, enabled=enabled, flag=self.flag)


@dataclass
class Session:
    """What a mode's body gets from the lifecycle."""

    config: Config  # as parsed: the body resolves it (runtime.resolve)
    dist: D.DistInfo
    preempt: PreemptionFlag
    source: object  # the data source (train, evaluate, benchmark) or the scans (predict)
    on_exit: ExitStack  # callbacks run at teardown, before the locks are released


@dataclass(frozen=True)
class Mode:
    body: Callable[[Session], int]
    outputs: Callable[[Config], list[Output]] = lambda config: []
    stop_at_once: bool = True  # a signal stops the run now (outputs are atomic); False: at the next step
    # checks and inputs that need no process group: (config, data given by the caller) -> source
    source: Callable[[Config, object], object] = lambda config, data: data
    reuses_memory: Callable[[Config], bool] = lambda config: False


def mode_name(config: Config) -> str:
    return "benchmark" if config.benchmark and config.exec_mode != "predict" else config.exec_mode


def run(config: Config, data=None) -> int:
    """Run ``config``'s mode; returns the exit code. ``data``: the data source (default:
    ``data_loading.data_loader.data_source(config)``; tests pass their own)."""
    mode = MODES[mode_name(config)]
    if mode.reuses_memory(config):  # measured there (docs/performance.md)
        why_not = reuse_freed_memory()
        if why_not and config.verbose:
            print(f"host memory: freed blocks go back to the system ({why_not})")
    outputs = mode.outputs(config)
    made = [(output.folder(), output.check()) for output in outputs]
    graceful = False
    try:
        code = run_in_process_group(config, mode, outputs, mode.source(config, data))
        graceful = True
        return code
    finally:
        if not graceful:  # a refused run leaves no empty folder behind
            for folder, created in made:
                remove_if_empty(folder, created)


def run_in_process_group(config: Config, mode: Mode, outputs: list[Output], source) -> int:
    dist_info = D.init_distributed(config.device, config.local_rank)
    preempt = PreemptionFlag(interrupt=mode.stop_at_once).install()
    graceful = True
    try:
        with ExitStack() as on_exit:
            for output in outputs:
                on_exit.callback(take_lock(output.lock(dist_info.is_main), dist_info).release)
            return mode.body(Session(config, dist_info, preempt, source, on_exit))
    except BaseException:
        graceful = False
        raise
    finally:
        preempt.restore()
        D.cleanup(graceful)


def take_lock(lock: RunLock, dist_info: D.DistInfo) -> RunLock:
    """``lock`` acquired on rank 0; every rank learns the outcome (a refusal is every rank's
    error, not a hang of the others at their next collective)."""
    problem = None
    try:
        lock.acquire()
    except OutputError as exc:
        problem = exc
    if not D.broadcast_int(int(problem is None), dist_info.device):
        raise problem or OutputError(f"{lock.flag} {lock.subject!r} is used by another run (rank 0 says why)")
    return lock


# ------------------------------------------------------------------ train, evaluate, benchmark

# A run whose checkpoint says it reached the target or stopped for good: resuming it would train
# past its end (a job requeued just as it succeeded, a scheduler's retry).
ENDED_STATUSES = ("success", "aborted")


def already_ended(saved: ckpt.Saved | None) -> str | None:
    """The one line to print when ``--resume`` finds a run that has ended, else None."""
    if saved is None or not saved.resume or saved.checkpoint.get("status") not in ENDED_STATUSES:
        return None
    return (f"--resume: the run in {saved.path} already ended ({saved.checkpoint['status']} at epoch "
            f"{saved.checkpoint.get('epoch')}); nothing to resume")


def starting_point(config: Config, dist_info: D.DistInfo) -> ckpt.Saved | None:
    saved = ckpt.saved_for(config)
    if config.resume and (saved is None or not saved.resume) and dist_info.is_main:
        print(f"--resume: no checkpoint at {config.save_ckpt_path} yet, starting a new run")
    return saved


def make_reporters(config: Config, dist_info: D.DistInfo, resuming: bool, preempt: PreemptionFlag,
                   saved: ckpt.Saved | None = None) -> Reporters:
    """The run's reporters (rank 0 writes). A new training run first moves the last run's files in
    ``--log_dir`` and its ``--save_ckpt_path`` out of the way (``move_previous_run``: one folder
    holds one run; nothing deleted, said in one line each); a resumed attempt (``saved``, the
    checkpoint it starts from) writes an MLPerf log of its own. The attempt's log then says when
    it is not an MLPerf result: resumed from a checkpoint, or checkpoints written on the clock."""
    main = dist_info.is_main
    mlperf_on = main and config.is_train and not config.benchmark
    name = resumed_log_name() if resuming else None
    if config.is_train and not config.benchmark and not resuming:
        if config.load_ckpt_path:  # every rank has read it (it may be --save_ckpt_path) before it moves
            D.barrier()
        if main:
            for line in move_previous_run(config.log_dir, config.save_ckpt_path):
                print(line)
    curves = None
    if config.plot and mlperf_on:
        from runtime.report.plotter import CurvePlotter

        curves = CurvePlotter(config.log_dir, config.quality_threshold)
    mlperf = MLPerfLogger(config.log_dir, enabled=mlperf_on, name=name)
    resumed_from = None
    if saved is not None and config.is_train:  # --resume, or a warm start from --load_ckpt_path's weights
        resumed_from = (saved.path, int(saved.checkpoint.get("epoch", 0) or 0),
                        int(saved.checkpoint.get("step_in_epoch", 0) or 0) if saved.resume else 0)
    mlperf.not_a_result(resumed_from, config.save_ckpt_path if config.checkpoints_on_the_clock else "",
                        weights_only=saved is not None and not saved.resume)
    if main and config.checkpoints_on_the_clock:
        print(f"checkpoints on the clock: {config.save_ckpt_path} is written during the run "
              "(--ckpt_during_run or --ckpt_every_epochs), so this run is not an MLPerf result")
    return Reporters(
        mlperf=mlperf,
        metrics=MetricsWriter(config.log_dir, enabled=main and not config.benchmark),
        progress=make_progress(config, main), preempt=preempt, is_main=main, curves=curves)


def close_reporters(out: Reporters) -> None:
    out.mlperf.close()
    if out.curves is not None:
        out.curves.close(timeout=60)


def start_run(session: Session, saved: ckpt.Saved | None) -> tuple[Reporters, Components]:
    """The run up to its first step, around the MLPerf clock: ``(reporters, components)``.

    Before ``run_start`` nothing lists, opens, maps or uploads a file of the data: the config
    resolved without it, the reporters opened, ``init_start``, the model, optimizer and train
    step built from ``saved`` (the checkpoint started from, or None) and, where its first steps
    compile, warmed up on zeros (``build.warm_up``), ``init_stop``. After
    ``run_start``: the data listed and checked (``summary``), the values that need it resolved
    (``resolve_data``), this rank's loaders built (labels read, volumes checked, the device
    cache filled). An error from then on ends the MLPerf log with ``run_stop`` aborted."""
    from data_loading.data_loader import data_source

    config = resolve(session.config, session.dist, None, saved)
    out = make_reporters(config, session.dist, saved is not None and saved.resume, session.preempt, saved=saved)
    session.on_exit.callback(close_reporters, out)
    out.mlperf.submission_info(config)
    out.mlperf.start(C.INIT_START)
    components = build_components(config, session.dist, None, saved)
    out.mlperf.weights_initialization(config)
    if saved is not None and saved.resume:
        state = components.state
        out.say(f"resuming {saved.path} after epoch {state.epoch}"
                + (f" + {state.step_in_epoch} batches" if state.step_in_epoch else ""))
    warm_up(components)  # compiled before the clock, on zeros (build.compiles_lazily)
    session.on_exit.push(abort_clock_on_error(out, components.state))
    start_clock(out)
    # -- the clock runs: the data from here on
    data = session.source if session.source is not None else data_source(session.config)
    config = resolve_data(components.config, session.dist, data.summary(components.config))
    out.mlperf.not_closed(config.division_not_closed)  # its log said closed; the data is not KiTS19's
    return out, with_loaders(components, data, config)


def started(session: Session) -> tuple[tuple[Reporters, Components] | None, ckpt.Saved | None]:
    """The run's reporters and components, or None when ``--resume`` finds an ended run."""
    saved = starting_point(session.config, session.dist)
    ended = already_ended(saved)
    if ended:
        if session.dist.is_main:
            print(ended)
        return None, saved
    return start_run(session, saved), saved


def train_body(session: Session) -> int:
    parts, _ = started(session)
    if parts is None:
        return 0
    out, components = parts
    return run_training(components, out)


def benchmark_body(session: Session) -> int:
    from runtime.training.benchmark import benchmark_evaluate, benchmark_train

    parts, _ = started(session)
    if parts is None:
        return 0
    out, components = parts
    (benchmark_evaluate if session.config.exec_mode == "evaluate" else benchmark_train)(components, out)
    return 0


def evaluate_body(session: Session) -> int:
    from runtime.inference.backends import evaluation_components

    parts, saved = started(session)
    if parts is None:
        return 0
    out, components = parts
    components = evaluation_components(components, out)  # PyTorch or OpenVINO (resolved --backend)
    cases: list[dict] = []
    metrics = run_evaluation(components, out, epoch=0, cases=cases)
    cases = [case for part in D.all_gather_objects(cases) for case in part]
    # results first (stdout), then the files: a full disk loses no number
    out.say(f"mean_dice {metrics['mean_dice']:.4f}")
    out.say(f"l1_dice {metrics['l1_dice']:.4f}  l2_dice {metrics['l2_dice']:.4f}  "
            f"eval_loss {metrics['eval_loss']:.4f}  cases {metrics['eval_cases']}")
    if saved is not None:
        out.say(f"weights: {ckpt.weights_description(saved.checkpoint)} of {saved.path}")
    out.say(window_line(components.config))  # the benchmark's 128³ unless --val_input_shape
    out.say(f"backend: {components.config.backend_why}")  # PyTorch unless --backend asks for another
    for line in explain_scores(cases):
        out.say(line)
    out.metrics.write(BACKEND, backend=components.config.backend, why=components.config.backend_why)
    out.metrics.write(EVAL, epoch=0, checkpoint=components.config.load_ckpt_path, **metrics)
    if out.is_main:
        out.say(f"per-case Dice: {write_case_scores(components.config.log_dir, cases)}")
    return 0


def _log_dir(config: Config) -> list[Output]:
    return [Output(config.log_dir, "--log_dir")]


def _train_outputs(config: Config) -> list[Output]:
    return _log_dir(config) + ([Output(config.save_ckpt_path, "--save_ckpt_path", is_file=True)]
                               if config.save_ckpt_path else [])


def _trains_on_cpu(config: Config) -> bool:
    """Training on the CPU reuses freed host memory: every step's activations and gradients are
    the same large blocks again (docs/performance.md, "The fast CPU settings")."""
    return config.exec_mode == "train" and (
        config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()))


MODES: dict[str, Mode] = {
    # training saves a checkpoint at the next step when signalled
    "train": Mode(train_body, outputs=_train_outputs, stop_at_once=False, reuses_memory=_trains_on_cpu),
    "evaluate": Mode(evaluate_body, outputs=_log_dir, reuses_memory=lambda config: True),
    # --benchmark (train or evaluate): writes nothing
    "benchmark": Mode(benchmark_body, reuses_memory=lambda config: config.exec_mode == "evaluate"
                      or _trains_on_cpu(config)),
    "predict": Mode(predict_body, outputs=lambda config: [Output(config.output_dir, "--output_dir")],
                    source=predict_source, reuses_memory=lambda config: True),
}
