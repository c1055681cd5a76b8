"""``--exec_mode predict``: raw CT scans -> segmentation NIfTI files in each scan's own grid.

Per scan (:func:`segment_scan`): read into the KiTS19 layout the network was trained in
(:mod:`data_loading.scan_io`: any orientation; NIfTI, NRRD, MHA/MHD, a DICOM series), preprocess
exactly as ``preprocess_dataset.py``, slide predict's window over the volume
(:func:`runtime.inference.sliding_window.flush_sliding_window_inference`: the evaluator's windows and
Gaussian weights, ``--val_input_shape``, ``--overlap``, ``--sw_batch_size``, the last window of each axis
flush with the edge so that every voxel is scored; ``--tta`` adds the 8 flips), softmax, back to the scan's grid
and its own axes (:mod:`data_loading.scans`), write uint8 labels with the scan's affine and header;
with ``--preview``, a PNG drawn after the segmentation is safe; with ``--save_probabilities``,
``<case>.npz`` (the softmax on the scan's grid and axes, whose argmax is the segmentation).
The steps from a volume read to its labels (:func:`segment_volume`) are the ones the Python
entry point :class:`runtime.predict.api.Segmenter` runs for files and arrays alike.
A failure to write names the output file (:class:`OutputWriteError`).

The folder (scans shared between ranks, each isolated, the lock, the summary) is
:mod:`runtime.predict.folder`'s.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from data_loading.atomic import atomic_write
from data_loading.scan_checks import AIR_HU, check_ct_intensities
from data_loading.scans import (RawScan, Scan, ScanGeometry, class_volumes_ml, crop_padding, labels_in_original_grid,
                                output_path, preprocess_scan, read_label, read_labels_file, read_scan,
                                write_segmentation)
from data_loading.write_errors import is_full_disk, write_or_raise
from runtime.build import build_model
from runtime.checkpoint import Saved, load_model_weights, model_state_from, weights_description
from runtime.outputs import OutputError
from runtime.plan import InferencePlan, NetworkPlan
from runtime.predict.records import CaseResult, Status, own_label_numbers
from runtime.signals import Stopped
from runtime.inference.sliding_window import flush_sliding_window_inference


# ----------------------------------------------------------------------------- the model


def load_trained_model(network: NetworkPlan, saved: Saved, device: torch.device,
                       say: Callable[[str], None] | None = None, channels_last: bool = False) -> torch.nn.Module:
    """The plan's ``network`` with ``saved``'s weights, in eval mode (channels-last with
    ``channels_last``); ``say`` is told which weights were loaded (the best, or the last ones
    before any evaluation)."""
    model = build_model(network, device, channels_last=channels_last)
    load_model_weights(model, model_state_from(saved.checkpoint, prefer="best"), saved.path)
    if say is not None:
        say(f"weights: {weights_description(saved.checkpoint)} of {saved.path}")
    return model.eval()


def volume_probabilities(predict: Callable[[torch.Tensor], torch.Tensor], image: np.ndarray,
                         inference: InferencePlan, device: torch.device,
                         probabilities_out: bool = False) -> torch.Tensor:
    """Class probabilities (3, D, H, W) float32 of one preprocessed image (1, D, H, W).

    ``predict`` maps windows to logits, or to probabilities when ``probabilities_out`` (TTA):
    predict's sliding window (:func:`runtime.inference.sliding_window.flush_sliding_window_inference`:
    every voxel scored, the last window of each axis flush with the edge, no constant slab)
    averages what it returns (Gaussian-weighted) and the softmax follows for logits.
    """
    volume = torch.from_numpy(np.ascontiguousarray(image))[None].to(device)
    with torch.no_grad():
        out = flush_sliding_window_inference(predict, volume, inference.window, inference.overlap,
                                             inference.window_batch)[0]
    if tuple(out.shape[1:]) != tuple(image.shape[1:]):
        raise AssertionError(f"sliding window returned {tuple(out.shape[1:])} for {tuple(image.shape[1:])}")
    return out if probabilities_out else torch.softmax(out, dim=0)


class ScanInference:
    """``preprocessed image (1, D, H, W) -> probabilities (3, D, H, W)`` with the window
    predictor ``predict`` (:func:`runtime.inference.predictor.build_predictor`); ``windows``: how many
    windows the last call ran through ``predict`` (counted as they pass, a TTA window once)."""

    def __init__(self, predict: Callable[[torch.Tensor], torch.Tensor], inference: InferencePlan, device: torch.device):
        self.predict, self.inference, self.device = predict, inference, device
        self.windows = 0

    def _counted(self, batch: torch.Tensor) -> torch.Tensor:
        self.windows += batch.shape[0]
        return self.predict(batch)

    def __call__(self, image: np.ndarray) -> torch.Tensor:
        self.windows = 0
        return volume_probabilities(self._counted, image, self.inference, self.device,
                                    probabilities_out=self.inference.tta)


class EnsembleInference:
    """The mean of several :class:`ScanInference` (one per checkpoint: each its softmax, or its
    TTA-averaged softmax, on the whole volume); ``windows``: all of theirs."""

    def __init__(self, members: Sequence[ScanInference]):
        self.members = list(members)
        self.windows = 0

    def __call__(self, image: np.ndarray) -> torch.Tensor:
        total = None
        for member in self.members:
            probabilities = member(image)
            total = probabilities if total is None else total.add_(probabilities)
        self.windows = sum(member.windows for member in self.members)
        return total / len(self.members)


# ----------------------------------------------------------------------------- a volume's labels


@dataclass
class Segmentation:
    """One volume segmented: ``labels`` uint8 on the input's own grid and axes; ``probabilities``
    float32 (3, *labels.shape), the softmax there (classes first; ``labels`` is their argmax,
    ties to the lower class), when asked for, else None; ``nifti`` the NIfTI image (affine,
    header) the labels are written with, for a file (None for an array); ``kits_labels`` the
    labels in the KiTS19 layout; ``windows`` how many windows the network(s) ran on."""

    labels: np.ndarray
    probabilities: np.ndarray | None = None
    nifti: object = None
    kits_labels: np.ndarray | None = None
    windows: int | None = None

    @property
    def affine(self) -> np.ndarray | None:
        return None if self.nifti is None else self.nifti.affine


def probabilities_in_original_grid(probabilities: torch.Tensor, geometry: ScanGeometry) -> torch.Tensor:
    """Class probabilities (C, D', H', W') on the padded grid -> (C, D, H, W) float32 on the
    original grid: each class map resampled exactly as
    :func:`data_loading.scans.labels_in_original_grid` resamples it, so that their argmax (first
    maximum) is its labels."""
    from torch.nn.functional import interpolate

    probabilities = crop_padding(probabilities, geometry)
    if tuple(probabilities.shape[1:]) == geometry.original:
        return probabilities.float()
    return torch.stack([interpolate(probabilities[c][None, None].float(), size=geometry.original, mode="trilinear",
                                    align_corners=True)[0, 0] for c in range(probabilities.shape[0])])


def air_slices(image: np.ndarray) -> tuple[int, int]:
    """How many slices at the start and at the end of axis 0 (the slices) of ``image``
    (D, H, W, HU) hold nothing but air (no voxel above :data:`AIR_HU`); (0, 0) when every slice
    does (:func:`data_loading.scan_checks.check_ct_intensities` refuses such a scan)."""
    solid = np.flatnonzero(image.max(axis=(1, 2)) > AIR_HU)
    if solid.size == 0:
        return 0, 0
    return int(solid[0]), int(image.shape[0] - 1 - solid[-1])


def with_air_slices(array: np.ndarray, before: int, after: int) -> np.ndarray:
    """Labels (D, H, W) or class probabilities (C, D, H, W) with ``before`` and ``after`` slices
    of background put back on the slice axis (label 0; probability 1 for class 0, 0 for the others)."""
    if not before and not after:
        return array
    out = np.pad(array, [(0, 0)] * (array.ndim - 3) + [(before, after), (0, 0), (0, 0)])
    if array.ndim == 4:
        out[0, :before] = 1
        out[0, out.shape[1] - after:] = 1
    return out


def segment_volume(raw: RawScan, infer: Callable[[np.ndarray], torch.Tensor], timer: "StageTimer",
                   probabilities: bool = False, path: str = "",
                   target: Sequence[float] | None = None) -> Segmentation:
    """A scan read into the KiTS19 layout (``raw``) -> its :class:`Segmentation` on its own grid
    and axes: preprocess, ``infer`` (preprocessed image -> class probabilities), back to the
    original grid and axes (with ``probabilities``, the probabilities too). ``target``: the
    spacing the network was trained at (the plan's ``target_spacing``; None: KiTS19's). A volume that
    does not look like CT in HU is refused first (:func:`data_loading.scan_checks.check_ct_intensities`:
    ``ScanError``, one line naming ``path``).

    Whole slices of air at either end of the slice axis (:func:`air_slices`: beyond the
    patient; the network never saw such a slice in training) are background and are not read:
    each window normalises itself by its own statistics, so slabs of air inside the windows
    would change the labels they give inside the body. In-plane, the scan is read whole (the air
    around the body is what the network was trained with).
    """
    with timer("preprocess"):
        check_ct_intensities(raw.image, path or "array")
        before, after = air_slices(raw.image[0])
        body = replace(raw, image=raw.image[:, before:raw.image.shape[1] - after]) if before or after else raw
        image, geometry = preprocess_scan(body, path) if target is None else preprocess_scan(body, path, target)
    with timer("infer"):
        out = infer(image)
    windows = getattr(infer, "windows", None)  # ScanInference counts them
    del image
    kept = None
    with timer("restore"):
        if probabilities:
            grid = probabilities_in_original_grid(out, geometry)
            labels = grid.argmax(0).to(torch.uint8).cpu().numpy()
            grid = with_air_slices(grid.cpu().numpy(), before, after)
            kept = np.stack([raw.to_file(p) for p in grid]) if raw.orientation is not None else grid
            del grid
        else:
            labels = labels_in_original_grid(out, geometry)
        labels = with_air_slices(labels, before, after)
        file_labels = raw.to_file(labels)  # the file's own axes (the same array when unmoved)
    return Segmentation(file_labels, kept, raw.nifti, labels, windows)


def probabilities_path(output_dir: str, scan: Scan) -> str:
    """``output_dir/<case>.npz``, nnU-Net's name for the saved probabilities."""
    return os.path.join(output_dir, f"{scan.name}.npz")


def write_probabilities(path: str, probabilities: np.ndarray) -> None:
    """``probabilities`` (C, *shape) as ``path``: compressed ``.npz``, key ``probabilities``,
    float16, written atomically."""
    data = np.asarray(probabilities, dtype=np.float16)
    atomic_write(path, lambda handle: np.savez_compressed(handle, probabilities=data))


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


def label_values_of(label_set, truth: bool = False) -> dict:
    """``label_values`` for :func:`data_loading.scans.read_label` of a network's label set
    (``runtime.labels``; none: KiTS19's, the readers' default); a ``truth`` may also hold the
    data's ignore label (its voxels are not scored), a segmentation never does."""
    if label_set is None:
        return {}
    values = tuple(value for _, value in label_set.labels)
    return {"label_values": values + ((label_set.ignore,) if truth and label_set.ignore is not None else ())}


def scored_result(scan: Scan, status: Status, labels: np.ndarray, truth: np.ndarray | None,
                  spacing: Sequence[float], seconds: float | None = None, stages: dict | None = None,
                  label_set=None) -> CaseResult:
    """A :class:`CaseResult` from the labels on the scan's grid (and the ground truth).
    ``label_set``: the network's (``runtime.labels``; None: KiTS19's); another than KiTS19's
    gives each label's volume and Dice under its name (:func:`runtime.predict.records.own_label_numbers`)."""
    if label_set is not None and not label_set.benchmark_data:
        result = CaseResult(scan.name, status, scan.image_path, tuple(int(s) for s in labels.shape),
                            tuple(float(s) for s in spacing), seconds=seconds,
                            stages=stages if stages is not None else {})
        result.per_label = own_label_numbers(labels, truth, spacing, label_set)
        if truth is not None:
            result.mean_dice = result.per_label["mean_dice"]
        return result
    kidney_ml, tumour_ml = class_volumes_ml(labels, spacing)
    result = CaseResult(scan.name, status, scan.image_path, tuple(int(s) for s in labels.shape),
                        tuple(float(s) for s in spacing), kidney_ml, tumour_ml, seconds,
                        stages=stages if stages is not None else {})
    if truth is not None:
        result.score(labels, truth)
    return result


class VolumeSegmenter(Protocol):
    """What :func:`segment_scan` asks of :class:`runtime.predict.api.Segmenter` (which imports
    this module, so it is named here by what it does)."""

    def segment_raw(self, raw: RawScan, probabilities: bool = False, path: str = "",
                    timer: StageTimer | None = None, calibration=None) -> Segmentation: ...


def segment_scan(scan: Scan, segmenter: VolumeSegmenter, output_dir: str,
                 preview: bool = False, timer: StageTimer | None = None, probabilities: bool = False,
                 calibration=None, label_set=None) -> CaseResult:
    """Segment one scan into ``output_dir/<case>.nii.gz`` (and ``<case>.png`` with ``preview``,
    ``<case>.npz`` with ``probabilities``: :func:`write_probabilities`).

    ``segmenter`` (:class:`runtime.predict.api.Segmenter`; a bare window inference:
    ``Segmenter.from_inference``) segments the volume, int8 on ``calibration`` when given (its
    ``calibration_for`` the scan); the windows its network(s) ran go to the result. The
    probabilities are written before the segmentation, whose existence marks the case done; a
    preview that cannot be drawn is the result's ``error``, never the loss of the segmentation.
    """
    timer = timer or StageTimer()
    start = time.perf_counter()
    with timer("read"):
        raw = read_scan(scan.image_path)  # in the KiTS19 layout the network was trained in
        truth = (read_label(scan.label_path, raw.file_shape, raw.orientation, scan.image_path,
                            **label_values_of(label_set, truth=True)) if scan.label_path else None)
    if raw.note:  # the header's pixdim disagrees with its affine: which spacing was used
        print(raw.note, flush=True)
    segmentation = segmenter.segment_raw(raw, probabilities, scan.image_path, timer, calibration=calibration)
    file_labels = segmentation.labels
    path = output_path(output_dir, scan)
    with timer("write"):
        if probabilities:
            npz = probabilities_path(output_dir, scan)
            write_output(npz, lambda: write_probabilities(npz, segmentation.probabilities))
            segmentation.probabilities = None
        write_output(path, lambda: write_segmentation(path, file_labels, raw.nifti))
    result = scored_result(scan, Status.SEGMENTED, file_labels, truth, raw.file_spacing or raw.spacing,
                           stages=timer.seconds, label_set=label_set)
    result.windows = segmentation.windows
    if preview:
        with timer("preview"):
            draw_preview(result, os.path.join(output_dir, f"{scan.name}.png"), raw.image[0], segmentation.kits_labels,
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


def summarise_existing(scan: Scan, path: str, label_set=None) -> CaseResult:
    """The summary of a scan whose segmentation ``path`` exists already (skipped, no --force)."""
    labels, spacing = read_labels_file(path, **label_values_of(label_set))
    truth = (read_label(scan.label_path, labels.shape, scan_path=scan.image_path, **label_values_of(label_set, True))
             if scan.label_path else None)
    return scored_result(scan, Status.SKIPPED, labels, truth, spacing, label_set=label_set)
