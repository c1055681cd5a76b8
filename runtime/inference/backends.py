"""Which runtime computes the network's windows in predict and evaluate: PyTorch or OpenVINO.

``--backend torch`` runs the PyTorch model as before. ``--backend openvino`` converts the
loaded network once per weights and window shape (:mod:`runtime.inference.openvino.compiled`, cached
beside the checkpoint) and runs it with OpenVINO's CPU runtime; the sliding window, Gaussian
blending, TTA, resampling and every output stay this project's code: OpenVINO only replaces
``model(windows)``. ``--backend auto`` (the default) takes OpenVINO on the CPU when it is
installed and no PyTorch-only lever (``--amp``, ``--compile``, ``--channels_last``) is asked
for, else PyTorch; the log says which and why. Training never uses this module: the MLPerf
timed run keeps PyTorch.

OpenVINO is optional (``requirements-openvino.txt``); nothing here imports it at import time.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from runtime.inference.torch_copy import int8_available, int8_path
from runtime.arguments import Config, UsageError
from runtime.inference.predictor import build_predictor, options_from

INSTALL_HINT = "pip install -r requirements-openvino.txt"
TORCH_ONLY_LEVERS = ("amp", "compile", "channels_last")


def openvino_missing(int8: bool = False) -> str | None:
    """``None`` when OpenVINO (and NNCF, for ``int8``) can be imported, else the one-line reason
    with the command that installs it."""
    for module, what in (("openvino", "OpenVINO"), ("nncf", "NNCF (OpenVINO's int8 quantizer)")):
        if module == "nncf" and not int8:
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or None entry in sys.modules
            found = False
        if found:
            try:
                __import__(module)
            except ImportError as err:
                return f"{what} is installed but cannot be imported ({err}); reinstall it: {INSTALL_HINT}"
        else:
            return f"{what} is not installed; install it with: {INSTALL_HINT}"
    return None


@dataclass(frozen=True)
class Choice:
    backend: str  # "torch" or "openvino"
    why: str  # one line for the log


def choose_backend(config: Config, device: torch.device, calibration: Callable[[], str | None]) -> Choice:
    """The backend for ``config`` on ``device``; ``calibration()`` says why int8 calibration
    data is unavailable (None when it is). Raises :class:`UsageError` (one line) when
    ``--backend openvino`` cannot run here."""
    asked = config.backend
    levers = [f"--{name}" for name in TORCH_ONLY_LEVERS if getattr(config, name)]
    if asked == "torch":
        return Choice("torch", "--backend torch")
    problems = []
    if device.type != "cpu":
        problems.append(f"OpenVINO runs on the CPU here and this run's device is {device.type}")
    if levers:
        problems.append(f"{', '.join(levers)} {'is a' if len(levers) == 1 else 'are'} PyTorch lever"
                        f"{'' if len(levers) == 1 else 's'}")
    missing = openvino_missing(int8=config.int8)
    if missing:
        problems.append(missing)
    elif config.int8:
        no_data = calibration()
        if no_data:
            problems.append(no_data)
    if asked == "openvino" and problems:
        raise UsageError(f"--backend openvino: {problems[0]}")
    if problems:
        return Choice("torch", f"--backend auto: PyTorch ({problems[0]})")
    return Choice("openvino", f"--backend {asked}: OpenVINO {_openvino_version()} on the CPU"
                  + (", int8 (NNCF post-training quantisation)" if config.int8 else ", fp32"))


def _openvino_version() -> str:
    import openvino

    return openvino.__version__.split("-")[0]


def say(message: str, is_main: bool = True, stream=None) -> None:
    """One log line on rank 0: stdout by default (predict's log of its scans), ``stream``
    (stderr) for evaluate, whose stdout is its result."""
    if is_main:
        print(message, file=stream or sys.stdout, flush=True)


def predict_windows(config: Config, device: torch.device, load: Callable[[Config, torch.device], torch.nn.Module],
                    is_main: bool = True) -> tuple[Callable[[torch.Tensor], torch.Tensor], Config]:
    """``(predict, config)`` for ``--exec_mode predict``: the window predictor
    (:func:`runtime.inference.predictor.build_predictor`) of the backend chosen here, and the config with
    that backend (``torch`` or ``openvino``: predict records it beside each segmentation) and
    the window batch bounded by ``--max_memory_gb`` (:mod:`runtime.inference.memory_budget`).
    ``load(config, device)`` returns the trained PyTorch model (eval mode)."""
    import dataclasses

    from runtime.inference.openvino.calibration import calibration_unavailable
    from runtime.inference.memory_budget import bounded_window_batch

    choice = choose_backend(config, device, lambda: calibration_unavailable(config))
    say(f"backend: {choice.why}", is_main)
    config = dataclasses.replace(config, backend=choice.backend)
    if choice.backend == "torch":
        if config.int8 and int8_available() is not None:
            raise UsageError(f"--int8: {int8_available()}")
        predict = build_predictor(load(config, device), device, options_from(config), inference_copy=True)
        if config.int8:
            say(f"predict: {int8_path()}", is_main)
        return predict, bounded_window_batch(config, "torch", say=lambda m: say(m, is_main))
    # the PyTorch model is loaded in fp32; OpenVINO quantises it with --int8
    module = openvino_module(load(config, device), config, say=lambda m: say(m, is_main))
    predict = build_predictor(module, device, options_from(config))
    return predict, bounded_window_batch(config, "openvino", say=lambda m: say(m, is_main))


def openvino_module(model: torch.nn.Module, config: Config, say: Callable[[str], None] = print):
    """``model`` (eval mode, the checkpoint's weights) converted, cached and compiled for
    ``config.val_input_shape`` windows, int8 with ``config.int8``."""
    from runtime.inference.openvino.calibration import calibration_set
    from runtime.inference.openvino.compiled import OpenVINOWindows, cached_openvino_model

    calibration = calibration_set(config) if config.int8 else None
    compiled = cached_openvino_model(model, config, config.load_ckpt_path, calibration, say=say)
    return OpenVINOWindows(compiled, tuple(config.val_input_shape))


def evaluation_components(components, out):
    """``components`` for ``--exec_mode evaluate`` with the backend's model as ``eval_model``
    (unchanged with PyTorch). Evaluate scores the trained network in fp32 (int8 is refused by
    the flag checks). ``out`` (``runtime.training.Reporters``): the choice is a ``backend``
    record in log.json; the lines go to stderr with ``--verbose`` only, since evaluate's
    stdout is its result and its stderr one line on an error. Returns ``(components, choice)``:
    the caller writes the choice to log.json after the scores are printed (a full disk must lose
    no number)."""
    config = components.config
    choice = choose_backend(config, components.dist.device, lambda: None)
    is_main = out.is_main and config.verbose
    say(f"backend: {choice.why}", is_main, sys.stderr)
    if choice.backend == "torch":
        return components, choice
    from runtime.checkpoint import unwrap

    model = unwrap(components.model).eval()
    module = openvino_module(model, config, say=lambda m: say(m, is_main, sys.stderr))
    return _replace_eval_model(components, module), choice


def _replace_eval_model(components, module):
    import dataclasses

    return dataclasses.replace(components, eval_model=module)
