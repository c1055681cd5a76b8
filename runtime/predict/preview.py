"""``--preview``: one PNG per segmented scan, to check a result at a glance.

The axial slice (array axis 0) with the largest predicted tumour area (else kidney area, else the
middle slice), in the benchmark's CT window [-79, 304] HU, kidney and tumour drawn over it; the
ground truth beside it when there is one. matplotlib is optional: drawn with its object API and
the Agg canvas (no pyplot, no display, no global state).
"""
from __future__ import annotations

import importlib.util
import io

import numpy as np

from data_loading.atomic import atomic_write
from data_loading.preprocessing import CLIP_MAX, CLIP_MIN

# RGBA per label: background transparent, kidney red, tumour yellow
LABEL_COLOURS = np.array([[0, 0, 0, 0], [1.0, 0.2, 0.2, 0.45], [1.0, 0.9, 0.0, 0.6]], dtype=np.float32)


def matplotlib_missing() -> bool:
    return importlib.util.find_spec("matplotlib") is None


def preview_slice(labels: np.ndarray) -> int:
    """Index along axis 0 of ``labels`` (D, H, W) with the most tumour voxels, else the most
    kidney voxels, else the middle slice (ties: the first)."""
    for label in (2, 1):
        area = np.count_nonzero(labels == label, axis=(1, 2))
        if area.max(initial=0) > 0:
            return int(np.argmax(area))
    return labels.shape[0] // 2


def render_preview(image: np.ndarray, labels: np.ndarray, truth: np.ndarray | None, title: str) -> bytes:
    """PNG bytes: the chosen slice of ``image`` (D, H, W, HU) with ``labels`` over it, and with
    ``truth`` in a second panel when given."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    index = preview_slice(labels)
    panels = [("prediction", labels)] + ([("ground truth", truth)] if truth is not None else [])
    figure = Figure(figsize=(4.0 * len(panels), 4.4), dpi=100)
    FigureCanvasAgg(figure)
    for i, (name, segmentation) in enumerate(panels):
        axes = figure.add_subplot(1, len(panels), i + 1)
        axes.imshow(image[index], cmap="gray", vmin=CLIP_MIN, vmax=CLIP_MAX, interpolation="nearest")
        axes.imshow(LABEL_COLOURS[segmentation[index]], interpolation="nearest")
        axes.set_title(f"{name}, slice {index}", fontsize=9)
        axes.axis("off")
    figure.suptitle(f"{title}: kidney red, tumour yellow", fontsize=10)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def write_preview(path: str, image: np.ndarray, labels: np.ndarray, truth: np.ndarray | None, title: str) -> None:
    """:func:`render_preview` written atomically to ``path``."""
    png = render_preview(image, labels, truth, title)
    atomic_write(path, lambda handle: handle.write(png))
