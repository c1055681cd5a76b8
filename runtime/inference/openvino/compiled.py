"""The network as an OpenVINO CPU model: converted once, cached in the user's cache folder, compiled.

:func:`cached_openvino_model` returns a compiled model for windows ``(1, 1, *roi)``. The
conversion (``openvino.convert_model`` of the PyTorch module, traced) and, for int8, NNCF's
post-training quantisation are done once and stored under ``<cache_dir>/openvino/<checkpoint>-<hash>/<key>/``;
the key (:mod:`runtime.inference.openvino.cache`) covers the weights, the architecture, the window shape,
the precision and calibration set, and the versions of OpenVINO, NNCF, PyTorch and the
network's code, so a changed checkpoint or upgrade is converted again, never used stale.

:class:`OpenVINOWindows` wraps the compiled model as a ``torch.nn.Module``: windows ``(B, 1,
*roi)`` float32 in any layout in, logits ``(B, 3, *roi)`` float32 NCDHW out, one window per
inference request (the batch only saves Python calls in PyTorch; here it would only add memory).

OpenVINO's CPU runtime picks bf16 on CPUs with AVX512-BF16 or AMX unless told otherwise:
the precision hint is set to f32 so that fp32 means fp32 (int8 layers stay int8).
"""
from __future__ import annotations

import warnings
from typing import Callable

import numpy as np
import torch

from runtime.inference.openvino.cache import CacheEntry, cache_fields, cache_folder
from runtime.inference.openvino.decoder_split import split_decoder_inputs
from runtime.plan import InferencePlan, NetworkPlan

TRACE_EDGE = 64  # traced at 64³ (cheap; 32³ would leave one bottleneck voxel, which instance norm refuses), then reshaped


def convert(model: torch.nn.Module, roi: tuple[int, ...]):
    """``model`` (eval mode) as an ``openvino.Model`` with one input ``(1, C, *roi)``.

    Traced on a small zero input (``TRACE_EDGE``³), then reshaped: a trace at 128³ would run a full window in
    PyTorch just to record the graph."""
    import openvino as ov

    channels = _input_channels(model)
    example = torch.zeros((1, channels, *(TRACE_EDGE,) * len(roi)))
    with torch.no_grad(), warnings.catch_warnings():
        # The tracer warns that shapes become constants and that tracing is deprecated: the
        # reshape below and the tests (PyTorch's logits at another window shape) cover both.
        warnings.simplefilter("ignore")
        # Traced here once: convert_model's own trace runs the network twice more to check it.
        traced = torch.jit.trace(model, example, check_trace=False)
        converted = ov.convert_model(traced, example_input=example)
    converted.reshape([1, channels, *roi])
    return converted


def _input_channels(model: torch.nn.Module) -> int:
    first = next((m for m in model.modules() if isinstance(m, torch.nn.Conv3d)), None)
    return first.in_channels if first is not None else 1


def compile_for_cpu(ov_model):
    """A compiled model on the CPU: latency mode, fp32 arithmetic where the model is float,
    as many threads as PyTorch uses (``torch.set_num_threads``, ``OMP_NUM_THREADS``)."""
    import openvino as ov

    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32",
              "INFERENCE_NUM_THREADS": torch.get_num_threads()}
    return ov.Core().compile_model(ov_model, "CPU", config)


def compile_openvino_model(model: torch.nn.Module, window: tuple[int, ...], calibration,
                           say: Callable[[str], None] = print) -> object:
    """The uncompiled OpenVINO model of ``model`` for ``window``-sized windows, int8-quantised on
    ``calibration`` (a :class:`runtime.inference.openvino.calibration.CalibrationSet`) when it is given."""
    if calibration is None:
        return convert(model, tuple(window))
    from runtime.inference.openvino.calibration import quantize

    # each half of a decoder's input on its own int8 grid: see runtime.inference.openvino.decoder_split
    converted = convert(split_decoder_inputs(model), tuple(window))
    return quantize(converted, calibration, compile_for_cpu, say=say)


def cached_openvino_model(model: torch.nn.Module, network: NetworkPlan, inference: InferencePlan,
                          checkpoint_path: str, calibration=None, say: Callable[[str], None] = print):
    """The compiled OpenVINO model of ``model`` (the ``network`` of the weights of
    ``checkpoint_path``) for the ``inference`` section's window, from its cache folder
    (``inference.cache_dir``) when its key matches, else converted (and stored atomically). A
    cache that cannot be written is one line: the conversion then lives for this run only."""
    import openvino as ov

    fields = cache_fields(model, network.architecture, inference.window, calibration)
    entry = CacheEntry(cache_folder(checkpoint_path, inference.cache_dir), fields)
    ov_model = entry.load(ov.Core(), say)
    if ov_model is None:
        what = "int8 (NNCF calibration on " + calibration.describe() + ")" if calibration else "fp32"
        say(f"openvino: converting the network for {_shape_text(inference.window)} windows, {what}; "
            f"cached in {entry.folder}")
        ov_model = compile_openvino_model(model, inference.window, calibration, say=say)
        entry.store(ov_model, say)
    else:
        say(f"openvino: using the converted network in {entry.path}")
    return compile_for_cpu(ov_model)


def _shape_text(shape) -> str:
    return "x".join(str(s) for s in shape)


class OpenVINOWindows(torch.nn.Module):
    """A compiled OpenVINO model as the window predictor ``windows -> logits``.

    ``forward(batch)``: ``batch`` ``(B, C, *roi)`` float (any layout, e.g. a flipped view in
    TTA); returns ``(B, n_class, *roi)`` float32, contiguous NCDHW, on the CPU. Windows run one
    inference request each, in order; the output is copied out of the request's buffer.
    """

    def __init__(self, compiled, roi: tuple[int, ...]):
        super().__init__()
        self.compiled = compiled
        self.roi = tuple(roi)
        self._request = compiled.create_infer_request()

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if tuple(batch.shape[2:]) != self.roi:
            raise ValueError(f"OpenVINO model compiled for {self.roi} windows, got {tuple(batch.shape[2:])}")
        outputs = []
        for window in batch.detach().float().cpu():
            array = np.ascontiguousarray(window[None].numpy())
            result = self._request.infer({0: array})
            outputs.append(torch.from_numpy(np.array(result[0], dtype=np.float32, copy=True)))
        return torch.cat(outputs)

