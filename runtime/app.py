"""Run a parsed config: check the outputs, start the process group, resolve, build, run the
chosen mode, tear down."""
from __future__ import annotations

import os
import sys
import time

from mlperf_logging.mllog import constants as C

from runtime import checkpoint as ckpt
from runtime import distributed as D
from runtime.arguments import Config
from runtime.backend import evaluation_components
from runtime.benchmark import benchmark_evaluate, benchmark_train
from runtime.build import Components, build_components
from runtime.memory import reuse_freed_memory
from runtime.run_files import BACKEND, EVAL, METRICS_LOG, MLPERF_LOG, RESULT, resumed_log_name
from runtime.run_log import MetricsWriter, MLPerfLogger
from runtime.evaluation_report import explain_scores, write_case_scores
from runtime.outputs import (RunLock, check_output_dir, check_output_file, checkpoint_lock, keep_previous,
                             remove_if_empty)
from runtime.progress import make_progress
from runtime.resolve import resolve
from runtime.signals import PreemptionFlag
from runtime.training import Reporters, run_evaluation, train


def writes_outputs(config: Config) -> bool:
    """Benchmarks write nothing; training and evaluation write ``--log_dir``."""
    return not config.benchmark


def check_outputs(config: Config) -> list[tuple[str, str | None]]:
    """Every output path, before any data is read or any MLPerf event is logged; returns
    ``(folder, outermost folder created)`` pairs for :func:`remove_if_empty`."""
    if not writes_outputs(config):
        return []
    made = [(config.log_dir, check_output_dir(config.log_dir, "--log_dir"))]
    if config.is_train and config.save_ckpt_path:
        folder = os.path.dirname(os.path.abspath(config.save_ckpt_path))
        made.append((folder, check_output_file(config.save_ckpt_path, "--save_ckpt_path")))
    return made


def output_locks(config: Config, dist_info: D.DistInfo) -> list[RunLock]:
    """One run at a time per ``--log_dir`` and per ``--save_ckpt_path`` (rank 0 holds them)."""
    mine = dist_info.is_main and writes_outputs(config)
    return [RunLock(config.log_dir, enabled=mine),
            checkpoint_lock(config.save_ckpt_path, enabled=mine and config.is_train)]


# A run whose checkpoint says it reached the target or stopped for good: resuming it would train
# past its end (a job requeued just as it succeeded, a scheduler's retry).
ENDED_STATUSES = ("success", "aborted")


def starting_point(config: Config, dist_info: D.DistInfo) -> ckpt.Saved | None:
    saved = ckpt.saved_for(config)
    if config.resume and (saved is None or not saved.resume) and dist_info.is_main:
        print(f"--resume: no checkpoint at {config.save_ckpt_path} yet, starting a new run")
    return saved


def already_ended(saved: ckpt.Saved | None) -> str | None:
    """The one line to print when ``--resume`` finds a run that has ended, else None."""
    if saved is None or not saved.resume or saved.checkpoint.get("status") not in ENDED_STATUSES:
        return None
    return (f"--resume: the run in {saved.path} already ended ({saved.checkpoint['status']} at epoch "
            f"{saved.checkpoint.get('epoch')}); nothing to resume")


def make_reporters(config: Config, dist_info: D.DistInfo, resuming: bool, preempt: PreemptionFlag) -> Reporters:
    main = dist_info.is_main
    mlperf_on = main and config.is_train and not config.benchmark
    # One MLPerf log holds one run: a resumed run (a new attempt) writes a file of its own, and
    # a new run keeps the previous log under another name.
    name = resumed_log_name() if resuming else None
    if mlperf_on and not resuming:
        for log_name in (MLPERF_LOG, METRICS_LOG):
            kept = keep_previous(os.path.join(config.log_dir, log_name))
            if kept:
                print(f"kept the previous run's {log_name} as {kept}")
    curves = None
    if config.plot and mlperf_on:
        from runtime.report.plotter import CurvePlotter

        curves = CurvePlotter(config.log_dir, config.quality_threshold)
    return Reporters(
        mlperf=MLPerfLogger(config.log_dir, enabled=mlperf_on, name=name),
        metrics=MetricsWriter(config.log_dir, enabled=main and writes_outputs(config)),
        progress=make_progress(config, main), preempt=preempt, is_main=main, curves=curves)


