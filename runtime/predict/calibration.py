"""Predict's int8 calibration policy: the calibration set each scan is segmented with.

``--int8`` quantises the network on windows of scans
(:mod:`runtime.inference.openvino.calibration`). Which scans is decided once, in
:func:`runtime.resolve.resolve` (the plan's decision ``calibration``: what ``--int8_calibration``
asked, or nothing: each scan alone, so that a scan's result can be reproduced from that scan
alone). :func:`calibration_policy` turns that decision into the policy a
:class:`runtime.predict.api.Segmenter` holds:

- :class:`NoCalibration`: no ``--int8`` (fp32): no set;
- :class:`FixedCalibration`: the scans ``--int8_calibration`` names, read once when the policy is
  made: one set for every scan;
- :class:`PerScanCalibration`: each scan's own set, made when the scan comes.

Each answers :meth:`set_for` (the set a scan is segmented with: its ``digest()`` is recorded
beside the segmentation) and ``source`` (what the record says it calibrated on:
``"this scan"``, the absolute path ``--int8_calibration`` named, or ``""``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

from runtime.config import UsageError
from runtime.inference.backends import int8_calibration
from runtime.plan import InferencePlan, RunPlan

EACH_SCAN_ONLY = ("--int8 calibrates on each scan alone: segment a file (segment_file), or name the scans to "
                  "calibrate on once (int8_calibration)")


class CalibrationPolicy(Protocol):
    per_scan: bool  # a set per scan, made when the scan comes
    source: str  # for the record: "this scan", the path named, or "" (no --int8)

    def set_for(self, name: str | None, path: str | None):
        """The calibration set of the scan ``path`` (named ``name``; None: no scan file, an
        array), or None without ``--int8``."""


@dataclass(frozen=True)
class NoCalibration:
    """No ``--int8``: the networks compute fp32, nothing is calibrated."""

    per_scan = False
    source = ""

    def set_for(self, name: str | None = None, path: str | None = None):
        return None


@dataclass(frozen=True)
class FixedCalibration:
    """One calibration set for every scan: ``calibration`` (the backend's set, made once from the
    scans of ``path``, ``--int8_calibration`` as given)."""

    path: str
    calibration: object
    per_scan = False

    @property
    def source(self) -> str:
        return os.path.abspath(self.path)

    def set_for(self, name: str | None = None, path: str | None = None):
        return self.calibration


@dataclass(frozen=True)
class PerScanCalibration:
    """Each scan calibrated on alone (the default with ``--int8``): its set is made from the
    scan itself, by the plan's ``inference`` backend; an array, which is no scan file, has none
    (a :class:`runtime.config.UsageError` saying what to do)."""

    inference: InferencePlan
    per_scan = True
    source = "this scan"

    def set_for(self, name: str | None, path: str | None):
        if path is None:
            raise UsageError(EACH_SCAN_ONLY)
        return int8_calibration(self.inference, [(name, path)])


def calibration_policy(plan: RunPlan) -> CalibrationPolicy:
    """The policy of the resolved ``plan``'s decision ``calibration`` (none: no ``--int8``):
    the set ``--int8_calibration`` named (its scans found and read once, here), or each scan's
    own."""
    made = plan.decision("calibration")
    if made is None:
        return NoCalibration()
    if made.asked:  # --int8_calibration: the scans to calibrate on once
        from data_loading.scans import find_scans

        named = find_scans(made.asked)
        return FixedCalibration(made.asked, int8_calibration(plan.inference,
                                                             [(scan.name, scan.image_path) for scan in named]))
    return PerScanCalibration(plan.inference)
