"""``--benchmark``: time training steps or sliding-window evaluations (no checkpoints, no
evaluation during training); statistics from :mod:`runtime.training.latency`."""
from __future__ import annotations

import sys
import time

import torch

from runtime.arguments import UsageError
from runtime.build import Components
from runtime.predictor import build_predictor, options_from
from runtime.sliding_window import sliding_window_inference
from runtime.training.latency import format_summary, latency_summary
from runtime.training.loop import Reporters, set_learning_rate, step_inputs


def _synchronizer(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def check_something_to_time(iterations: int, what: str, cfg) -> None:
    """A :class:`UsageError` before any work when ``--warmup_steps`` would leave no iteration
    timed (the benchmark would run to its end and then have no number)."""
    if iterations <= cfg.warmup_steps:
        raise UsageError(f"--benchmark: {what} x --epochs {cfg.epochs} = {iterations} iterations, none left to time "
                         f"after --warmup_steps {cfg.warmup_steps}; lower --warmup_steps or raise --epochs")


def benchmark_train(components: Components, out: Reporters) -> dict:
    """Time every training iteration after ``--warmup_steps`` (device-synchronised)."""
    cfg, loader = components.config, components.train_loader
    check_something_to_time(len(loader) * cfg.epochs, f"{len(loader)} batches per epoch", cfg)
    sync = _synchronizer(components.dist.device)
    set_learning_rate(components.optimizer, cfg.learning_rate)
    times, seen = [], 0
    components.model.train()
    for epoch in range(1, cfg.epochs + 1):
        loader.set_epoch(epoch)
        for image, label in loader:
            sync()
            tick = time.perf_counter()
            image, label = step_inputs(components, image, label)
            components.step(image, label, True, True)
            sync()
            seconds = time.perf_counter() - tick
            if seen >= cfg.warmup_steps:
                times.append(seconds)
            seen += 1
            out.say(f"{'warm-up' if seen <= cfg.warmup_steps else 'timed'} step {seen}: {seconds * 1e3:.1f} ms",
                    file=sys.stderr, flush=True)
    summary = latency_summary(times, cfg.batch_size * components.dist.world_size)
    out.say(format_summary("throughput_train", summary, "samples"))
    return summary


def benchmark_evaluate(components: Components, out: Reporters) -> dict:
    """Time the sliding-window evaluation of each volume after ``--warmup_steps`` volumes."""
    cfg, dev, loader = components.config, components.dist.device, components.val_loader
    check_something_to_time(len(loader) * cfg.epochs, f"{len(loader)} evaluation volumes", cfg)
    sync = _synchronizer(dev)
    components.eval_model.eval()
    predict = build_predictor(components.eval_model, dev, options_from(cfg))
    times, seen = [], 0
    with torch.no_grad():
        for _ in range(cfg.epochs):
            for image, _label, _case in out.progress(loader, desc="benchmark eval volumes", total=len(loader),
                                                     always=True):
                sync()
                tick = time.perf_counter()
                sliding_window_inference(predict, image.to(dev), cfg.val_input_shape, cfg.overlap,
                                         cfg.sw_batch_size)
                sync()
                if seen >= cfg.warmup_steps:
                    times.append(time.perf_counter() - tick)
                seen += 1
    summary = latency_summary(times, components.dist.world_size)
    out.say(format_summary("throughput_eval", summary, "volumes"))
    return summary
