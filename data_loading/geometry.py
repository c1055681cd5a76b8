"""Where each preprocessed case came from: a small JSON record beside its arrays.

``case_XXXXX_geometry.json`` holds the scan's original shape and spacing, the shape after
resampling to the target spacing, and the min-shape padding, so that a reader can tell the scan
from the padding in ``case_XXXXX_{x,y}.npy``. It is a separate file, not ``.npy``: the
benchmark's arrays, the reference's ``*_x.npy`` loader and the checksum verification of
``preprocess_dataset.py`` stay exactly as they are.

The record also states the two resampling rules of the benchmark's preprocessing, which put
the stored label up to about a voxel off the image (docs/reliability.md, "Two Dice numbers").
"""
from __future__ import annotations

import json
import os
from typing import Sequence

RECORD_SUFFIX = "_geometry.json"
RECORD_FORMAT = 1
IMAGE_RESAMPLING = "trilinear, align_corners=True: output i samples input i*(in-1)/(out-1)"
LABEL_RESAMPLING = "nearest (legacy): output i takes input floor(i*in/out)"


def record_path(results_dir: str, name: str) -> str:
    """``results_dir/<name>_geometry.json`` (``name``: ``case_XXXXX``)."""
    return os.path.join(results_dir, f"{name}{RECORD_SUFFIX}")


def geometry_record(name: str, shape: Sequence[int], spacing: Sequence[float], target: Sequence[float],
                    resampled: Sequence[int], padding: Sequence[Sequence[int]]) -> dict:
    """The record of one case (plain JSON types)."""
    padded = [int(s) + int(b) + int(a) for s, (b, a) in zip(resampled, padding)]
    return {"format": RECORD_FORMAT, "case": name,
            "original_shape": [int(s) for s in shape], "original_spacing": [float(s) for s in spacing],
            "target_spacing": [float(s) for s in target], "resampled_shape": [int(s) for s in resampled],
            "padding": [[int(b), int(a)] for b, a in padding], "padded_shape": padded,
            "image_resampling": IMAGE_RESAMPLING, "label_resampling": LABEL_RESAMPLING}


def record_bytes(record: dict) -> bytes:
    return (json.dumps(record, indent=1) + "\n").encode("utf-8")


def read_record(path: str) -> dict | None:
    """The record at ``path``, or None when there is none or it does not parse (the arrays are
    what the benchmark scores; a missing record only means no "inside the scan" number)."""
    try:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None
    keys = ("resampled_shape", "padding", "padded_shape")
    if not isinstance(record, dict) or any(not isinstance(record.get(k), list) for k in keys):
        return None
    return record


def scan_region(record: dict | None, stored_shape: Sequence[int]) -> tuple[slice, ...] | None:
    """Slices of the scan (padding excluded) in a stored volume of spatial ``stored_shape``;
    None without a record or when the record does not describe a volume of that shape."""
    if record is None or [int(s) for s in record["padded_shape"]] != [int(s) for s in stored_shape]:
        return None
    return tuple(slice(int(b), int(b) + int(s)) for (b, _), s in zip(record["padding"], record["resampled_shape"]))
