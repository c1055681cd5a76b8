"""Build the components from the config, run the chosen mode, tear down."""
from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext
from functools import partial

import torch
from mlperf_logging.mllog import constants as C

from model.losses import DiceCELoss, DiceScore
from model.unet3d import Unet3D
from runtime import distributed as D
from runtime.arguments import Config, replace
from runtime.checkpoint import (CheckpointError, load_checkpoint, load_model_weights, model_state_from,
                                set_rng_state)
from runtime.logging import MetricsWriter, MLPerfLogger
from runtime.optimizers import make_optimizer
from runtime.schedule import eval_schedule
from runtime.signals import PreemptionFlag
from runtime.speed import compile_model
from runtime.training import Components, TrainState, benchmark_evaluate, benchmark_train, run_evaluation, train


class UsageError(RuntimeError):
    """A problem the user can fix (printed as one line, exit code 1)."""


def autocast_factory(config: Config, device: torch.device):
    """``() -> context`` for the configured mixed precision; the scaler only for CUDA fp16."""
    if not config.amp:
        return nullcontext, torch.amp.GradScaler(device.type, enabled=False)
    dtype_name = config.amp_dtype
    if dtype_name == "auto":
        dtype_name = "fp16" if device.type == "cuda" else "bf16"
    if dtype_name == "fp16" and device.type != "cuda":
        raise UsageError("--amp_dtype fp16 needs a GPU; use --amp_dtype bf16 on the CPU")
    dtype = torch.float16 if dtype_name == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    return partial(torch.autocast, device_type=device.type, dtype=dtype), scaler


def configure_backends(config: Config, device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = config.cudnn_benchmark
        torch.backends.cudnn.deterministic = config.cudnn_deterministic


def build_model(config: Config, device: torch.device) -> torch.nn.Module:
    model = Unet3D(1, 3, normalization=config.normalization, activation=config.activation,
                   filters=config.filters)
    if config.normalization == "syncbatchnorm" and D.is_dist():
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last_3d)
    return model


def make_progress(enabled: bool):
    if not enabled:
        return lambda it, **_: it
    from tqdm import tqdm

    return lambda it, desc=None, total=None: tqdm(it, desc=desc, total=total, leave=False, dynamic_ncols=True)


def restore(config: Config, components: Components, state: TrainState) -> tuple[TrainState, int | None]:
    """Continue from ``--save_ckpt_path`` (``--resume``) or warm-start from ``--load_ckpt_path``."""
    master_seed = None
    if config.resume and os.path.isfile(config.save_ckpt_path):
        ckpt = load_checkpoint(config.save_ckpt_path)
        if "optimizer_state_dict" not in ckpt or "epoch" not in ckpt:
            raise CheckpointError(f"checkpoint {config.save_ckpt_path!r} has no training state to resume")
        load_model_weights(components.model, model_state_from(ckpt, prefer="last"), config.save_ckpt_path)
        try:
            components.optimizer.load_state_dict(ckpt["optimizer_state_dict"])
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"optimizer state in {config.save_ckpt_path!r} does not fit "
                                  f"--optimizer {config.optimizer}: {exc}") from None
        if ckpt.get("scaler_state_dict"):
            components.scaler.load_state_dict(ckpt["scaler_state_dict"])
        if ckpt.get("rng"):
            set_rng_state(ckpt["rng"], components.dist.device)
        state = TrainState(epoch=int(ckpt["epoch"]), step_in_epoch=int(ckpt.get("step_in_epoch", 0)),
                           epoch_loss_sum=float(ckpt.get("epoch_loss_sum", 0.0)),
                           best_mean_dice=float(ckpt.get("best_mean_dice", -1.0)),
                           best_epoch=int(ckpt.get("best_epoch", 0)),
                           best_state=ckpt.get("best_model_state_dict"), last_eval=ckpt.get("last_eval"))
        master_seed = ckpt.get("master_seed")
        if components.dist.is_main:
            print(f"resuming {config.save_ckpt_path} after epoch {state.epoch}"
                  + (f" + {state.step_in_epoch} batches" if state.step_in_epoch else ""))
    elif config.resume and components.dist.is_main:
        print(f"--resume: no checkpoint at {config.save_ckpt_path} yet, starting a new run")
    if master_seed is None and config.load_ckpt_path and config.is_train:
        ckpt = load_checkpoint(config.load_ckpt_path)
        load_model_weights(components.model, model_state_from(ckpt, prefer="best"), config.load_ckpt_path)
    return state, master_seed


