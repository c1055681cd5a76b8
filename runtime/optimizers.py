"""Optimizers: SGD (Nesterov), Adam and a pure-PyTorch LAMB (no apex)."""
from __future__ import annotations

import functools

import torch


class Lamb(torch.optim.Optimizer):
    """Layer-wise adaptive moments (You et al., 2019).

    Adam moments with bias correction; per tensor, the update ``m̂ / (√v̂ + eps) + wd·p`` is
    scaled by the trust ratio ``‖p‖ / ‖update‖`` (1 when either norm is zero).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                grad = p.grad.float()
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = state["step"]
                m_hat = exp_avg / (1 - beta1 ** step)
                v_hat = exp_avg_sq / (1 - beta2 ** step)
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update * trust, alpha=-group["lr"])
        return loss


# torch's optimizers of --optimizer (LAMB is this module's own, with no fused step)
TORCH_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}


def make_optimizer(name: str, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                   betas=(0.9, 0.999), fused: bool = False, foreach: bool = False) -> torch.optim.Optimizer:
    """The optimizer named by ``--optimizer``. ``fused``: the fused step, as decided for the run
    (:func:`fused_step`, in ``runtime.resolve``, which tried it: built as decided, never swapped
    here for another); otherwise the default step, multi-tensor with ``foreach`` (decided from the
    plan's device: CUDA, :func:`default_step`), else one tensor at a time."""
    params = list(params)
    if name == "lamb":
        return Lamb(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name not in TORCH_OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}")
    cls, kwargs = TORCH_OPTIMIZERS[name], {"momentum": momentum, "nesterov": True} if name == "sgd" else {}
    speed = {"fused": True} if fused else {"foreach": True} if foreach else {}
    return cls(params, lr=lr, weight_decay=weight_decay, **kwargs, **speed)


def default_step(name: str, device: torch.device) -> tuple[bool, str]:
    """``(foreach, why)``: the step without ``--fused_optimizer`` on ``device``: torch's
    multi-tensor (foreach) step on CUDA, one tensor at a time elsewhere (LAMB: its own step)."""
    if name not in TORCH_OPTIMIZERS:
        return False, f"--optimizer {name}: its own step"
    if device.type == "cuda":
        return True, "the default step: multi-tensor (foreach) on CUDA"
    return False, f"the default step: one tensor at a time on {device.type}"


def fused_step(name: str, device: torch.device) -> tuple[bool, str]:
    """Whether ``--fused_optimizer`` gets torch's fused ``name`` step on ``device``, and why:
    where torch has the kernel (CUDA; the CPU in newer torch), asked by trying one step
    (:func:`fused_step_runs`): one pass over weights, gradients and momentum instead of one per
    operation (docs/performance.md, "The fast CPU settings"). Decided once, in ``runtime.resolve``."""
    if name not in TORCH_OPTIMIZERS:
        return False, f"--optimizer {name} has no fused step: the default step"
    where = "CUDA" if device.type == "cuda" else "the CPU" if device.type == "cpu" else device.type
    if fused_step_runs(TORCH_OPTIMIZERS[name], device.type):
        return True, f"torch's fused step on {where}"
    return False, f"torch {torch.__version__} has no fused {name} step on {where}: the default step"


@functools.lru_cache(maxsize=None)
def fused_step_runs(cls, device_type: str) -> bool:
    """Whether torch's fused ``cls`` step runs on ``device_type``, asked with one step on one
    element: torch 2.3 takes ``fused=True`` for CPU tensors and fails at the first step."""
    try:
        p = torch.nn.Parameter(torch.zeros(1, device=device_type))
        p.grad = torch.zeros(1, device=device_type)
        cls([p], lr=0.1, fused=True).step()
    except (TypeError, RuntimeError, ValueError):   # NotImplementedError is a RuntimeError
        return False
    return True
