"""The backend registry: which runtime computes the network's windows in predict and evaluate, and
the one place the chosen one is applied.

A backend is a converter applied to the loaded network (eval mode, the checkpoint's fp32 weights),
returning the module the window predictor (:func:`runtime.inference.predictor.build_predictor`)
calls; the sliding window, Gaussian blending, TTA, resampling and every output stay this project's
code:

* ``torch``: PyTorch. Evaluate scores the trained network as built (its logits are the
  benchmark's); predict runs its inference copy (:func:`runtime.levers.cpu.convert.prepare_for_inference`) with
  ``--channels_last``, compiled with ``--compile``. fp32, or ``--amp`` autocast.
* ``openvino``: OpenVINO's CPU runtime (:mod:`runtime.inference.openvino`), converted once per
  weights and window shape and cached in the user's cache folder (``--cache_dir``). fp32, or int8
  with ``--int8``: NNCF's post-training quantisation, calibrated on each scan alone or on the
  scans ``--int8_calibration`` names (no training data needed).

:func:`decide_backend` runs once, in ``resolve()``, which sets the plan's backend and records
why (``plan.why("backend")``). In predict, ``--backend auto`` takes OpenVINO on
the CPU when it is installed and no PyTorch-only lever (``--amp``, ``--compile``,
``--channels_last``) is asked for, else PyTorch: both compute fp32, the same logits up to float32
rounding, so ``auto`` never changes the algorithm. Evaluate's ``auto`` is PyTorch, the network as trained, whatever is installed (the
benchmark's Dice must not depend on an installed package); ``--backend openvino`` asks for
OpenVINO there. ``--int8`` is always OpenVINO's int8; where it cannot run, the run stops with one
line. Training (and its evaluations) and ``--benchmark`` run PyTorch (the MLPerf timed run).

OpenVINO is optional (``requirements-openvino.txt``); nothing here imports it at import time.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from runtime.compiling import compile_model
from runtime.config import PredictOptions, UsageError
from runtime.inference.predictor import Predict, build_predictor, options_from
from runtime.levers.cpu.convert import prepare_for_inference
from runtime.mode import Mode
from runtime.plan import InferencePlan, NetworkPlan, PrecisionPlan

INSTALL_HINT = "pip install -r requirements-openvino.txt"
TORCH_ONLY_LEVERS = ("amp", "compile", "channels_last")
Say = Callable[[str], None]


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


def _torch_module(model: torch.nn.Module, network: NetworkPlan, precision: PrecisionPlan, inference: InferencePlan,
                  say: Say, calibration=None, checkpoint: str = "") -> torch.nn.Module:
    if not inference.inference_copy:  # evaluate: the trained network, as built (runtime.resolve)
        return model
    if precision.channels_last:
        model = prepare_for_inference(model, channels_last=True)
    return compile_model(model.eval(), precision.compile)


def _openvino_module(model: torch.nn.Module, network: NetworkPlan, precision: PrecisionPlan,
                     inference: InferencePlan, say: Say, calibration=None, checkpoint: str = "") -> torch.nn.Module:
    from runtime.inference.openvino.compiled import OpenVINOWindows, cached_openvino_model

    compiled = cached_openvino_model(model, network, inference, checkpoint or inference.checkpoint, calibration,
                                     say=say)
    return OpenVINOWindows(compiled, tuple(inference.window))


def _openvino_calibration(inference: InferencePlan, scans):
    from runtime.inference.openvino.calibration import scan_calibration

    # as planned (runtime.resolve.decide_calibration)
    return scan_calibration(inference.window, scans, inference.overflow_fix)


@dataclass(frozen=True)
class Backend:
    """A runtime for the windows: the precisions it computes, its converter
    ``convert(model, network, precision, inference, say, calibration, checkpoint) -> module`` (the
    plan's sections: the network's architecture keys OpenVINO's cache, the precision the PyTorch
    copy's layout and compile; ``calibration``: an int8 calibration set; ``checkpoint``: the
    weights' path, default the inference section's first), and with int8 its
    ``calibrate(inference, scans) -> calibration set`` (:func:`int8_calibration`)."""

    precisions: tuple[str, ...]
    convert: Callable[..., torch.nn.Module]
    calibrate: Callable[..., object] | None = None


BACKENDS = {"torch": Backend(("fp32",), _torch_module),
            "openvino": Backend(("fp32", "int8"), _openvino_module, _openvino_calibration)}


def int8_calibration(inference: InferencePlan, scans):
    """The int8 calibration set of the ``inference`` section's backend on ``scans`` (``(name, path)``
    of the scans to calibrate on, in order): it has ``digest()`` (recorded beside each
    segmentation) and ``describe()``; see :mod:`runtime.inference.openvino.calibration`."""
    return BACKENDS[inference.backend].calibrate(inference, scans)


def _openvino_version() -> str:
    import openvino

    return openvino.__version__.split("-")[0]


def decide_backend(options: PredictOptions, mode: Mode, device: torch.device,
                   benchmark: bool = True) -> tuple[str, str]:
    """``(backend, why)``: the backend (``torch`` or ``openvino``) a run of ``mode`` uses on
    ``device`` for ``options`` (the inference inputs: ``--backend``, ``--int8``, the PyTorch levers
    asked) and one line saying why (see the module docstring), for ``resolve()`` to record.
    ``benchmark``: the data is the benchmark's (evaluate's ``auto`` runs the network as trained);
    on own data evaluate's ``auto`` chooses as predict's does, so that the two score one network
    alike. Raises :class:`UsageError` (one line) when ``--backend openvino`` or ``--int8`` cannot
    run here."""
    asked, int8 = options.backend, options.int8
    if not mode.chooses_backend:
        return "torch", "PyTorch (training and --benchmark run PyTorch)"
    if asked == "torch":
        if int8 and "int8" not in BACKENDS["torch"].precisions:
            raise UsageError("--int8 is OpenVINO's int8 (NNCF); --backend torch computes fp32: drop one of them")
        return "torch", "--backend torch: PyTorch"
    if asked == "auto" and mode.scores_as_trained and benchmark:
        return "torch", ("--backend auto: PyTorch, the network as trained "
                         "(evaluate computes the benchmark's Dice; --backend openvino asks for OpenVINO)")
    asked_levers = {"amp": options.amp, "compile": options.compile, "channels_last": options.channels_last}
    levers = [f"--{name}" for name in TORCH_ONLY_LEVERS if asked_levers[name]]
    problems = []
    if device.type != "cpu":
        problems.append(f"OpenVINO runs on the CPU here and this run's device is {device.type}")
    if levers:
        problems.append(f"{', '.join(levers)} {'is a' if len(levers) == 1 else 'are'} PyTorch lever"
                        f"{'' if len(levers) == 1 else 's'}")
    missing = openvino_missing(int8=int8)
    if missing:
        problems.append(missing)
    if problems and (asked == "openvino" or int8):
        raise UsageError(f"{'--int8' if int8 else '--backend openvino'}: {problems[0]}")
    if problems:
        return "torch", f"--backend auto: PyTorch ({problems[0]})"
    calibrated = (f"calibrated once on --int8_calibration {options.int8_calibration}" if options.int8_calibration
                  else "calibrated on each scan alone")
    precision = f"int8 (NNCF post-training quantisation, {calibrated})" if int8 else "fp32"
    return "openvino", f"--backend {asked}: OpenVINO {_openvino_version()} on the CPU, {precision}"


def window_predictor(model: torch.nn.Module, network: NetworkPlan, precision: PrecisionPlan,
                     inference: InferencePlan, device: torch.device, say: Say = print, calibration=None,
                     checkpoint: str = "") -> Predict:
    """Predict's window predictor: ``model`` (eval mode, the weights of ``checkpoint``, default
    the inference section's first; fp32) converted by the ``inference`` section's backend
    (``calibration``: the int8 calibration set with ``--int8``; OpenVINO keys its cache with the
    ``network``'s flags), wrapped by :func:`build_predictor` in the ``precision`` that runs."""
    module = BACKENDS[inference.backend].convert(model, network, precision, inference, say, calibration, checkpoint)
    return build_predictor(module, device, options_from(precision, inference))


def say_on(is_main: bool, stream=None) -> Say:
    """A ``say`` printing on rank 0 only: stdout by default (predict's log of its scans),
    ``stream`` (stderr) for evaluate, whose stdout is its result."""
    def say(message: str) -> None:
        if is_main:
            print(message, file=stream or sys.stdout, flush=True)
    return say

