"""int8 for the OpenVINO backend: NNCF post-training quantisation on a few training windows.

The calibration set is ``CALIBRATION_WINDOWS`` windows of the training cases of ``--data_dir``
(the preprocessed ``case_XXXXX_x.npy`` files whose ids are not in evaluation_cases.txt, first
ids first), one per case, each centred on the case's foreground (kidney and tumour; the
volume's centre when it has none) and padded like the sliding window pads. NNCF runs the fp32
network on them to fix each activation's int8 range (static quantisation: every window then
uses the same ranges), weights per output channel. The set is recorded in the cache key: the
case ids, a digest of each image file, and the window origins.

Without VNNI (AVX2-only CPUs), x86 int8 kernels add pairs of uint8 x int8 products into a
saturating 16-bit value; NNCF's overflow fix (weights on 7 bits) then applies to every layer
instead of the first one only. Which one ran is in the key and in the log line.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from runtime.arguments import Config
from runtime.sliding_window import PAD_VALUE

CALIBRATION_WINDOWS = 6

NO_VNNI_ISAS = {"SSE41", "AVX", "AVX2", "AVX512_CORE"}  # ONEDNN_MAX_CPU_ISA values below VNNI
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
        ids = ", ".join(w.case_id for w in self.windows)
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
    cases = training_cases(config.data_dir)[:CALIBRATION_WINDOWS]
    roi = tuple(config.val_input_shape)
    windows = tuple(CalibrationWindow(c.case_id, str(c.image_path), file_sha256(c.image_path),
                                      foreground_origin(np.load(c.label_path, mmap_mode="r"), roi))
                    for c in cases)
    return CalibrationSet(os.path.abspath(config.data_dir), roi, windows,
                          "enable" if int8_pairs_saturate() else "first_layer")


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def foreground_origin(label: np.ndarray, roi: Sequence[int]) -> tuple[int, ...]:
    """The origin of the ``roi`` window centred on the foreground's bounding box of ``label``
    ``(1, D, H, W)`` (the volume's centre without foreground), kept inside the volume where it
    fits (0 where the volume is smaller: it is padded)."""
    shape = label.shape[1:]
    nonzero = [np.flatnonzero(np.asarray(label[0]).any(axis=tuple(a for a in range(3) if a != axis)))
               for axis in range(3)]
    centres = [(n[0] + n[-1] + 1) // 2 if n.size else s // 2 for n, s in zip(nonzero, shape)]
    return tuple(int(min(max(c - r // 2, 0), max(s - r, 0))) for c, r, s in zip(centres, roi, shape))


def window_at(image: np.ndarray, origin: Sequence[int], roi: Sequence[int]) -> np.ndarray:
    """``image (C, D, H, W)``'s window at ``origin``, padded with the sliding window's value
    where the volume is smaller than ``roi``."""
    cut = np.asarray(image[(slice(None), *(slice(o, o + r) for o, r in zip(origin, roi)))], dtype=np.float32)
    pad = [(0, 0)] + [(0, r - s) for r, s in zip(roi, cut.shape[1:])]
    return np.pad(cut, pad, constant_values=PAD_VALUE) if any(p for _, p in pad) else np.ascontiguousarray(cut)


def quantize(ov_model, calibration: CalibrationSet):
    """``ov_model`` quantised to int8 by NNCF on ``calibration``'s windows."""
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix

    fix = OverflowFix.ENABLE if calibration.overflow_fix == "enable" else OverflowFix.FIRST_LAYER
    data = list(calibration.arrays())
    return nncf.quantize(ov_model, nncf.Dataset(data), subset_size=len(data),
                         advanced_parameters=AdvancedQuantizationParameters(overflow_fix=fix))
