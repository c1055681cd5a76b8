"""``torch.compile`` with an eager fallback (for the model and the loss alike).

Nothing here touches a device or changes global state at import.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

# torch 2.3 has the out-of-memory error only under torch.cuda; newer torch also at the top level.
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def compile_unavailable() -> str | None:
    """Why this torch cannot ``torch.compile`` (one line), or None when it can: read once, by
    ``runtime.resolve.decide_compile``; the builders then obey the plan's ``compile``."""
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


def _compiled_or_eager(owner, compiled, eager, name: str, args, kwargs):
    """``compiled(*args, **kwargs)`` until it fails once (``owner.compile_failed`` then says why,
    one warning), ``eager`` from then on: the eager call re-raises a genuine error with its usual
    traceback. Running out of memory is re-raised as it is."""
    if owner.compile_failed is None:
        try:
            return compiled(*args, **kwargs)
        except OUT_OF_MEMORY:
            raise
        except Exception as err:  # noqa: BLE001 - the eager call below re-raises real errors
            first_line = (str(err).strip().splitlines() or [""])[0]
            owner.compile_failed = f"{type(err).__name__}: {first_line}"
            warnings.warn(f"torch.compile failed, running {name} eagerly from now on ({owner.compile_failed})",
                          RuntimeWarning, stacklevel=4)
    return eager(*args, **kwargs)


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
        return _compiled_or_eager(self, self._compiled, self.module, type(self.module).__name__, args, kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)


def compile_model(module: nn.Module, enabled: bool, **compile_kwargs) -> nn.Module:
    """``module`` itself when not ``enabled``, else a :class:`CompiledModule` (compiled, with an
    eager fallback). ``enabled``: the plan's ``compile`` (``runtime.resolve.decide_compile``, off
    where this torch cannot compile). Works for the model and for the loss module alike."""
    if not enabled:
        return module
    return CompiledModule(module, **compile_kwargs)


class CompiledFunction:
    """``function`` run through ``torch.compile`` (lazily, at the first call), falling back to the
    eager ``function`` for good when compiling or the compiled call fails (one warning; the eager
    call then raises a genuine error with its usual traceback). Running out of memory is re-raised."""

    def __init__(self, function, **compile_kwargs):
        self.function = function
        self.compiled = torch.compile(function, **compile_kwargs)
        self.compile_failed: str | None = None

    def __call__(self, *args, **kwargs):
        return _compiled_or_eager(self, self.compiled, self.function, getattr(self.function, "__name__", "it"),
                                  args, kwargs)


def allow_recompiles(limit: int) -> None:
    """Let dynamo keep at least ``limit`` compiled variants per function (``recompile_limit``,
    named ``cache_size_limit`` in older torch; default 8). A function called with many layouts,
    types and grad modes (the fused norm of every layer, in training and evaluation) needs more:
    past the limit dynamo silently runs the function eagerly."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if isinstance(getattr(dynamo_config, name, None), int) and getattr(dynamo_config, name) < limit:
            setattr(dynamo_config, name, limit)


def compile_function(function, enabled: bool = True, recompile_limit: int = 0, **compile_kwargs):
    """``function`` itself when not ``enabled`` or when this torch cannot compile (no warning: the
    caller says what it runs), else a :class:`CompiledFunction` with the eager fallback;
    ``recompile_limit``: see :func:`allow_recompiles`."""
    if not enabled or compile_unavailable() is not None:
        return function
    if recompile_limit:
        allow_recompiles(recompile_limit)
    return CompiledFunction(function, **compile_kwargs)