def run(config: Config, data=None) -> int:
    """Run ``config.exec_mode``; returns the process exit code. ``data``: the data source
    (default: ``data_loading.data_loader.data_source(config)``; tests pass their own)."""
    if config.exec_mode in ("evaluate", "predict"):  # measured there (docs/performance.md)
        why_not = reuse_freed_memory()
        if why_not and config.verbose:
            print(f"host memory: freed blocks go back to the system ({why_not})")
    if config.exec_mode == "predict":
        from runtime.predict_folder import run_predict

        return run_predict(config)
    made = check_outputs(config)
    dist_info = D.init_distributed(config.device, config.local_rank)
    # Training saves at the next step; evaluation and benchmarks have nothing to save and stop now.
    preempt = PreemptionFlag(interrupt=not config.is_train or config.benchmark).install()
    locks = output_locks(config, dist_info)
    out, graceful = None, True
    try:
        for lock in locks:
            lock.acquire()
        saved = starting_point(config, dist_info)
        if already_ended(saved):
            if dist_info.is_main:
                print(already_ended(saved))
            return 0
        out, components = start_run(config, dist_info, data, preempt, saved)
        if config.exec_mode == "evaluate":
            return run_evaluate(components, out, saved)
        if config.benchmark:
            benchmark_train(components, out)
            return 0
        return run_train(components, out)
    except BaseException:
        graceful = False
        raise
    finally:
        preempt.restore()
        if out is not None:
            out.mlperf.close()
            if out.curves is not None:
                out.curves.close(timeout=60)
        for lock in locks:
            lock.release()
        if not graceful:  # a refused run leaves no empty folder behind
            for folder, created in made:
                remove_if_empty(folder, created)
        D.cleanup(graceful)


def start_run(config: Config, dist_info: D.DistInfo, data, preempt: PreemptionFlag,
              saved: ckpt.Saved | None):
    """Read the data, resolve, open the reporters, build the components from ``saved`` (the
    checkpoint started from, or None): ``(reporters, components)``."""
    from data_loading.data_loader import data_source

    data = data if data is not None else data_source(config)
    config = resolve(config, dist_info, data, saved)
    out = make_reporters(config, dist_info, saved is not None and saved.resume, preempt)
    out.mlperf.submission_info(config)
    out.mlperf.start(C.INIT_START)
    components = build_components(config, dist_info, data, saved)
    out.mlperf.weights_initialization(config)
    if saved is not None and saved.resume:
        state = components.state
        out.say(f"resuming {saved.path} after epoch {state.epoch}"
                + (f" + {state.step_in_epoch} batches" if state.step_in_epoch else ""))
    return out, components


def run_evaluate(components: Components, out: Reporters, saved: ckpt.Saved | None) -> int:
    if components.config.benchmark:
        benchmark_evaluate(components, out)
        return 0
    components, backend = evaluation_components(components, out)  # PyTorch or OpenVINO (--backend)
    cases: list[dict] = []
    metrics = run_evaluation(components, out, epoch=0, cases=cases)
    cases = [c for part in D.all_gather_objects(cases) for c in part]
    # results first (stdout), then the files: a full disk loses no number
    out.say(f"mean_dice {metrics['mean_dice']:.4f}")
    out.say(f"l1_dice {metrics['l1_dice']:.4f}  l2_dice {metrics['l2_dice']:.4f}  "
            f"eval_loss {metrics['eval_loss']:.4f}  cases {metrics['eval_cases']}")
    if saved is not None:
        out.say(f"weights: {ckpt.weights_description(saved.checkpoint)} of {saved.path}")
    for line in explain_scores(cases):
        out.say(line)
    out.metrics.write(BACKEND, backend=backend.backend, why=backend.why)
    out.metrics.write(EVAL, epoch=0, checkpoint=components.config.load_ckpt_path, **metrics)
    if out.is_main:
        path = write_case_scores(components.config.log_dir, cases)
        out.say(f"per-case Dice: {path}")
    return 0


def run_train(components: Components, out: Reporters) -> int:
    cfg = components.config
    out.mlperf.hyperparameters(cfg, components.dist.world_size)
    out.mlperf.end(C.INIT_STOP)
    D.barrier()
    out.mlperf.start(C.RUN_START)
    run_start = time.time()
    out.say(f"training: {cfg.num_train_cases} cases, {cfg.samples_per_epoch} samples/epoch, first eval at epoch "
            f"{cfg.start_eval_at}, then every {cfg.evaluate_every}; seed {cfg.seed}")
    result = train(components, out)
    D.barrier()
    mlperf_status = "success" if result.status == "success" else "aborted"
    out.mlperf.end(C.RUN_STOP, metadata={"status": mlperf_status, "epoch_num": result.epoch})
    # MLPerf knows success and aborted only; the report tells a run that ran its --epochs apart
    out.metrics.write(RESULT, status=result.status, epoch=result.epoch, epochs=cfg.epochs)
    out.say(f"RESULT,image_segmentation,{cfg.seed},{time.time() - run_start:.1f},{result.status},"
            f"best_mean_dice={result.best_mean_dice:.4f},epochs={result.epoch}")
    sys.stdout.flush()
    if result.status == "preempted":
        # Saved: a requeued job resumes (exit 0). Nothing to resume from: say it with the exit code.
        return 0 if cfg.save_ckpt_path else 128 + (out.preempt.number or 15)
    return 0 if result.status in ("success", "finished") else 3
