"""The start of a run that builds ``runtime.build``'s components (train, evaluate, ``--benchmark``):
the checkpoint it starts from, its reporters, and everything up to its first step around the
MLPerf clock (:func:`started`). Here, not in ``runtime.app``, because evaluate's body shares it
with training's and the lifecycle needs none of it; not in either product, so that neither
imports the other."""
from __future__ import annotations

from typing import Callable

from mlperf_logging.mllog import constants as C

from runtime import checkpoint as ckpt
from runtime import distributed as D
from runtime.build import Components, build_components, warm_up, with_loaders
from runtime.clocked.reporters import Reporters, abort_clock_on_error, start_clock
from runtime.host import record_run
from runtime.mode import Session
from runtime.outputs import move_previous_run
from runtime.plan import RunPlan
from runtime.progress import make_progress
from runtime.resolve import apply_host_memory, data_use, resolve, resolve_data
from runtime.run_files import resumed_log_name
from runtime.run_log import MetricsWriter, MLPerfLogger

# A run whose checkpoint says it reached the target or stopped for good: resuming it would train
# past its end (a job requeued just as it succeeded, a scheduler's retry).
ENDED_STATUSES = ("success", "aborted")


def already_ended(saved: ckpt.Saved | None) -> str | None:
    """The one line to print when ``--resume`` finds a run that has ended, else None."""
    if saved is None or not saved.resume or saved.checkpoint.get("status") not in ENDED_STATUSES:
        return None
    return (f"--resume: the run in {saved.path} already ended ({saved.checkpoint['status']} at epoch "
            f"{saved.checkpoint.get('epoch')}); nothing to resume")


def starting_point(session: Session) -> ckpt.Saved | None:
    """The checkpoint the session's run starts from (``runtime.checkpoint.saved_for`` its flags), or None."""
    config = session.config
    saved = ckpt.saved_for(config)
    if config.resume and (saved is None or not saved.resume) and session.dist.is_main:
        print(f"--resume: no checkpoint at {config.save_ckpt_path} yet, starting a new run")
    return saved


def make_reporters(session: Session, plan: RunPlan, saved: ckpt.Saved | None,
                   curves: Callable[[str, float], object] | None = None) -> Reporters:
    """The run's reporters (rank 0 writes), for ``plan`` (resolved) and ``saved`` (the checkpoint
    the run starts from, or None); ``curves(log_dir, quality_threshold)``: the plotter that
    ``--plot`` redraws ``curves.png`` with (training's), made on rank 0 of an MLPerf run. A new
    training run (``Mode.mlperf_run``) first moves the last run's files in ``--log_dir`` and its
    ``--save_ckpt_path`` out of the way
    (``move_previous_run``: one folder holds one run; nothing deleted, said in one line each); a
    resumed attempt writes an MLPerf log of its own. The attempt's log then says when it is not
    an MLPerf result: resumed from a checkpoint, or checkpoints written on the clock."""
    main, mode, flags = session.dist.is_main, session.mode, plan.config
    resuming = saved is not None and saved.resume
    mlperf_on = main and mode.mlperf_run
    name = resumed_log_name() if resuming else None
    if mode.mlperf_run and not resuming:
        if flags.load_ckpt_path:  # every rank has read it (it may be --save_ckpt_path) before it moves
            D.barrier()
        if main:
            for line in move_previous_run(flags.log_dir, flags.save_ckpt_path):
                print(line)
    plotter = curves(flags.log_dir, flags.quality_threshold) if curves and flags.plot and mlperf_on else None
    mlperf = MLPerfLogger(flags.log_dir, enabled=mlperf_on, name=name)
    resumed_from = None
    if saved is not None and mode.mlperf_run:  # --resume, or a warm start from --load_ckpt_path's weights
        resumed_from = (saved.path, int(saved.checkpoint.get("epoch", 0) or 0),
                        int(saved.checkpoint.get("step_in_epoch", 0) or 0) if saved.resume else 0)
    mlperf.not_a_result(resumed_from, flags.save_ckpt_path if flags.checkpoints_on_the_clock else "",
                        weights_only=saved is not None and not saved.resume)
    if main and flags.checkpoints_on_the_clock:
        print(f"checkpoints on the clock: {flags.save_ckpt_path} is written during the run "
              "(--ckpt_during_run or --ckpt_every_epochs), so this run is not an MLPerf result")
    return Reporters(
        mlperf=mlperf,
        metrics=MetricsWriter(flags.log_dir, enabled=main and mode.writes_metrics_for(flags)),
        progress=make_progress(flags.verbose, main), preempt=session.preempt, is_main=main, curves=plotter)


