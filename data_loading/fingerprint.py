"""A dataset's fingerprint, as nnU-Net's ``dataset_fingerprint.json``: what preprocessing read.

Per case (:func:`case_fingerprint`, from the arrays as read, before resampling): its spacing and
shape, the voxels of each label value, and the intensity statistics of its foreground (label > 0)
voxels: count, mean, std, min, max and the 0.5th, 50th and 99.5th percentiles (every foreground
voxel, no sampling). Over the dataset (:func:`dataset_fingerprint`): the spacings and shapes of
every case and their medians, the voxels and cases per label, and the foreground intensities:
mean, std, min and max exact over all foreground voxels (pooled from the cases' counts, means
and stds), the percentiles the median of the cases' (nnU-Net pools a sample of voxels instead;
per-case values let an interrupted run resume without reading its finished cases again).
"""
from __future__ import annotations

import math
import statistics
from typing import Sequence

import numpy as np

PERCENTILES = (0.5, 50.0, 99.5)
FORMAT = 1


def case_fingerprint(case, image: np.ndarray, label: np.ndarray, spacing: Sequence[float]) -> dict:
    """One case's entry: ``image`` float32 and ``label`` uint8, (1, D, H, W), as read;
    ``case``: the :class:`data_loading.preprocessing.RawCase` (its name, files, label values)."""
    counts = np.bincount(label.reshape(-1), minlength=len(case.label_values))
    foreground = image[label > 0].astype(np.float64)
    intensity = None
    if foreground.size:
        p_low, p_mid, p_high = np.percentile(foreground, PERCENTILES).tolist()
        intensity = {"voxels": int(foreground.size), "mean": float(foreground.mean()),
                     "std": float(foreground.std()), "min": float(foreground.min()),
                     "max": float(foreground.max()), "percentile_00_5": p_low,
                     "median": p_mid, "percentile_99_5": p_high}
    return {"case": case.name, "image": case.image_path, "label": case.label_path,
            "spacing": [float(s) for s in spacing], "shape": [int(s) for s in image.shape[1:]],
            "label_voxels": [int(c) for c in counts], "foreground_intensity": intensity}


def dataset_fingerprint(entries: Sequence[dict], labels: Sequence[tuple[str, int]],
                        target_spacing: Sequence[float], target_from: str) -> dict:
    """The dataset's fingerprint from its cases' entries (sorted by case); ``labels``: (name,
    value) pairs; ``target_spacing`` the spacing preprocessing resampled to, ``target_from``
    where it came from (``kits19``, ``description``, ``--target_spacing``, ``median``)."""
    entries = sorted(entries, key=lambda e: e["case"])
    spacings = [e["spacing"] for e in entries]
    shapes = [e["shape"] for e in entries]
    per_label = {}
    for name, value in labels:
        counts = [e["label_voxels"][value] if value < len(e["label_voxels"]) else 0 for e in entries]
        per_label[name] = {"value": value, "voxels": int(sum(counts)), "cases": sum(c > 0 for c in counts)}
    stats = [e["foreground_intensity"] for e in entries if e["foreground_intensity"]]
    intensity = None
    if stats:
        total = sum(s["voxels"] for s in stats)
        mean = sum(s["voxels"] * s["mean"] for s in stats) / total
        second = sum(s["voxels"] * (s["std"] ** 2 + s["mean"] ** 2) for s in stats) / total
        intensity = {"voxels": total, "mean": mean, "std": math.sqrt(max(0.0, second - mean * mean)),
                     "min": min(s["min"] for s in stats), "max": max(s["max"] for s in stats),
                     **{key: statistics.median(s[key] for s in stats)
                        for key in ("percentile_00_5", "median", "percentile_99_5")}}
    return {"format": FORMAT, "cases": len(entries),
            "spacings": spacings, "shapes": shapes,
            "median_spacing": [statistics.median(axis) for axis in zip(*spacings)] if spacings else [],
            "median_shape": [statistics.median(axis) for axis in zip(*shapes)] if shapes else [],
            "target_spacing": [float(s) for s in target_spacing], "target_spacing_from": target_from,
            "labels": per_label,
            # nnU-Net's key, one channel (CT); its percentiles: the median of the cases'
            "foreground_intensity_properties_per_channel": {"0": intensity} if intensity else {},
            "per_case": entries}


def fingerprint_lines(fingerprint: dict, described: bool = True) -> list[str]:
    """The fingerprint in a few printed lines; the target spacing's source in words
    (:func:`data_loading.description.spacing_source_text`; ``described`` False: KiTS19 without a
    description)."""
    from data_loading.description import CANONICAL_AXES, spacing_source_text

    def numbers(values, digits=3):
        return "(" + ", ".join(f"{v:.{digits}g}" for v in values) + ")"

    axes = f" (axes {CANONICAL_AXES}: slices, height, width)" if described else ""
    source = spacing_source_text(fingerprint["target_spacing_from"], described)
    lines = [f"fingerprint of {fingerprint['cases']} cases{axes}: median spacing "
             f"{numbers(fingerprint['median_spacing'])} mm, median shape {numbers(fingerprint['median_shape'], 6)}, "
             f"target spacing {numbers(fingerprint['target_spacing'])} mm ({source})"]
    intensity = fingerprint["foreground_intensity_properties_per_channel"].get("0")
    if intensity:
        lines.append(f"  foreground intensity: percentiles 0.5/50/99.5 {intensity['percentile_00_5']:.1f} / "
                     f"{intensity['median']:.1f} / {intensity['percentile_99_5']:.1f}, mean {intensity['mean']:.1f}, "
                     f"std {intensity['std']:.1f}")
    lines.append("  labels: " + ", ".join(f"{name} ({entry['value']}) {entry['voxels']} voxels in {entry['cases']} cases"
                                          for name, entry in fingerprint["labels"].items()))
    return lines
