"""``--preview``: one PNG per segmented scan, to check a result at a glance.

Drawn from the volume in the KiTS19 layout the network saw (array axes: slices running
Inferior, rows running Posterior, columns running Left; :mod:`data_loading.scan_io`), whatever
the file's own orientation, so the three views are true ones, in the radiological convention:
axial (``volume[k]``: anterior up, the patient's right on the left), coronal
(``volume[:, j]``: superior up, right on the left) and sagittal (``volume[:, :, i]``: superior
up, anterior on the left), each shown with its voxels' aspect ratio. Each view cuts through the
slice with the largest predicted tumour area (else kidney area, else the middle), in the
benchmark's CT window [-79, 304] HU, kidney and tumour drawn over it; the ground truth in a
second row when there is one. matplotlib is optional: drawn with its object API and the Agg
canvas (no pyplot, no display, no global state).
"""
from __future__ import annotations

import importlib.util
import io
from typing import Sequence

import numpy as np

from data_loading.atomic import atomic_write
from data_loading.preprocessing import CLIP_MAX, CLIP_MIN

# RGBA per label: background transparent, kidney red, tumour yellow; another label set's labels
# 3, 4, 5 (KiTS23's cyst: cyan) and, from 6 on, violet (runtime.labels)
LABEL_COLOURS = np.array([[0, 0, 0, 0], [1.0, 0.2, 0.2, 0.45], [1.0, 0.9, 0.0, 0.6], [0.2, 0.8, 1.0, 0.6],
                          [0.3, 1.0, 0.3, 0.6], [1.0, 0.5, 0.0, 0.6], [0.7, 0.3, 1.0, 0.6]], dtype=np.float32)
VIEWS = ("axial", "coronal", "sagittal")  # the KiTS19-layout axis each view cuts: 0, 1, 2


def matplotlib_missing() -> bool:
    return importlib.util.find_spec("matplotlib") is None


def preview_slice(labels: np.ndarray, axis: int = 0) -> int:
    """Index along ``axis`` of ``labels`` (D, H, W) with the most tumour voxels, else the most
    kidney voxels, else the middle slice (ties: the first)."""
    others = tuple(a for a in range(3) if a != axis)
    for label in (2, 1):
        area = np.count_nonzero(labels == label, axis=others)
        if area.max(initial=0) > 0:
            return int(np.argmax(area))
    return labels.shape[axis] // 2


def view(volume: np.ndarray, axis: int, index: int) -> np.ndarray:
    """The 2-D slice ``index`` across ``axis`` of a KiTS19-layout ``volume`` (D, H, W): axial
    (H, W), coronal (D, W) or sagittal (D, H); rows and columns as they are drawn."""
    return np.take(volume, index, axis=axis)


def aspect(spacing: Sequence[float] | None, axis: int) -> float:
    """Height over width of one pixel of the view across ``axis`` (1 without a spacing)."""
    if spacing is None:
        return 1.0
    rows, columns = (a for a in range(3) if a != axis)
    return float(spacing[rows]) / float(spacing[columns])


def render_preview(image: np.ndarray, labels: np.ndarray, truth: np.ndarray | None, title: str,
                   spacing: Sequence[float] | None = None) -> bytes:
    """PNG bytes: the axial, coronal and sagittal views of ``image`` (D, H, W, HU, KiTS19
    layout, ``spacing`` mm per axis) with ``labels`` over them, and ``truth`` in a second row
    when given."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    indices = [preview_slice(labels, axis) for axis in range(3)]
    rows = [("prediction", labels)] + ([("ground truth", truth)] if truth is not None else [])
    figure = Figure(figsize=(12.0, 4.2 * len(rows) + 0.4), dpi=100)
    FigureCanvasAgg(figure)
    for r, (name, segmentation) in enumerate(rows):
        for axis, index in enumerate(indices):
            axes = figure.add_subplot(len(rows), 3, 3 * r + axis + 1)
            ratio = aspect(spacing, axis)
            axes.imshow(view(image, axis, index), cmap="gray", vmin=CLIP_MIN, vmax=CLIP_MAX,
                        interpolation="nearest", aspect=ratio)
            shown = np.minimum(view(segmentation, axis, index), len(LABEL_COLOURS) - 1)
            axes.imshow(LABEL_COLOURS[shown], interpolation="nearest", aspect=ratio)
            axes.set_title(f"{name}, {VIEWS[axis]} {index}", fontsize=9)
            axes.axis("off")
    figure.suptitle(f"{title}: kidney red, tumour yellow (patient's right on the left)", fontsize=10)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def write_preview(path: str, image: np.ndarray, labels: np.ndarray, truth: np.ndarray | None, title: str,
                  spacing: Sequence[float] | None = None) -> None:
    """:func:`render_preview` written atomically to ``path``."""
    png = render_preview(image, labels, truth, title, spacing)
    atomic_write(path, lambda handle: handle.write(png))