def close_reporters(out: Reporters) -> None:
    out.mlperf.close()
    if out.curves is not None:
        out.curves.close(timeout=60)


def start_run(session: Session, saved: ckpt.Saved | None,
              curves: Callable[[str, float], object] | None = None) -> tuple[Reporters, Components]:
    """The run up to its first step, around the MLPerf clock: ``(reporters, components)``.

    Before ``run_start`` nothing lists, opens, maps or uploads a case of the data: the config
    resolved with what the data says of itself (a described folder's ``dataset.json``: its
    labels, Dice and spacing, so that the network is built once, with its outputs; KiTS19's
    folder has none), the reporters opened, ``init_start``, the model, optimizer and train step
    built from ``saved`` (the checkpoint started from, or None) and, where its first steps
    compile, warmed up on zeros (``build.warm_up``), ``init_stop``. After ``run_start``: the
    data listed and checked (``summary``), the values that need it resolved (``resolve_data``),
    this rank's loaders built (labels read, volumes checked, the device cache filled). An error
    from then on ends the MLPerf log with ``run_stop`` aborted."""
    from data_loading.data_loader import data_source

    data = session.source if session.source is not None else data_source(session.config)
    plan = resolve(session.config, session.dist, None, saved, dataset=data.description())
    apply_host_memory(plan, session.config.verbose)
    out = make_reporters(session, plan, saved, curves)
    session.on_exit.callback(close_reporters, out)
    out.mlperf.submission_info(plan)
    if session.mode.mlperf_run and not (saved is not None and saved.resume):
        # what runs (runtime/host.py), before the clock
        record_run(session.recipe, session.config.log_dir, session.dist)
    out.mlperf.start(C.INIT_START)
    components = build_components(plan, session.dist, None, saved)
    out.mlperf.weights_initialization(plan.network)
    if saved is not None and saved.resume:
        state = components.state
        out.say(f"resuming {saved.path} after epoch {state.epoch}"
                + (f" + {state.step_in_epoch} batches" if state.step_in_epoch else ""))
    warm_up(components)  # compiled before the clock, on zeros (build.compiles_lazily)
    session.on_exit.push(abort_clock_on_error(out, components.state))
    start_clock(out)
    # -- the clock runs: the data from here on
    plan = resolve_data(components.plan, session.dist, data.summary(data_use(components.plan)))
    out.epoch_samples = (plan.training.samples_trained_per_epoch or 0) if plan.training is not None else 0
    not_closed = plan.decision("not_closed")  # its log said closed; the data is not KiTS19's
    if not_closed is not None:
        out.mlperf.not_closed(not_closed.value)
    return out, with_loaders(components, data, plan)


def started(session: Session, curves: Callable[[str, float], object] | None = None
            ) -> tuple[tuple[Reporters, Components] | None, ckpt.Saved | None]:
    """The run's reporters and components, or None when ``--resume`` finds an ended run;
    ``curves``: see :func:`make_reporters`."""
    saved = starting_point(session)
    ended = already_ended(saved)
    if ended:
        if session.dist.is_main:
            print(ended)
        return None, saved
    return start_run(session, saved, curves), saved
