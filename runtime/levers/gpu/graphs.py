"""The whole training step (forward, loss, backward, optimizer step) captured in one CUDA graph.

Why: an eager step of the 3-D U-Net launches several hundred kernels (convolutions, norms,
activations, their backward, one optimizer kernel per tensor group); a graph replays them with
one launch and no Python in between. At batch >= 2 of 128³ the GPU work per kernel is large, so
the gain is small there; it grows with small patches, small batches and fast GPUs.

How (the pattern of the PyTorch CUDA-graphs notes): a few warm-up steps on a side stream (lazy
initialisation, cuDNN autotuning, optimizer state creation), gradients set to None, then one
captured step. Replays read the inputs from static buffers, so ``__call__`` copies each batch in.
The warm-up steps change weights and optimizer state, so both are saved before and put back
after the capture: replay number n gives the same weights as eager step number n.

Limits, checked by :func:`cuda_graphs_supported` so the runtime can fall back to the eager step:

* a CUDA GPU (not the CPU; ROCm's HIP graphs are not tried: untested here);
* no dynamic loss scaling: fp16 autocast needs the GradScaler, which checks the gradients for
  inf/NaN on the host every step; use ``--amp_dtype bf16`` (or fp32) with graphs;
* ``--ga_steps 1`` and world size 1 (no DDP gradient hooks in the graph);
* ``torch.optim.SGD`` or ``Adam``: the captured step reads the learning rate from a device
  tensor. SGD is captured with its fused kernel (the one that accepts a tensor lr), Adam with
  ``capturable=True``; the flags are set for the capture and put back afterwards (the replayed
  graph does not read them). This repo's LAMB takes the lr as a Python number and is refused;
* static shapes and dtypes: every batch must match the example batch (the loaders drop
  incomplete batches).

Learning rate: set it as usual (``group["lr"] = value``, e.g. ``set_learning_rate``); each call
compares the groups' values with the last ones written and refreshes the device tensor (an
asynchronous fill, no host sync) when one changed.
"""
from __future__ import annotations

import inspect
import itertools
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
from torch import nn

from runtime.distributed import is_dist


def _sgd_has_fused() -> bool:
    return "fused" in inspect.signature(torch.optim.SGD.__init__).parameters


def cuda_graphs_supported(device: torch.device, config, world_size: int | None = None) -> tuple[bool, str]:
    """``(True, "ok")`` when :class:`GraphedTrainStep` can run ``config`` (its AMP type resolved
    by ``runtime.resolve``) on ``device``, else
    ``(False, reason)`` with a one-line reason for the user; the caller keeps the eager step."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"CUDA graphs need a CUDA GPU; the device is {device.type}"
    if getattr(torch.version, "hip", None):
        return False, "capturing this step in a HIP graph is untested on ROCm"
    if not hasattr(torch.cuda, "graph") or not _sgd_has_fused():
        return False, f"torch {torch.__version__} lacks torch.cuda.graph or the fused SGD kernel"
    if config.ga_steps > 1:
        return False, "gradient accumulation (--ga_steps > 1) is not captured; use --ga_steps 1"
    if (world_size or 1) > 1 or is_dist():
        return False, "DDP's gradient all-reduce is not captured here; graphs run at world size 1 only"
    if config.amp and config.amp_dtype in ("fp16", "auto"):  # resolved: auto is fp16 on CUDA
        return False, ("fp16 needs the GradScaler, whose dynamic loss scale is checked on the host "
                       "every step; use --amp_dtype bf16 with --cuda_graphs")
    if config.optimizer not in ("sgd", "adam"):
        return False, f"--optimizer {config.optimizer} takes its learning rate as a Python number; use sgd or adam"
    return True, "ok"


# --------------------------------------------------------------------------------------------
# optimizer and model state around the capture

def _graph_safe_autocast(autocast: Callable[[], object]):
    """The configured autocast context, without its weight-cast cache (a cached cast made during
    capture would be reused from the graph's memory after the graph freed it: the PyTorch notes
    require ``cache_enabled=False`` inside a capture)."""
    ctx = autocast()
    if isinstance(ctx, torch.autocast) and ctx._enabled:
        return torch.autocast(device_type=ctx.device, dtype=ctx.fast_dtype, cache_enabled=False)
    return ctx


@contextmanager
def capturable_optimizer(optimizer: torch.optim.Optimizer, device: torch.device):
    """Switch ``optimizer`` to a step that CUDA graphs can capture; yields one 0-d float32 lr
    tensor per param group (on ``device``) that the captured kernels read.

    SGD: the fused kernel, which takes a tensor lr (the foreach and per-tensor paths turn a
    tensor lr into a Python number). Adam: ``capturable=True`` (device-side step counts).
    On exit the groups' flags and float learning rates are put back: the captured graph holds
    the tensors' addresses and no longer looks at the groups, and the optimizer's state_dict
    stays the same as an eager run's.
    """
    if isinstance(optimizer, torch.optim.SGD):
        for group in optimizer.param_groups:
            if group["momentum"] and group["dampening"]:
                raise ValueError("SGD with dampening cannot be graphed here: its first step "
                                 "differs from the later ones (buf = grad)")
        switch = {"fused": True, "foreach": False}
    elif isinstance(optimizer, torch.optim.Adam):
        switch = {"capturable": True}
        for state in optimizer.state.values():  # steps created by a non-capturable run live on the CPU
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].to(device)
    else:
        raise ValueError(f"{type(optimizer).__name__} cannot be captured; use SGD or Adam")
    saved = [{key: group.get(key) for key in (*switch, "lr")} for group in optimizer.param_groups]
    lrs = [torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
           for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, lrs):
        group.update(switch, lr=lr)
    try:
        yield lrs
    finally:
        for group, values in zip(optimizer.param_groups, saved):
            group.update(values)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Copies of the weights, buffers and optimizer state tensors, to undo the warm-up steps."""
    return {
        "model": [t.detach().clone() for t in itertools.chain(model.parameters(), model.buffers())],
        "optimizer": {p: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                          for k, v in state.items()}
                      for p, state in optimizer.state.items()},
    }


