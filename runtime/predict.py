"""``--exec_mode predict``: raw NIfTI CT scans -> segmentation NIfTI files in each scan's own grid.

Per scan (:func:`segment_scan`): read, preprocess exactly as ``preprocess_dataset.py``, slide
the evaluator's window over the volume (:func:`runtime.inference.sliding_window_inference`:
Gaussian weights, ``--val_input_shape``, ``--overlap``, ``--sw_batch_size``; ``--tta`` adds the 8
flips), softmax, back to the scan's grid (:mod:`data_loading.scans`), write uint8 labels with the
scan's affine and header. Cases are shared between ranks; the summary (``summary.csv``,
``summary.jsonl``) is written by rank 0 once every rank is done. A scan that fails is one line
on stderr; the others still run, and the exit code is 1 if any failed.
"""
from __future__ import annotations

import csv
import io
import itertools
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from data_loading.atomic import atomic_write
from data_loading.scans import (Scan, ScanError, class_volumes_ml, find_scans, labels_in_original_grid,
                                output_path, preprocess_scan, read_label, read_labels_file, read_scan,
                                write_segmentation)
from data_loading.windows import window_geometry
from model.losses import label_map_dice
from runtime import distributed as D
from model.inference import int8_available, prepare_for_inference
from runtime.arguments import Config, UsageError, replace
from runtime.backend import predict_model
from runtime.build import autocast_factory, build_model
from runtime.checkpoint import Saved, load_checkpoint, load_model_weights, model_state_from
from runtime.compiling import compile_model
from runtime.inference import PAD_VALUE, sliding_window_inference
from runtime.outputs import check_output_dir
from runtime.resolve import amp_dtype_for, architecture_from
from runtime.signals import PreemptionFlag
FLIPS = [dims for n in range(4) for dims in itertools.combinations((2, 3, 4), n)]  # 8, () first
SUMMARY_FIELDS = ("case", "status", "shape", "spacing", "kidney_ml", "tumour_ml", "seconds",
                  "kidney_dice", "tumour_dice", "mean_dice", "image", "error")
STAGES = ("read", "preprocess", "infer", "restore", "preview", "write")


@dataclass
class CaseResult:
    """One scan's outcome. ``status``: segmented, skipped (its output existed) or failed.
    ``shape`` (D, H, W) and ``spacing`` (mm) of the scan; volumes in mL from the labels on the
    original grid; Dice against the ground truth there when one lies beside the scan;
    ``stages`` the seconds of each step of :func:`segment_scan`."""

    case: str
    status: str
    image: str
    shape: tuple[int, ...] | None = None
    spacing: tuple[float, ...] | None = None
    kidney_ml: float | None = None
    tumour_ml: float | None = None
    seconds: float | None = None
    kidney_dice: float | None = None
    tumour_dice: float | None = None
    mean_dice: float | None = None
    error: str = ""
    stages: dict = field(default_factory=dict)

    def line(self) -> str:
        """One console line."""
        if self.status == "failed":
            return f"{self.case}: failed: {self.error}"
        text = (f"{self.case}: {self.status}, {'x'.join(map(str, self.shape))} voxels, "
                f"kidney {self.kidney_ml:.1f} mL, tumour {self.tumour_ml:.1f} mL")
        if self.mean_dice is not None:
            text += f", dice kidney {self.kidney_dice:.4f} tumour {self.tumour_dice:.4f}"
        return text + (f", {self.seconds:.1f} s" if self.seconds is not None else "")


# ----------------------------------------------------------------------------- the model


def model_architecture(config: Config, checkpoint: dict, path: str) -> Config:
    """``config`` with the network flags of the checkpoint (``runtime.resolve.architecture_from``:
    its saved config where there is one, unless a given flag differs, which is one line); batch
    norm for a sync-batch-norm network (the same weights; inference needs no cross-rank
    statistics)."""
    config = architecture_from(config, Saved(path, checkpoint, resume=False))
    return replace(config, normalization="batchnorm") if config.normalization == "syncbatchnorm" else config


def load_predict_model(config: Config, device: torch.device) -> tuple[torch.nn.Module, Config]:
    """The model of ``--load_ckpt_path`` in eval mode, and the config with its architecture."""
    checkpoint = load_checkpoint(config.load_ckpt_path)
    config = model_architecture(config, checkpoint, config.load_ckpt_path)
    if config.amp:
        config = replace(config, amp_dtype=amp_dtype_for(config.amp_dtype, device))
    model = build_model(config, device)
    load_model_weights(model, model_state_from(checkpoint, prefer="best"), config.load_ckpt_path)
    if config.int8 and device.type != "cpu":
        raise UsageError(f"--int8 runs on the CPU only; this run's device is {device.type}")
    if config.int8 and int8_available() is not None:
        raise UsageError(f"--int8: {int8_available()}")
    if config.channels_last or config.int8:
        # Instance norms that keep the channels-last layout (no copy back to NCDHW per layer),
        # in-place ReLU: the same logits up to rounding; with --int8 the 3x3x3 convolutions
        # in oneDNN int8 (docs/performance.md).
        model = prepare_for_inference(model, channels_last=True, int8=config.int8)
    model.eval()
    return compile_model(model, config.compile), config


