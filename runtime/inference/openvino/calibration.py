"""int8 for the OpenVINO backend: NNCF post-training quantisation on windows of the scan being
segmented (each scan alone, so that its result can be reproduced from that scan alone), or of
the scans ``--int8_calibration`` names; a checkpoint and the scans are all it needs.

The calibration set (:func:`scan_calibration`): at most ``CALIBRATION_SCANS`` of the given scans,
evenly spaced in its (sorted) list, each preprocessed as predict preprocesses it, and
``CALIBRATION_WINDOWS`` windows in all, shared evenly among them, each scan's evenly spaced over
the windows at half-window steps that cover it (so the set holds background, borders and padded
windows as inference does, not only the organs), cut as predict's sliding window cuts them: an
axis shorter than the window is first padded with the edge's values, half before
(:func:`runtime.inference.sliding_window.pad_short_axes`), never with a constant. NNCF runs the fp32 network on them to fix each
activation's int8 range (static quantisation: every window then uses the same ranges), the range
of each from the extremes over all windows; weights per output channel. The inputs of the norms
stay float (a convolution's output before its instance norm has the scale of the window's
content: one static range for it clipped or wasted most of it). The set is in the cache key: the
window, the rule, and the name and sha256 of every calibration scan; another folder of scans is
calibrated again. Each scan alone is a set of one (its windows are ``CALIBRATION_WINDOWS`` of its
own): the same scan gives the same set, the same key and the same int8 network in any folder.

Then NNCF's accuracy control (:func:`quantize`), against the fp32 network's own labels (no ground
truth needed). Measured on two trained networks with training windows (docs/performance.md,
"OpenVINO int8 on trained weights"): NNCF's defaults on organ-centred windows agreed with float
on 96.7% and 98.3% of the held-back foreground; this, with each decoder's input split in two
(:func:`runtime.inference.openvino.decoder_split.split_decoder_inputs`), 99.4-99.7%.

Without VNNI (AVX2-only CPUs), x86 int8 kernels add pairs of uint8 x int8 products into a
saturating 16-bit value; NNCF's overflow fix (weights on 7 bits) then applies to every layer
instead of the first one only (:func:`runtime.levers.cpu.isa.int8_pairs_saturate`). Which one ran is in the
key and in the log line.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from model.losses import foreground_agreement
from runtime.config import UsageError
from runtime.inference.sliding_window import pad_short_axes

CALIBRATION_SCANS = 8  # at most, evenly spaced over the run's scans
CALIBRATION_WINDOWS = 24  # at most, shared among them; NNCF runs the fp32 network once on each
VALIDATION_WINDOWS = 8  # of those, where fp32 sees kidney or tumour: where int8 must agree with fp32
RANKING_WINDOWS = 4  # of those, the worst: where each convolution's share of the disagreement is measured
MAX_STEPS = 16  # at most this many convolutions (groups of them) go back to fp32: the conversion ends
MAX_AGREEMENT_DROP = 0.002  # int8 labels equal fp32's on >= 99.8% of the validation windows' foreground

FLOAT_INPUT_OPERATIONS = ("MVN",)  # OpenVINO operations whose inputs NNCF leaves float


class CalibrationError(UsageError):
    """No window to calibrate int8 on (one line)."""


@dataclass(frozen=True)
class CalibrationScan:
    name: str
    path: str
    sha256: str  # :func:`data_loading.scan_io.input_digest`


@dataclass(frozen=True)
class CalibrationSet:
    roi: tuple[int, ...]
    scans: tuple[CalibrationScan, ...]
    overflow_fix: str  # "enable" (all layers) or "first_layer"
    window_count: int = CALIBRATION_WINDOWS  # at most, in all

    def fields(self) -> dict:
        return {"roi": list(self.roi), "overflow_fix": self.overflow_fix,
                "scans": [{"name": scan.name, "sha256": scan.sha256} for scan in self.scans],
                "windows": {"at_most": self.window_count, "shared_evenly": True, "steps": "half a window",
                            "short_axes": "edge values, as predict's sliding window"},
                "validation": {"at_most": VALIDATION_WINDOWS, "where": "fp32 labels kidney or tumour"},
                "accuracy_control": {"metric": "foreground agreement with fp32", "max_drop": MAX_AGREEMENT_DROP,
                                     "ranking_windows": RANKING_WINDOWS}}

    def digest(self) -> str:
        """sha256 of :meth:`fields` (recorded beside each int8 segmentation)."""
        return hashlib.sha256(json.dumps(self.fields(), sort_keys=True).encode()).hexdigest()

    def describe(self) -> str:
        names = ", ".join(scan.name for scan in self.scans)
        return (f"at most {self.window_count} windows of {len(self.scans)} scan{'s' * (len(self.scans) != 1)} "
                f"({names}), overflow fix on "
                f"{'every layer (no VNNI)' if self.overflow_fix == 'enable' else 'the first layer'}")

    def arrays(self) -> list[np.ndarray]:
        """The windows ``(1, 1, *roi)`` float32: each scan read and preprocessed as predict does
        (a scan that cannot be is skipped: predict reports it); :class:`CalibrationError` when
        no window is left."""
        from data_loading.preprocessing import PreprocessError
        from data_loading.scans import ScanError, preprocess_scan, read_scan

        windows = []
        for scan, count in zip(self.scans, shares(self.window_count, len(self.scans))):
            try:
                image, _ = preprocess_scan(read_scan(scan.path), scan.path)
            except (ScanError, PreprocessError, OSError):
                continue
            windows += calibration_windows(image, self.roi, count)
            del image
        if not windows:
            raise CalibrationError("--int8: none of the scans to calibrate on could be read "
                                   f"({', '.join(scan.name for scan in self.scans)})")
        return windows


def shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` counts as even as can be (the first ones one larger)."""
    return [total // parts + (i < total % parts) for i in range(parts)] if parts else []


def scan_calibration(window: Sequence[int], scans: Sequence[tuple[str, str]], overflow_fix: str) -> CalibrationSet:
    """The calibration set of ``window``-sized windows (the plan's) on ``scans`` (``(name, path)``
    of the scans to calibrate on: the scan being segmented, or those ``--int8_calibration`` names, in
    order) with NNCF's ``overflow_fix`` (the plan's: ``runtime.resolve.decide_calibration``): see
    the module docstring."""
    from data_loading.scan_io import input_digest

    if not scans:
        raise CalibrationError("--int8: there are no scans to calibrate on")
    chosen = [CalibrationScan(name, os.path.abspath(path), input_digest(path))
              for name, path in spread(list(scans), CALIBRATION_SCANS)]
    return CalibrationSet(tuple(window), tuple(chosen), overflow_fix, CALIBRATION_WINDOWS)


def grid_origins(shape: Sequence[int], roi: Sequence[int]) -> list[tuple[int, ...]]:
    """The origins of ``roi`` windows at half-window steps over a volume of ``shape`` (D, H, W),
    the last one on each axis flush with the volume's end (0 alone where the volume is smaller
    than the window: that window is padded), in C order."""
    axes = []
    for size, edge in zip(shape, roi):
        last = max(size - edge, 0)
        starts = list(range(0, last + 1, max(edge // 2, 1)))
        if starts[-1] != last:
            starts.append(last)
        axes.append(starts)
    return [tuple(int(o) for o in origin) for origin in itertools.product(*axes)]


def spread(items: Sequence, count: int) -> list:
    """``count`` items of ``items`` at even steps (the middle of each of ``count`` equal parts),
    all of them when there are no more than ``count``."""
    if len(items) <= count:
        return list(items)
    return [items[(2 * i + 1) * len(items) // (2 * count)] for i in range(count)]


def window_at(image: np.ndarray, origin: Sequence[int], roi: Sequence[int]) -> np.ndarray:
    """``image (C, D, H, W)``'s window at ``origin`` as float32 (C, *roi); ``image`` holds the
    whole window (:func:`calibration_windows` pads a short axis first)."""
    cut = np.asarray(image[(slice(None), *(slice(o, o + r) for o, r in zip(origin, roi)))], dtype=np.float32)
    if tuple(cut.shape[1:]) != tuple(roi):
        raise ValueError(f"the window at {tuple(origin)} of a {tuple(image.shape[1:])} volume is not {tuple(roi)}")
    return np.ascontiguousarray(cut)


def calibration_windows(image: np.ndarray, roi: Sequence[int], count: int) -> list[np.ndarray]:
    """``count`` windows (1, C, *roi) float32 of the preprocessed ``image`` (C, D, H, W), evenly
    spaced over its half-window grid (:func:`grid_origins`), each what predict's sliding window
    would give the network there: an axis shorter than the window padded with the edge's values
    first, as :func:`runtime.inference.sliding_window.flush_sliding_window_inference` pads it."""
    import torch

    padded, _ = pad_short_axes(torch.from_numpy(np.asarray(image, dtype=np.float32))[None], roi)
    volume = padded[0].numpy()
    return [window_at(volume, origin, roi)[None] for origin in spread(grid_origins(volume.shape[1:], roi), count)]


def quantize(ov_model, calibration: CalibrationSet, compile_fp32: Callable, say: Callable[[str], None] = print):
    """``ov_model`` quantised to int8 by NNCF on ``calibration``'s windows, with accuracy control.

    Ranges: activation ranges from the extremes over all windows (NNCF's default averages each
    window's extremes, which clips the windows of larger contrast), the norms' inputs kept float
    (``MVN``: instance and group norm in OpenVINO's graph), weights per output channel. Then
    NNCF's accuracy control: on the validation windows (:meth:`CalibrationSet.validation`) the
    int8 labels (argmax) must agree with fp32's (``compile_fp32(ov_model)``, computed here) on
    all but ``MAX_AGREEMENT_DROP`` of the voxels that either calls kidney or tumour; while they do
    not, the convolution whose int8 costs the most agreement (ranked on ``RANKING_WINDOWS`` of
    them) goes back to fp32, at most ``MAX_STEPS`` times (a network int8 cannot serve, such as
    random weights with near-ties everywhere, would otherwise re-rank for an hour). A line per
    step; the last says how many stayed fp32, the agreement reached, and when it is below the
    bar. Where there are no more validation windows than ranking ones, ranking runs say their
    agreement too.
    """
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedAccuracyRestorerParameters

    data = calibration.arrays()
    reference = compile_fp32(ov_model)
    labels = [labels_of(reference(window)[0]) for window in data]
    checks = [(data[i], labels[i]) for i in validation_windows(labels)]
    full_runs = 0  # runs on every validation window (the others rank on a few)

    def agreement_on(compiled, items) -> tuple[float, list[float]]:
        counts = [foreground_agreement(labels_of(compiled(window)[0]), expected) for window, expected in items]
        return pooled_agreement(counts), [e / t if t else 1.0 for e, t in counts]

    def validate(compiled, items) -> tuple[float, list[float]]:
        nonlocal full_runs
        pooled, each = agreement_on(compiled, items)
        if len(each) == len(checks):
            full_runs += 1
            if full_runs > 1:  # the first is fp32 itself
                say(f"openvino: accuracy control: int8 labels agree with fp32's on {pooled:.2%} of the "
                    "validation windows' foreground")
        return pooled, each

    ignored, advanced = static_quantization(calibration.overflow_fix)
    say(f"openvino: int8 accuracy control on {len(checks)} windows (foreground agreement with fp32 >= "
        f"{1 - MAX_AGREEMENT_DROP:.1%}); this runs the network many times, once per checkpoint and window shape")
    logger = logging.getLogger("nncf")  # its INFO lines (one per ignored norm, the ranking) stay quiet
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        quantized = nncf.quantize_with_accuracy_control(
            ov_model, nncf.Dataset(data), nncf.Dataset(checks), validate, max_drop=MAX_AGREEMENT_DROP,
            subset_size=len(data), ignored_scope=ignored, advanced_quantization_parameters=advanced,
            advanced_accuracy_restorer_parameters=AdvancedAccuracyRestorerParameters(
                ranking_subset_size=RANKING_WINDOWS, max_num_iterations=MAX_STEPS))
    finally:
        logger.setLevel(level)
    kept, total = float_convolutions(quantized)
    # measured again on what is returned: NNCF's last run may be of a step it took back
    agreement, _ = agreement_on(compile_fp32(quantized), checks)  # its int8 layers stay int8
    line = (f"openvino: int8 on {total - kept} of {total} convolutions, {kept} kept in fp32; foreground "
            f"agreement with fp32 on the validation windows {agreement:.2%}")
    if agreement < 1 - MAX_AGREEMENT_DROP:
        line += (f", below the {1 - MAX_AGREEMENT_DROP:.1%} asked for: int8 changes this network's labels "
                 "(fp32: --backend openvino without --int8)")
    say(line)
    return quantized


def validation_windows(labels: Sequence[np.ndarray]) -> list[int]:
    """The indices of the windows int8 is checked on: those whose fp32 ``labels`` hold kidney
    or tumour (all when none does), at most ``VALIDATION_WINDOWS``, evenly spaced."""
    chosen = [i for i, window in enumerate(labels) if (window > 0).any()] or list(range(len(labels)))
    return spread(chosen, VALIDATION_WINDOWS)


def static_quantization(overflow_fix: str, keep_fp32: Sequence[str] = ()) -> tuple:
    """``(ignored_scope, advanced_parameters)`` for NNCF: the norms' inputs float, activation
    ranges from the extremes over all windows, NNCF's overflow fix on every layer (``"enable"``)
    or the first; ``keep_fp32``: names of convolutions (the PyTorch module path, as
    ``upsample.3.conv1.0.skip``) left in fp32 as well."""
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters
    from nncf.quantization.range_estimator import RangeEstimatorParametersSet

    ignored = nncf.IgnoredScope(types=list(FLOAT_INPUT_OPERATIONS), validate=False,
                                patterns=[rf".*__module\.{re.escape(name)}/aten::.*" for name in keep_fp32])
    return ignored, AdvancedQuantizationParameters(
        overflow_fix=nncf_overflow_fix(overflow_fix),
        activations_range_estimator_params=RangeEstimatorParametersSet.MINMAX)


def nncf_overflow_fix(overflow_fix: str):
    """NNCF's ``OverflowFix`` for a :class:`CalibrationSet`'s ``overflow_fix``."""
    from nncf.quantization.advanced_parameters import OverflowFix

    return OverflowFix.ENABLE if overflow_fix == "enable" else OverflowFix.FIRST_LAYER


def labels_of(logits) -> np.ndarray:
    """The argmax over the classes of ``logits`` ``(1, K, D, H, W)``."""
    return np.asarray(logits).argmax(1)


def pooled_agreement(counts: Sequence[tuple[int, int]]) -> float:
    """The fraction equal over all of ``counts``' (equal, total) pairs; 1 when no voxel counts."""
    total = sum(t for _, t in counts)
    return sum(e for e, _ in counts) / total if total else 1.0


def float_convolutions(ov_model) -> tuple[int, int]:
    """(convolutions whose input is not int8-quantised, all convolutions) of ``ov_model``."""
    kinds = {"Convolution", "ConvolutionBackpropData", "GroupConvolution"}
    convolutions = [op for op in ov_model.get_ops() if op.get_type_name() in kinds]
    kept = sum(op.input(0).get_source_output().get_node().get_type_name() != "FakeQuantize" for op in convolutions)
    return kept, len(convolutions)
