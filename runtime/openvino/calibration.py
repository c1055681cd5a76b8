"""int8 for the OpenVINO backend: NNCF post-training quantisation on training windows.

The calibration set is at most ``CALIBRATION_WINDOWS`` windows of the training cases of
``--data_dir`` (the preprocessed ``case_XXXXX_x.npy`` files whose ids are not in
evaluation_cases.txt), taken where the sliding window puts them: every case's windows at
half-window steps over the whole volume, and from that list of all windows of all cases, evenly
spaced ones (so the set holds background, borders and padded windows as inference does, not only
the organs). NNCF runs the fp32 network on them to fix each activation's int8 range (static
quantisation: every window then uses the same ranges), the range of each from the extremes over
all windows; weights per output channel. The inputs of the norms stay float (a convolution's
output before its instance norm has the scale of the window's content: one static range for it
clipped or wasted most of it). The set is recorded in the cache key: the case ids, a digest of
each image file, and the window origins.

Measured on two trained networks (docs/performance.md, "OpenVINO int8 on trained weights"):
windows centred on the organs and the inputs of the norms quantised, NNCF's defaults with the
earlier set, agreed with float on 96.7% and 98.3% of the foreground union; this set 99.4% and
99.2%, as close as PyTorch's int8 with per-window ranges.

Without VNNI (AVX2-only CPUs), x86 int8 kernels add pairs of uint8 x int8 products into a
saturating 16-bit value; NNCF's overflow fix (weights on 7 bits) then applies to every layer
instead of the first one only. Which one ran is in the key and in the log line.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from runtime.arguments import Config
from runtime.sliding_window import PAD_VALUE

CALIBRATION_WINDOWS = 24  # at most; NNCF runs the fp32 network once on each

NO_VNNI_ISAS = {"SSE41", "AVX", "AVX2", "AVX512_CORE"}  # ONEDNN_MAX_CPU_ISA values below VNNI
FLOAT_INPUT_OPERATIONS = ("MVN",)  # OpenVINO operations whose inputs NNCF leaves float
VNNI_FLAGS = {"avx512_vnni", "avx_vnni", "amx_int8"}


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(path) as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def int8_pairs_saturate(flags: set[str] | None = None, environ=os.environ) -> bool:
    """True when the CPU's int8 dot products go through saturating 16-bit pair sums: no VNNI
    in ``/proc/cpuinfo``, or oneDNN limited below it by ``ONEDNN_MAX_CPU_ISA`` (OpenVINO's CPU
    plugin honours it for its oneDNN kernels)."""
    flags = cpu_flags() if flags is None else flags
    limit = environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return not (flags & VNNI_FLAGS) or limit in NO_VNNI_ISAS


@dataclass(frozen=True)
class CalibrationWindow:
    case_id: str
    image_path: str
    image_sha256: str
    origin: tuple[int, ...]


@dataclass(frozen=True)
class CalibrationSet:
    data_dir: str
    roi: tuple[int, ...]
    windows: tuple[CalibrationWindow, ...]
    overflow_fix: str  # "enable" (all layers) or "first_layer"

    def fields(self) -> dict:
        return {"roi": list(self.roi), "overflow_fix": self.overflow_fix,
                "windows": [{"case": w.case_id, "sha256": w.image_sha256, "origin": list(w.origin)}
                            for w in self.windows]}

    def describe(self) -> str:
        ids = ", ".join(dict.fromkeys(w.case_id for w in self.windows))
        return (f"{len(self.windows)} training windows of {self.data_dir} (cases {ids}), "
                f"overflow fix on {'every layer (no VNNI)' if self.overflow_fix == 'enable' else 'the first layer'}")

    def arrays(self):
        """The windows ``(1, 1, *roi)`` float32, one at a time."""
        for window in self.windows:
            image = np.load(window.image_path, mmap_mode="r")
            yield window_at(image, window.origin, self.roi)[None]


def training_cases(data_dir: str):
    from data_loading.dataset import discover_cases, read_evaluation_ids, split_cases

    train, _ = split_cases(discover_cases(data_dir), read_evaluation_ids())
    return train


def calibration_unavailable(config: Config) -> str | None:
    """None when ``--data_dir`` holds training cases to calibrate int8 on, else why not."""
    from data_loading.dataset import DataError

    try:
        cases = training_cases(config.data_dir)
    except DataError as err:
        return f"--int8 calibrates on training windows of --data_dir: {err}"
    if not cases:
        return f"--int8 calibrates on training windows of --data_dir: {config.data_dir} has no training case"
    return None


def calibration_set(config: Config) -> CalibrationSet:
    roi = tuple(config.val_input_shape)
    every = [(case, origin) for case in training_cases(config.data_dir)
             for origin in grid_origins(case.shape, roi)]
    digests: dict[str, str] = {}
    windows = []
    for case, origin in spread(every, CALIBRATION_WINDOWS):
        if case.case_id not in digests:
            digests[case.case_id] = file_sha256(case.image_path)
        windows.append(CalibrationWindow(case.case_id, str(case.image_path), digests[case.case_id], origin))
    return CalibrationSet(os.path.abspath(config.data_dir), roi, tuple(windows),
                          "enable" if int8_pairs_saturate() else "first_layer")


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


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def window_at(image: np.ndarray, origin: Sequence[int], roi: Sequence[int]) -> np.ndarray:
    """``image (C, D, H, W)``'s window at ``origin``, padded with the sliding window's value
    where the volume is smaller than ``roi``."""
    cut = np.asarray(image[(slice(None), *(slice(o, o + r) for o, r in zip(origin, roi)))], dtype=np.float32)
    pad = [(0, 0)] + [(0, r - s) for r, s in zip(roi, cut.shape[1:])]
    return np.pad(cut, pad, constant_values=PAD_VALUE) if any(p for _, p in pad) else np.ascontiguousarray(cut)


def quantize(ov_model, calibration: CalibrationSet):
    """``ov_model`` quantised to int8 by NNCF on ``calibration``'s windows: activation ranges
    from the extremes over all windows (NNCF's default averages each window's extremes, which
    clips the windows of larger contrast), the norms' inputs kept float (``MVN``: instance and
    group norm in OpenVINO's graph)."""
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix
    from nncf.quantization.range_estimator import RangeEstimatorParametersSet

    fix = OverflowFix.ENABLE if calibration.overflow_fix == "enable" else OverflowFix.FIRST_LAYER
    data = list(calibration.arrays())
    advanced = AdvancedQuantizationParameters(
        overflow_fix=fix, activations_range_estimator_params=RangeEstimatorParametersSet.MINMAX)
    logger = logging.getLogger("nncf")  # one INFO line per ignored norm otherwise; warnings still show
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        return nncf.quantize(ov_model, nncf.Dataset(data), subset_size=len(data),
                             ignored_scope=nncf.IgnoredScope(types=list(FLOAT_INPUT_OPERATIONS), validate=False),
                             advanced_parameters=advanced)
    finally:
        logger.setLevel(level)