def window_predictor(model: torch.nn.Module, config: Config,
                     device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """``windows (B, 1, *roi) -> (B, 3, *roi)``: the model's logits (in ``--amp`` autocast,
    ``--channels_last``), or with ``--tta`` the softmax averaged over the 8 flips of the
    three spatial axes (each flipped window's output flipped back)."""
    autocast, _ = autocast_factory(config, device)

    def logits_of(batch: torch.Tensor) -> torch.Tensor:
        if config.channels_last or config.int8:
            batch = batch.contiguous(memory_format=torch.channels_last_3d)
        with autocast():
            return model(batch).float()

    def mirrored_probabilities(batch: torch.Tensor) -> torch.Tensor:
        total = torch.softmax(logits_of(batch), dim=1)
        for dims in FLIPS[1:]:
            total += torch.softmax(logits_of(batch.flip(dims)), dim=1).flip(dims)
        return total / len(FLIPS)

    return mirrored_probabilities if config.tta else logits_of


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
    # the window needs a label to trim alongside; nothing is trimmed here, a broadcast zero does
    no_label = torch.zeros((1, 1, 1, 1, 1), dtype=torch.uint8, device=device).expand(1, 1, *volume.shape[2:])
    with torch.no_grad():
        out, _ = sliding_window_inference(predict, volume, no_label, config.val_input_shape, config.overlap,
                                          config.sw_batch_size)
    if tuple(out.shape[2:]) != tuple(volume.shape[2:]):
        raise AssertionError(f"sliding window returned {tuple(out.shape[2:])} for {tuple(volume.shape[2:])}")
    out = out[0][(..., *(slice(b, b + s) for (b, _), s in zip(padding, image.shape[1:])))]
    return out if probabilities_out else torch.softmax(out, dim=0)


def make_infer(model: torch.nn.Module, config: Config, device: torch.device) -> Callable[[np.ndarray], torch.Tensor]:
    """``preprocessed image (1, D, H, W) -> probabilities (3, D, H, W)`` with ``model``."""
    predict = window_predictor(model, config, device)
    return lambda image: volume_probabilities(predict, image, config, device, probabilities_out=config.tta)


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


def scored_result(scan: Scan, status: str, labels: np.ndarray, truth: np.ndarray | None,
                  spacing: Sequence[float], seconds: float | None = None, stages: dict | None = None) -> CaseResult:
    """A :class:`CaseResult` from the labels on the scan's grid (and the ground truth)."""
    kidney_ml, tumour_ml = class_volumes_ml(labels, spacing)
    result = CaseResult(scan.name, status, scan.image_path, tuple(int(s) for s in labels.shape),
                        tuple(float(s) for s in spacing), kidney_ml, tumour_ml, seconds, stages=stages or {})
    if truth is not None:
        result.kidney_dice, result.tumour_dice = label_map_dice(labels, truth)
        result.mean_dice = (result.kidney_dice + result.tumour_dice) / 2
    return result


def segment_scan(scan: Scan, infer: Callable[[np.ndarray], torch.Tensor], output_dir: str,
                 preview: bool = False, timer: StageTimer | None = None) -> CaseResult:
    """Segment one scan into ``output_dir/<case>.nii.gz`` (and ``<case>.png`` with ``preview``).

    ``infer`` maps the preprocessed image (1, D', H', W') to class probabilities (3, D', H', W').
    The preview is written before the segmentation, whose existence marks the case done.
    """
    timer = timer or StageTimer()
    start = time.perf_counter()
    with timer("read"):
        raw = read_scan(scan.image_path)
        truth = read_label(scan.label_path, raw.image.shape[1:]) if scan.label_path else None
    with timer("preprocess"):
        image, geometry = preprocess_scan(raw, scan.image_path)
    with timer("infer"):
        probabilities = infer(image)
    del image
    with timer("restore"):
        labels = labels_in_original_grid(probabilities, geometry)
    del probabilities
    if preview:
        from runtime.preview import write_preview

        with timer("preview"):
            write_preview(os.path.join(output_dir, f"{scan.name}.png"), raw.image[0], labels, truth, scan.name)
    with timer("write"):
        write_segmentation(output_path(output_dir, scan), labels, raw.nifti)
    return scored_result(scan, "segmented", labels, truth, raw.spacing, time.perf_counter() - start,
                         dict(timer.seconds))


def summarise_existing(scan: Scan, path: str) -> CaseResult:
    """The summary of a scan whose segmentation ``path`` exists already (skipped, no --force)."""
    labels, spacing = read_labels_file(path)
    truth = read_label(scan.label_path, labels.shape) if scan.label_path else None
    return scored_result(scan, "skipped", labels, truth, spacing)


# ----------------------------------------------------------------------------- many scans


def failure_message(scan: Scan, exc: BaseException) -> str:
    if isinstance(exc, OSError) and not isinstance(exc, ScanError):
        where = exc.filename or scan.image_path
        return f"{scan.image_path}: cannot write or read {where} ({exc.strerror or type(exc).__name__})"
    return str(exc).splitlines()[0] if str(exc) else f"{scan.image_path}: {type(exc).__name__}"


def predict_cases(scans: Sequence[Scan], infer: Callable, config: Config, show_progress: bool) -> list[CaseResult]:
    """Segment (or skip) each scan of this rank; a scan that fails is one stderr line naming it."""
    from tqdm import tqdm

    results = []
    # disable=None: a bar only on a terminal (or always with --verbose), never in captured logs
    bar = tqdm(scans, desc="predict", unit="scan", dynamic_ncols=True,
               disable=(None if not config.verbose else False) if show_progress else True)
    for scan in bar:
        path = output_path(config.output_dir, scan)
        try:
            if os.path.exists(path) and not config.force:
                result = summarise_existing(scan, path)
            else:
                result = segment_scan(scan, infer, config.output_dir, config.preview)
        except (ScanError, OSError) as exc:
            result = CaseResult(scan.name, "failed", scan.image_path, error=failure_message(scan, exc))
            tqdm.write(f"main.py: error: {result.error}", file=sys.stderr)
        else:
            tqdm.write(result.line(), file=sys.stdout)
        results.append(result)
    return results


def summary_rows(results: Sequence[CaseResult]) -> list[dict]:
    """One dict per case (``SUMMARY_FIELDS``), sorted by case, and a final ``mean`` row with the
    mean Dice over the cases that have a ground truth (when any has)."""
    rows = []
    for r in sorted(results, key=lambda r: r.case):
        row = {k: v for k, v in asdict(r).items() if k in SUMMARY_FIELDS}
        row["shape"] = list(r.shape) if r.shape else None
        row["spacing"] = list(r.spacing) if r.spacing else None
        rows.append(row)
    scored = [r for r in results if r.mean_dice is not None]
    if scored:
        mean = {k: None for k in SUMMARY_FIELDS}
        mean.update(case="mean", status=f"{len(scored)} cases", error="")
        for key in ("kidney_dice", "tumour_dice", "mean_dice"):
            mean[key] = float(np.mean([getattr(r, key) for r in scored]))
        rows.append(mean)
    return rows


def _csv_value(value) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return "x".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_summary(output_dir: str, results: Sequence[CaseResult]) -> None:
    """``summary.csv`` and ``summary.jsonl`` (same rows), each written atomically."""
    rows = summary_rows(results)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(SUMMARY_FIELDS)
    for row in rows:
        writer.writerow([_csv_value(row[k]) for k in SUMMARY_FIELDS])
    atomic_write(os.path.join(output_dir, "summary.csv"), lambda h: h.write(text.getvalue().encode()))
    lines = "".join(json.dumps(row) + "\n" for row in rows)
    atomic_write(os.path.join(output_dir, "summary.jsonl"), lambda h: h.write(lines.encode()))


def report(results: Sequence[CaseResult], output_dir: str) -> int:
    """Print the run's outcome; the exit code: 1 if any scan failed, else 0."""
    counts = {s: sum(r.status == s for r in results) for s in ("segmented", "skipped", "failed")}
    print(f"predict: {counts['segmented']} segmented, {counts['skipped']} skipped (output exists; --force "
          f"redoes them), {counts['failed']} failed of {len(results)} scans; "
          f"summary in {os.path.join(output_dir, 'summary.csv')}")
    scored = [r for r in results if r.mean_dice is not None]
    if scored:
        print(f"mean_dice {np.mean([r.mean_dice for r in scored]):.4f} over {len(scored)} cases with ground truth")
    failed = sorted(r.case for r in results if r.status == "failed")
    if failed:
        print(f"failed scans: {', '.join(failed)}")
    return 1 if failed else 0


def run_predict(config: Config) -> int:
    """``--exec_mode predict``; returns the exit code."""
    check_output_dir(config.output_dir, "--output_dir")
    scans = find_scans(config.input)
    if config.preview:
        from runtime.preview import matplotlib_missing

        if matplotlib_missing():
            raise UsageError("--preview needs matplotlib, which is not installed (pip install matplotlib)")
    dist_info = D.init_distributed(config.device, config.local_rank)
    preempt = PreemptionFlag(interrupt=True).install()  # SIGTERM: stop now (outputs are atomic)
    graceful = True
    try:
        model, config = predict_model(config, dist_info.device, load_predict_model, dist_info.is_main)
        infer = make_infer(model, config, dist_info.device)
        mine = scans[dist_info.rank::dist_info.world_size]
        results = predict_cases(mine, infer, config, show_progress=dist_info.is_main)
        everything = [r for part in D.all_gather_objects(results) for r in part]
        code = 0
        if dist_info.is_main:
            write_summary(config.output_dir, everything)
            code = report(everything, config.output_dir)
        return 1 if any(r.status == "failed" for r in everything) else code
    except BaseException:
        graceful = False
        raise
    finally:
        preempt.restore()
        D.cleanup(graceful)