@torch.no_grad()
def restore_snapshot(saved: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write ``saved`` back in place (the graph holds these tensors' addresses).

    Optimizer state that did not exist before the warm-up is zeroed, which is the fresh state:
    Adam starts from zero moments and step 0; SGD (no dampening) from a zero momentum buffer,
    for which ``buf = momentum·0 + grad`` equals the first step's ``buf = grad``.
    """
    for tensor, value in zip(itertools.chain(model.parameters(), model.buffers()), saved["model"]):
        tensor.copy_(value)
    for p, state in optimizer.state.items():
        before = saved["optimizer"].get(p, {})
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                if key in before:
                    state[key] = before[key]
            elif key in before:
                value.copy_(before[key])
            else:
                value.zero_()


def _capture(graph, stream):
    """``torch.cuda.graph`` that only refuses unsafe CUDA calls of this thread: the data
    pipeline's prefetch thread keeps copying batches on its own stream during the capture."""
    return torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local")


class GraphedTrainStep:
    """One training step replayed from a CUDA graph: ``loss = step(image, label)``.

    ``model`` (in train mode; may be compiled), ``loss_fn(logits, label)``, ``optimizer``
    (SGD or Adam) and ``autocast`` (``() -> context``, as from ``runtime.build.autocast_factory``)
    are captured with ``example_image`` ``(N, C, D, H, W)`` and ``example_label``
    ``(N, 1, D, H, W)`` on the GPU; later batches must have the same shapes and dtypes (their
    memory format and device may differ: they are copied into the static buffers). ``scaler``
    must be None or disabled (see the module docstring). The warm-up steps are undone, so the
    weights and optimizer state after construction are those passed in.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                 example_image: torch.Tensor, example_label: torch.Tensor,
                 autocast: Callable[[], object] = nullcontext, scaler=None, warmup_iters: int = 3):
        if scaler is not None and scaler.is_enabled():
            raise ValueError("an enabled GradScaler (fp16) cannot be graphed: use bf16 or fp32")
        device = example_image.device
        if device.type != "cuda":
            raise ValueError(f"GraphedTrainStep needs CUDA tensors, got {device}")
        self.model, self.loss_fn, self.optimizer, self.autocast = model, loss_fn, optimizer, autocast
        self.static_image = example_image.detach().clone()     # keeps the memory format
        self.static_label = example_label.detach().clone()
        self.graph = torch.cuda.CUDAGraph()
        model.train()
        saved = snapshot(model, optimizer)
        stream = torch.cuda.Stream(device)
        captured = False
        try:
            with capturable_optimizer(optimizer, device) as self._lr_tensors:
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for _ in range(warmup_iters):
                        optimizer.zero_grad(set_to_none=True)
                        self._step()
                torch.cuda.current_stream(device).wait_stream(stream)
                # Gradients None before the capture: backward then creates them in the graph's
                # memory pool and every replay overwrites (does not accumulate) them.
                optimizer.zero_grad(set_to_none=True)
                with _capture(self.graph, stream):
                    self.static_loss = self._step()
            captured = True
        finally:
            # Also after a failed capture, so that an eager fallback starts from the same state.
            torch.cuda.current_stream(device).wait_stream(stream)
            if not captured:
                optimizer.zero_grad(set_to_none=True)
            restore_snapshot(saved, model, optimizer)
        self._lr_values = [float(group["lr"]) for group in optimizer.param_groups]  # the tensors' values

    def _step(self) -> torch.Tensor:
        with _graph_safe_autocast(self.autocast):
            logits = self.model(self.static_image)
            loss = self.loss_fn(logits, self.static_label)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _refresh_learning_rate(self) -> None:
        for i, group in enumerate(self.optimizer.param_groups):
            value = group["lr"]
            value = float(value) if isinstance(value, torch.Tensor) else value
            if value != self._lr_values[i]:
                self._lr_tensors[i].fill_(value)
                self._lr_values[i] = value

    def __call__(self, image: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        """Train on one batch; returns the batch loss (detached, on the GPU; no host sync)."""
        if image.shape != self.static_image.shape or label.shape != self.static_label.shape:
            raise ValueError(f"the graph was captured for image {tuple(self.static_image.shape)} and label "
                             f"{tuple(self.static_label.shape)}, got {tuple(image.shape)} and "
                             f"{tuple(label.shape)}")
        self.static_image.copy_(image, non_blocking=True)
        self.static_label.copy_(label, non_blocking=True)
        self._refresh_learning_rate()
        self.graph.replay()
        return self.static_loss.clone()
