"""Speed levers as small helpers: FLOP counting, ``torch.compile`` with an eager fallback,
channels-last 3-D conversion.

Nothing here touches a device or changes global state at import.
"""
from __future__ import annotations

import itertools
import warnings
from typing import Sequence

import torch
from torch import nn

from runtime.checkpoint import unwrap


def flop_count_per_sample(model: nn.Module, input_shape: Sequence[int],
                          in_channels: int = 1) -> tuple[int, int]:
    """``(forward, forward + backward)`` FLOPs of one ``(1, in_channels, *input_shape)`` sample.

    Counted with ``torch.utils.flop_counter.FlopCounterMode`` (convolutions and matrix
    products, 2 FLOPs per multiply-add, as the spec counts them) on the ``meta`` device:
    nothing is computed or allocated, so any shape costs the same few milliseconds and the
    model's own weights are not touched. ``input_shape`` is the spatial patch ``(D, H, W)``.
    The backward pass has no input gradient for the first layer (the image needs none), as in
    training. For the default model at 128³: 954.6 GFLOP forward, 2.860 TFLOP with backward.
    """
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    module = unwrap(model)
    tensors = {name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
               for name, t in itertools.chain(module.named_parameters(), module.named_buffers())}
    image = torch.empty((1, in_channels, *input_shape), device="meta")
    with FlopCounterMode(display=False) as forward_counter:
        logits = functional_call(module, tensors, (image,))
    with FlopCounterMode(display=False) as backward_counter:
        logits.float().sum().backward()
    forward = int(forward_counter.get_total_flops())
    return forward, forward + int(backward_counter.get_total_flops())


def _compile_unavailable_reason() -> str | None:
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    try:
        import torch._dynamo as dynamo
    except Exception as err:  # a broken or partial install: report it, run eagerly
        return f"torch._dynamo cannot be imported ({type(err).__name__}: {err})"
    supported = getattr(dynamo, "is_dynamo_supported", None)
    if supported is not None and not supported():
        return "torch.compile is not supported on this Python/platform"
    return None


class CompiledModule(nn.Module):
    """``module`` run through ``torch.compile``, falling back to eager for good when compiling fails.

    Compilation happens lazily at the first call (and again at each new input shape), so the
    fallback is decided there: any error raised by the compiled call, other than running out
    of memory, prints one warning and the call is repeated eagerly; a genuine error of the model
    then surfaces from the eager call with its usual traceback. Errors raised later, when the
    lazily compiled backward is built, are not caught (they appear in ``loss.backward()``).

    The wrapped module is registered as ``self.module``, so ``runtime.checkpoint.unwrap``
    reaches it and state_dict keys only gain a ``module.`` prefix; the compiled callable is not
    a registered child (no duplicate parameters). Attribute look-ups the wrapper does not answer
    (``no_sync`` of DDP, ``divisor`` of the U-Net) go to the module.
    """

    def __init__(self, module: nn.Module, **compile_kwargs):
        super().__init__()
        self.module = module
        object.__setattr__(self, "_compiled", torch.compile(module, **compile_kwargs))
        self.compile_failed: str | None = None

    def forward(self, *args, **kwargs):
        if self.compile_failed is None:
            try:
                return self._compiled(*args, **kwargs)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # noqa: BLE001 - the eager call below re-raises real errors
                first_line = (str(err).strip().splitlines() or [""])[0]
                self.compile_failed = f"{type(err).__name__}: {first_line}"
                warnings.warn(f"torch.compile failed, running {type(self.module).__name__} eagerly from "
                              f"now on ({self.compile_failed})", RuntimeWarning, stacklevel=2)
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)


def compile_model(module: nn.Module, enabled: bool, **compile_kwargs) -> nn.Module:
    """``module`` itself when not ``enabled`` or when this torch cannot compile (one warning),
    else a :class:`CompiledModule` (compiled, with an eager fallback). Works for the model and
    for the loss module alike."""
    if not enabled:
        return module
    reason = _compile_unavailable_reason()
    if reason is not None:
        warnings.warn(f"--compile ignored: {reason}; running eagerly", RuntimeWarning, stacklevel=2)
        return module
    return CompiledModule(module, **compile_kwargs)


def to_channels_last(value):
    """A 5-D tensor in ``torch.channels_last_3d`` (NDHWC strides, same logical NCDHW shape), or a
    module whose 5-D weights are; anything else is returned unchanged."""
    if isinstance(value, nn.Module):
        return value.to(memory_format=torch.channels_last_3d)
    if isinstance(value, torch.Tensor) and value.dim() == 5:
        return value.contiguous(memory_format=torch.channels_last_3d)
    return value


def is_channels_last(tensor: torch.Tensor) -> bool:
    return tensor.dim() == 5 and tensor.is_contiguous(memory_format=torch.channels_last_3d)