def run(config: Config) -> int:
    """Run ``config.exec_mode``; returns the process exit code."""
    if config.exec_mode == "predict":
        from runtime.predict import run_predict

        return run_predict(config)
    from data_loading.data_loader import get_data_loaders

    dist_info = D.init_distributed(config.device, config.local_rank)
    if config.normalization == "syncbatchnorm" and dist_info.device.type != "cuda" and D.is_dist():
        D.cleanup()
        raise UsageError("--normalization syncbatchnorm needs GPUs; use batchnorm on the CPU")
    preempt = PreemptionFlag().install()
    # A resumed run is a new attempt: its MLPerf log goes to a file of its own, since one log
    # may hold only one run_start/run_stop pair.
    resuming = config.resume and os.path.isfile(config.save_ckpt_path)
    mlperf = MLPerfLogger(config.log_dir, enabled=dist_info.is_main and config.is_train and not config.benchmark,
                          name=f"unet3d.resumed-{time.strftime('%Y%m%d-%H%M%S')}.log" if resuming else None)
    graceful = True
    try:
        mlperf.submission_info(config)
        mlperf.start(C.INIT_START)
        configure_backends(config, dist_info.device)
        master_seed = D.resolve_master_seed(config.seed, dist_info.device)
        torch.manual_seed(D.rank_seed(master_seed, dist_info.rank))
        model = build_model(config, dist_info.device)
        mlperf.weights_initialization(config)
        autocast, scaler = autocast_factory(config, dist_info.device)
        optimizer = make_optimizer(config.optimizer, model.parameters(), config.learning_rate,
                                   config.momentum, config.weight_decay, config.lamb_betas,
                                   fused=config.fused_optimizer)
        components = Components(
            config=config, dist=dist_info, model=model, optimizer=optimizer, scaler=scaler,
            loss_fn=DiceCELoss(to_onehot_y=True, use_softmax=True, layout=config.layout,
                               include_background=config.include_background),
            score_fn=DiceScore(to_onehot_y=True, use_argmax=True, layout=config.layout,
                               include_background=config.include_background),
            autocast=autocast, mlperf=mlperf,
            metrics=MetricsWriter(config.log_dir, enabled=dist_info.is_main and not config.benchmark),
            preempt=preempt, progress=make_progress(config.verbose and dist_info.is_main))
        if config.cuda_graphs:
            from runtime.graphs import cuda_graphs_supported

            ok, reason = cuda_graphs_supported(dist_info.device, config, dist_info.world_size)
            if not ok:
                if dist_info.is_main:
                    print(f"--cuda_graphs off: {reason}")
                config = replace(config, cuda_graphs=False)
                components.config = config
        state, resumed_seed = restore(config, components, TrainState())
        if resumed_seed is not None:
            master_seed = int(resumed_seed)
        config = replace(config, seed=master_seed)
        components.config = config
        if config.exec_mode == "evaluate" and config.load_ckpt_path:
            ckpt = load_checkpoint(config.load_ckpt_path)
            load_model_weights(model, model_state_from(ckpt, prefer="best"), config.load_ckpt_path)
        components.model = wrap_model(model, config, dist_info)
        components.eval_model = compile_model(model, config.compile) if D.is_dist() else components.model
        train_loader, val_loader = get_data_loaders(config, dist_info.world_size, dist_info.rank,
                                                    device=dist_info.device)
        if config.exec_mode == "evaluate":
            return run_evaluate(components, val_loader)
        if config.benchmark:
            benchmark_train(components, train_loader)
            return 0
        return run_train(components, train_loader, val_loader, state, master_seed)
    except BaseException:
        graceful = False
        raise
    finally:
        preempt.restore()
        mlperf.close()
        D.cleanup(graceful)


def wrap_model(model: torch.nn.Module, config: Config, dist_info: D.DistInfo) -> torch.nn.Module:
    if D.is_dist():
        ids = [dist_info.device.index] if dist_info.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return compile_model(model, config.compile)


def run_evaluate(c: Components, val_loader) -> int:
    if c.config.benchmark:
        benchmark_evaluate(c, val_loader)
        return 0
    metrics = run_evaluation(c, val_loader, epoch=0)
    c.metrics.write("eval", epoch=0, checkpoint=c.config.load_ckpt_path, **metrics)
    if c.dist.is_main:
        print(f"mean_dice {metrics['mean_dice']:.4f}")
        print(f"l1_dice {metrics['l1_dice']:.4f}  l2_dice {metrics['l2_dice']:.4f}  "
              f"eval_loss {metrics['eval_loss']:.4f}  cases {metrics['eval_cases']}")
    return 0


def run_train(c: Components, train_loader, val_loader, state: TrainState, master_seed: int) -> int:
    cfg, dist_info = c.config, c.dist
    spe = train_loader.samples_per_epoch
    schedule = eval_schedule(spe, train_loader.num_cases, cfg.start_eval_at, cfg.evaluate_every)
    c.mlperf.hyperparameters(cfg, dist_info.world_size, train_loader.num_cases, val_loader.num_cases, spe)
    c.mlperf.end(C.INIT_STOP)
    D.barrier()
    c.mlperf.start(C.RUN_START)
    run_start = time.time()
    if dist_info.is_main:
        print(f"training: {train_loader.num_cases} cases, {spe} samples/epoch, first eval at epoch "
              f"{schedule.start_eval_at}, then every {schedule.evaluate_every}; seed {master_seed}")
    result = train(c, train_loader, val_loader, schedule, state, master_seed)
    D.barrier()
    mlperf_status = "success" if result.status == "success" else "aborted"
    c.mlperf.end(C.RUN_STOP, metadata={"status": mlperf_status, "epoch_num": result.epoch})
    if dist_info.is_main:
        print(f"RESULT,image_segmentation,{master_seed},{time.time() - run_start:.1f},{result.status},"
              f"best_mean_dice={result.best_mean_dice:.4f},epochs={result.epoch}")
        sys.stdout.flush()
    if result.status == "preempted":
        return 0
    return 0 if result.status in ("success", "finished") else 3
