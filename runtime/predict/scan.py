"""``--exec_mode predict``: raw CT scans -> segmentation NIfTI files in each scan's own grid.

Per scan (:func:`segment_scan`): read into the KiTS19 layout the network was trained in
(:mod:`data_loading.scan_io`: any orientation; NIfTI, NRRD, MHA/MHD, a DICOM series), preprocess
exactly as ``preprocess_dataset.py``, slide the evaluator's window over the volume
(:func:`runtime.sliding_window.sliding_window_inference`: Gaussian weights, ``--val_input_shape``,
``--overlap``, ``--sw_batch_size``; ``--tta`` adds the 8 flips), softmax, back to the scan's grid
and its own axes (:mod:`data_loading.scans`), write uint8 labels with the scan's affine and header;
with ``--preview``, a PNG drawn after the segmentation is safe.
A failure to write names the output file (:class:`OutputWriteError`).

The folder (scans shared between ranks, each isolated, the lock, the summary) is
:mod:`runtime.predict.folder`'s.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from data_loading.scans import (Scan, class_volumes_ml, labels_in_original_grid,
                                output_path, preprocess_scan, read_label, read_labels_file, read_scan,
                                write_segmentation)
from data_loading.windows import window_geometry
from data_loading.write_errors import is_full_disk, write_or_raise
from runtime.arguments import Config
from runtime.build import build_model
from runtime.checkpoint import Saved, load_model_weights, model_state_from, weights_description
from runtime.outputs import OutputError
from runtime.predict.summary import CaseResult
from runtime.signals import Stopped
from runtime.sliding_window import PAD_VALUE, sliding_window_inference

STAGES = ("read", "preprocess", "infer", "restore", "write", "preview")


# ----------------------------------------------------------------------------- the model


def load_trained_model(config: Config, saved: Saved, device: torch.device,
                       say: Callable[[str], None] | None = None) -> torch.nn.Module:
    """The network of a resolved ``config`` with ``saved``'s weights, in eval mode; ``say`` is
    told which weights were loaded (the best, or the last ones before any evaluation)."""
    model = build_model(config, device)
    load_model_weights(model, model_state_from(saved.checkpoint, prefer="best"), saved.path)
    if say is not None:
        say(f"weights: {weights_description(saved.checkpoint)} of {saved.path}")
    return model.eval()


def cover_padding(shape: Sequence[int], roi: Sequence[int], overlap: float) -> tuple[tuple[int, int], ...]:
    """``(before, after)`` per axis that makes the evaluator's window cover every voxel.

    The benchmark's window trims a remainder below half a stride (those voxels get no score in
    evaluation); padding such an axis to a multiple of the stride leaves nothing to trim.
    """
    geometry = window_geometry(shape, roi, overlap)
    padding = []
    for size, stride, (cut_before, cut_after) in zip(shape, geometry.strides, geometry.trim):
        extra = (stride - size % stride) % stride if cut_before + cut_after else 0
        padding.append((extra // 2, extra - extra // 2))
    return tuple(padding)


def volume_probabilities(predict: Callable[[torch.Tensor], torch.Tensor], image: np.ndarray,
                         config: Config, device: torch.device, probabilities_out: bool = False) -> torch.Tensor:
    """Class probabilities (3, D, H, W) float32 of one preprocessed image (1, D, H, W).

    ``predict`` maps windows to logits, or to probabilities when ``probabilities_out`` (TTA):
    the sliding window averages what it returns (Gaussian-weighted) and the softmax follows
    for logits. The volume is first padded (with the evaluator's pad value) so that no voxel
    is trimmed, then cropped back.
    """
    padding = cover_padding(image.shape[1:], config.val_input_shape, config.overlap)
    volume = torch.from_numpy(np.ascontiguousarray(image))[None].to(device)
    volume = F.pad(volume, [p for pair in reversed(padding) for p in pair], value=PAD_VALUE)
    with torch.no_grad():
        out = sliding_window_inference(predict, volume, config.val_input_shape, config.overlap,
                                       config.sw_batch_size)
    if tuple(out.shape[2:]) != tuple(volume.shape[2:]):
        raise AssertionError(f"sliding window returned {tuple(out.shape[2:])} for {tuple(volume.shape[2:])}")
    out = out[0][(..., *(slice(b, b + s) for (b, _), s in zip(padding, image.shape[1:])))]
    return out if probabilities_out else torch.softmax(out, dim=0)


class ScanInference:
    """``preprocessed image (1, D, H, W) -> probabilities (3, D, H, W)`` with the window
    predictor ``predict`` (:func:`runtime.predictor.build_predictor`); ``windows``: how many
    windows the last call ran through ``predict`` (counted as they pass, a TTA window once)."""

    def __init__(self, predict: Callable[[torch.Tensor], torch.Tensor], config: Config, device: torch.device):
        self.predict, self.config, self.device = predict, config, device
        self.windows = 0

    def _counted(self, batch: torch.Tensor) -> torch.Tensor:
        self.windows += batch.shape[0]
        return self.predict(batch)

    def __call__(self, image: np.ndarray) -> torch.Tensor:
        self.windows = 0
        return volume_probabilities(self._counted, image, self.config, self.device,
                                    probabilities_out=self.config.tta)


# ----------------------------------------------------------------------------- one scan


class StageTimer:
    """Seconds per named stage (``with timer("infer"): ...``), summed if a stage repeats."""

    def __init__(self, sync: Callable[[], None] = lambda: None):
        self.seconds: dict[str, float] = {}
        self._sync = sync

    @contextmanager
    def __call__(self, stage: str):
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start


class OutputWriteError(OutputError):
    """An output file of predict that could not be written (``path``, ``reason``; ``full``:
    the disk is full, so the remaining scans are not run)."""

    def __init__(self, path: str, reason: str, full: bool):
        super().__init__(f"cannot write {path}: {reason}")
        self.path, self.reason, self.full = path, reason, full


def write_output(path: str, write: Callable[[], None]) -> None:
    """``write()`` (an atomic writer of ``path``); a failure to write becomes one
    :class:`OutputWriteError` naming ``path``, anything else is raised as it is."""
    write_or_raise(write, lambda reason, exc: OutputWriteError(path, reason, is_full_disk(exc)))


def scored_result(scan: Scan, status: str, labels: np.ndarray, truth: np.ndarray | None,
                  spacing: Sequence[float], seconds: float | None = None, stages: dict | None = None) -> CaseResult:
    """A :class:`CaseResult` from the labels on the scan's grid (and the ground truth)."""
    kidney_ml, tumour_ml = class_volumes_ml(labels, spacing)
    result = CaseResult(scan.name, status, scan.image_path, tuple(int(s) for s in labels.shape),
                        tuple(float(s) for s in spacing), kidney_ml, tumour_ml, seconds,
                        stages=stages if stages is not None else {})
    if truth is not None:
        result.score(labels, truth)
    return result


def segment_scan(scan: Scan, infer: Callable[[np.ndarray], torch.Tensor], output_dir: str,
                 preview: bool = False, timer: StageTimer | None = None) -> CaseResult:
    """Segment one scan into ``output_dir/<case>.nii.gz`` (and ``<case>.png`` with ``preview``).

    ``infer`` maps the preprocessed image (1, D', H', W') to class probabilities (3, D', H', W');
    its ``windows`` after the call (:class:`ScanInference`), when it has them, go to the result.
    The segmentation is written first (its existence marks the case done); a preview that
    cannot be drawn is the result's ``error``, never the loss of the segmentation.
    """
    timer = timer or StageTimer()
    start = time.perf_counter()
    with timer("read"):
        raw = read_scan(scan.image_path)  # in the KiTS19 layout the network was trained in
        truth = read_label(scan.label_path, raw.file_shape) if scan.label_path else None
    with timer("preprocess"):
        image, geometry = preprocess_scan(raw, scan.image_path)
    with timer("infer"):
        probabilities = infer(image)
    windows = getattr(infer, "windows", None)  # ScanInference counts them
    del image
    with timer("restore"):
        labels = labels_in_original_grid(probabilities, geometry)
        file_labels = raw.to_file(labels)  # the file's own axes (the same array when unmoved)
    del probabilities
    path = output_path(output_dir, scan)
    with timer("write"):
        write_output(path, lambda: write_segmentation(path, file_labels, raw.nifti))
    result = scored_result(scan, "segmented", file_labels, truth, raw.file_spacing or raw.spacing,
                           stages=timer.seconds)
    result.windows = windows
    if preview:
        with timer("preview"):
            draw_preview(result, os.path.join(output_dir, f"{scan.name}.png"), raw.image[0], labels,
                         None if truth is None else raw.to_kits(truth), raw.spacing)
    result.seconds = time.perf_counter() - start
    return result


def one_line_reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def draw_preview(result: CaseResult, path: str, image: np.ndarray, labels: np.ndarray,
                 truth: np.ndarray | None, spacing: Sequence[float] | None = None) -> None:
    """``--preview`` of the KiTS19-layout ``image``, ``labels`` and ``truth`` (``spacing`` mm
    per axis), after the segmentation is safe: any failure (a broken matplotlib, a full disk)
    becomes ``result.error``."""
    from runtime.predict.preview import write_preview

    try:
        write_output(path, lambda: write_preview(path, image, labels, truth, result.case, spacing))
    except OutputWriteError as exc:
        result.error, result.full_disk = f"preview not written: {exc}", exc.full
    except Stopped:  # a signal, not a preview problem
        raise
    except Exception as exc:  # noqa: BLE001 - matplotlib's own errors: one line, the segmentation is kept
        result.error = f"preview {path} not written: {one_line_reason(exc)} (the segmentation is written)"


def summarise_existing(scan: Scan, path: str) -> CaseResult:
    """The summary of a scan whose segmentation ``path`` exists already (skipped, no --force)."""
    labels, spacing = read_labels_file(path)
    truth = read_label(scan.label_path, labels.shape) if scan.label_path else None
    return scored_result(scan, "skipped", labels, truth, spacing)
