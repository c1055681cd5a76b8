"""Run a parsed config: start the process group, resolve, build, run the chosen mode, tear down."""
from __future__ import annotations

import os
import sys
import time

from mlperf_logging.mllog import constants as C

from runtime import checkpoint as ckpt
from runtime import distributed as D
from runtime.arguments import Config
from runtime.benchmark import benchmark_evaluate, benchmark_train
from runtime.build import Components, build_components
from runtime.logging import MetricsWriter, MLPerfLogger
from runtime.resolve import resolve
from runtime.signals import PreemptionFlag
from runtime.training import Reporters, run_evaluation, train


def make_progress(enabled: bool):
    if not enabled:
        return lambda it, **_: it
    from tqdm import tqdm

    return lambda it, desc=None, total=None: tqdm(it, desc=desc, total=total, leave=False, dynamic_ncols=True)


def resume_checkpoint(config: Config, dist_info: D.DistInfo) -> dict | None:
    """The saved run ``--resume`` continues, or None (with a note when there is none yet)."""
    if not config.resume:
        return None
    if os.path.isfile(config.save_ckpt_path):
        return ckpt.load_checkpoint(config.save_ckpt_path)
    if dist_info.is_main:
        print(f"--resume: no checkpoint at {config.save_ckpt_path} yet, starting a new run")
    return None


def make_reporters(config: Config, dist_info: D.DistInfo, resuming: bool, preempt: PreemptionFlag) -> Reporters:
    main = dist_info.is_main
    # A resumed run is a new attempt: its MLPerf log goes to a file of its own, since one log
    # may hold only one run_start/run_stop pair.
    name = f"unet3d.resumed-{time.strftime('%Y%m%d-%H%M%S')}.log" if resuming else None
    return Reporters(
        mlperf=MLPerfLogger(config.log_dir, enabled=main and config.is_train and not config.benchmark, name=name),
        metrics=MetricsWriter(config.log_dir, enabled=main and not config.benchmark),
        progress=make_progress(config.verbose and main), preempt=preempt, is_main=main)


def run(config: Config, data=None) -> int:
    """Run ``config.exec_mode``; returns the process exit code. ``data``: the data source
    (default: ``data_loading.data_loader.data_source(config)``; tests pass their own)."""
    from data_loading.data_loader import data_source

    dist_info = D.init_distributed(config.device, config.local_rank)
    preempt = PreemptionFlag().install()
    out, graceful = None, True
    try:
        data = data if data is not None else data_source(config)
        saved = resume_checkpoint(config, dist_info)
        config = resolve(config, dist_info, data, saved)
        out = make_reporters(config, dist_info, saved is not None, preempt)
        out.mlperf.submission_info(config)
        out.mlperf.start(C.INIT_START)
        components = build_components(config, dist_info, data, saved)
        out.mlperf.weights_initialization(config)
        if saved is not None:
            state = components.state
            out.say(f"resuming {config.save_ckpt_path} after epoch {state.epoch}"
                    + (f" + {state.step_in_epoch} batches" if state.step_in_epoch else ""))
        if config.exec_mode == "evaluate":
            return run_evaluate(components, out)
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
        D.cleanup(graceful)


def run_evaluate(components: Components, out: Reporters) -> int:
    if components.config.benchmark:
        benchmark_evaluate(components, out)
        return 0
    metrics = run_evaluation(components, out, epoch=0)
    out.metrics.write("eval", epoch=0, checkpoint=components.config.load_ckpt_path, **metrics)
    out.say(f"mean_dice {metrics['mean_dice']:.4f}")
    out.say(f"l1_dice {metrics['l1_dice']:.4f}  l2_dice {metrics['l2_dice']:.4f}  "
            f"eval_loss {metrics['eval_loss']:.4f}  cases {metrics['eval_cases']}")
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
    out.say(f"RESULT,image_segmentation,{cfg.seed},{time.time() - run_start:.1f},{result.status},"
            f"best_mean_dice={result.best_mean_dice:.4f},epochs={result.epoch}")
    sys.stdout.flush()
    return 0 if result.status in ("success", "finished", "preempted") else 3
