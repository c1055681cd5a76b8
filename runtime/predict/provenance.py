"""What made each segmentation of predict: a record beside it, and whether an output can be reused.

``<case>.provenance.json`` beside ``<case>.nii.gz`` holds :data:`FIELDS`: the project's version
(``runtime.__version__``), the checkpoint's path and the sha256 of the weights predict loaded
from it, the backend that ran the network (torch or openvino), ``--int8``, the digest of its
calibration set and what it was (``int8_calibration_set``: this scan alone, or the path
``--int8_calibration`` named), the ``--amp`` type,
``--tta``, the sliding window's shape and overlap, the sha256 of the input scan (of the
files that make it), and with ``--save_probabilities`` the name of ``<case>.npz``. An ensemble's
record lists every checkpoint's path and weights digest, in order. An existing
output is reused only when its record holds this run's value of every field of :data:`MADE_BY`
(everything but the checkpoint's path: the same weights moved elsewhere make the same
segmentation); otherwise it is segmented again (:func:`difference` says why).

How records are written, and what predict may replace or remove on their word, is
:mod:`runtime.predict.ledger`'s.
"""
from __future__ import annotations

import json
import os


from data_loading.scans import RECORD_SUFFIX, is_record
from runtime import __version__
from runtime.plan import RunPlan

# What made a segmentation: an output is reused only when its record has this run's values.
MADE_BY = ("version", "weights_sha256", "backend", "int8", "int8_calibration", "amp", "tta", "window_shape", "overlap",
           "input_sha256")
# Fields added after records were first written, with the value an older record means.
ADDED_LATER = {"int8_calibration": ""}
_ABSENT = object()
# Every field of a record, in the order of the summary's columns.
FIELDS = ("version", "checkpoint", "weights_sha256", "backend", "int8", "int8_calibration", "int8_calibration_set",
          "amp", "tta", "window_shape", "overlap", "input_sha256", "probabilities")


def run_fields(plan: RunPlan, calibration=None, calibrated_on: str = "") -> dict:
    """The fields of :data:`FIELDS` this run of a resolved, backend-chosen ``plan`` gives a
    scan (``calibration``: the int8 calibration set it is segmented with, and ``calibrated_on``
    what that set is for the record: ``"this scan"``, the path ``--int8_calibration`` named, or
    "" without ``--int8``: :mod:`runtime.predict.calibration`), but ``input_sha256`` (the scan's
    own) and ``probabilities`` (the name of the saved probabilities, only when
    ``--save_probabilities`` wrote them). An ensemble's ``checkpoint`` and ``weights_sha256`` are
    lists, every checkpoint's in order (one checkpoint: strings)."""
    inference, precision = plan.inference, plan.precision
    if len(inference.checkpoints) > 1:
        checkpoint = [os.path.abspath(path) for path in inference.checkpoints]
        weights = list(inference.ensemble_sha256)
    else:
        checkpoint = os.path.abspath(inference.checkpoint) if inference.checkpoint else ""
        weights = inference.weights_sha256
    return {"version": __version__, "checkpoint": checkpoint,
            "weights_sha256": weights, "backend": inference.backend, "int8": bool(precision.int8),
            "int8_calibration": calibration.digest() if calibration is not None else "",
            "int8_calibration_set": calibrated_on,
            "amp": precision.amp_dtype if precision.amp else "off", "tta": bool(inference.tta),
            "window_shape": [int(s) for s in inference.window], "overlap": float(inference.overlap)}


def record_path(output: str) -> str:
    """The record of the segmentation ``output`` (``<case>.nii.gz`` -> ``<case>.provenance.json``)."""
    for suffix in (".nii.gz", ".nii"):
        if output.endswith(suffix):
            return output[: -len(suffix)] + RECORD_SUFFIX
    return output + RECORD_SUFFIX


def read_record(path: str) -> tuple[dict | None, str]:
    """``(record, "")``, or ``(None, why there is none)``."""
    try:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
    except FileNotFoundError:
        return None, "with no record of what made it"
    except (OSError, ValueError) as exc:
        return None, f"whose record {path} cannot be read ({type(exc).__name__})"
    if not is_record(record):
        return None, f"whose record {path} holds no record"
    return record, ""


def short(digest) -> str:
    """A digest (or an ensemble's list of them) cut to 12 characters each, joined by ``+``."""
    return "+".join(str(v)[:12] for v in digest) if isinstance(digest, list) else str(digest)[:12]


def _text(name: str, value) -> str:
    if name.endswith("sha256") and isinstance(value, (list, str)):
        return short(value)
    return "x".join(map(str, value)) if isinstance(value, list) else str(value)


def difference(stored: dict | None, why_none: str, current: dict) -> str | None:
    """None when ``stored`` (a record read back; None: ``why_none``) says its output was made the
    way ``current`` would make it, else why not, as a phrase about the earlier output:
    "made with window_shape 128x128x128, not 64x64x64"."""
    if stored is None:
        return why_none
    for name in MADE_BY:
        value = stored.get(name, ADDED_LATER.get(name, _ABSENT))
        if value is _ABSENT:
            return f"whose record has no {name}"
        if value != current[name]:
            return f"made with {name} {_text(name, value)}, not {_text(name, current[name])}"
    return None
