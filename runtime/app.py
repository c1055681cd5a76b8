"""One lifecycle for every exec mode.

:func:`run` checks the mode's outputs, starts the process group, installs the signal handlers,
locks the outputs (rank 0 holds the locks, every rank learns the outcome), runs the mode's body
(which resolves the config once and builds what it computes with) and tears everything down in
reverse order; a run refused before it wrote anything leaves no empty folder behind.

A mode is one entry of :data:`MODES` (:class:`Mode`): the outputs it writes, whether a signal
stops it at once (nothing to save) or at the next step (training saves), what it checks before
the process group starts, what the shared start of a run asks of it (:mod:`runtime.mode`), and
its body, in its product's folder. docs/development.md: "An exec mode".
"""
from __future__ import annotations

from contextlib import ExitStack

from runtime import distributed as D
from runtime.arguments import Config
from runtime.evaluate.body import evaluate_body
from runtime.mode import Mode, Output, Session
from runtime.outputs import OutputError, RunLock, remove_if_empty
from runtime.predict.body import predict_body, predict_source
from runtime.signals import PreemptionFlag
from runtime.training.bodies import benchmark_body, train_body


def mode_name(config: Config) -> str:
    return "benchmark" if config.benchmark and config.exec_mode != "predict" else config.exec_mode


def run(config: Config, data=None) -> int:
    """Run ``config``'s mode; returns the exit code. ``data``: the data source (default:
    ``data_loading.data_loader.data_source(config)``; tests pass their own)."""
    mode = MODES[mode_name(config)]
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
            return mode.body(Session(config, dist_info, preempt, source, on_exit, mode))
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


def _log_dir(config: Config) -> list[Output]:
    return [Output(config.log_dir, "--log_dir")]


def _train_outputs(config: Config) -> list[Output]:
    return _log_dir(config) + ([Output(config.save_ckpt_path, "--save_ckpt_path", is_file=True)]
                               if config.save_ckpt_path else [])


def _benchmark_outputs(config: Config) -> list[Output]:
    return _log_dir(config) if "log_dir" in config.explicit else []


MODES: dict[str, Mode] = {
    # training saves a checkpoint at the next step when signalled
    "train": Mode(train_body, outputs=_train_outputs, stop_at_once=False,
                  mlperf_run=True, writes_metrics=True),
    "evaluate": Mode(evaluate_body, outputs=_log_dir, writes_metrics=True),
    # --benchmark (train or evaluate): writes nothing, but log.json's benchmark record where
    # --log_dir is given (the reference's --benchmark writes its throughput to <log_dir>/log.json)
    "benchmark": Mode(benchmark_body, outputs=_benchmark_outputs, writes_metrics=True),
    "predict": Mode(predict_body, outputs=lambda config: [Output(config.output_dir, "--output_dir")],
                    source=predict_source),
}
