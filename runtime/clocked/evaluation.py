"""The benchmark's evaluation: every case's sliding-window logits scored, all ranks combined
(:func:`evaluate`), and a built network scored on the evaluation set between the MLPerf eval
events (:func:`run_evaluation`: training's evaluations and evaluate's one)."""
from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import torch
from mlperf_logging.mllog import constants as C

from data_loading.dataset import DataError
from data_loading.windows import region_in_trimmed
from runtime import checkpoint as ckpt
from runtime import distributed as D
from runtime.build import Components
from runtime.clocked.reporters import Reporters
from runtime.inference.predictor import build_predictor, options_from
from runtime.inference.sliding_window import flush_sliding_window_inference, sliding_window_inference, trim_like_window
from runtime.labels import KITS19_SET, LabelSet
from runtime.plan import RunPlan


def evaluate(predict: Callable[[torch.Tensor], torch.Tensor], volumes: Iterable, loss_fn, score_fn,
             roi: Sequence[int], overlap: float, sw_batch_size: int, device: torch.device, progress=None,
             cases: list | None = None, scan_region: Callable | None = None,
             label_set: LabelSet = KITS19_SET) -> dict[str, float]:
    """Evaluate the volumes of this rank and combine all ranks exactly.

    ``predict``: windows -> logits (:func:`runtime.inference.predictor.build_predictor`; the caller puts
    the model in eval mode). ``volumes`` yields ``(image, label, case_id)``. Per-case loss and
    Dice are summed on each rank, the sums and case counts are summed across ranks, then
    divided: every case weighs the same whatever the world size, and a rank with no case
    contributes zeros.

    ``label_set`` (``runtime.labels``): the keys of the Dice per label and what is scored. The
    benchmark's data: the benchmark's sliding window (its trimmed volume, padding included) and
    Dice (a label absent from both: 1.0), bit for bit the reference's. Own data: every voxel
    windowed as predict windows a scan (:func:`flush_sliding_window_inference`), then scored on
    the scan's own voxels only (``scan_region``: the min-shape padding preprocessing added is
    left out; a case without its region is a ``DataError``), nnU-Net's Dice (absent from both:
    NaN, left out of the means).

    ``cases``: a list that receives this rank's :func:`case_scores` per case (each a host sync;
    the sums do not change). ``scan_region(case_id, shape)``: the slices of the scan inside the
    stored volume (None: unknown), for the Dice inside the scan that ``case_scores`` adds.
    """
    keys = label_set.keys
    k = len(keys)
    # loss, the Dice sum of each label, the cases that score each label (NaN: absent from both,
    # own data only), cases
    sums = torch.zeros(2 + 2 * k, dtype=torch.float64, device=device)
    with torch.no_grad():
        for image, label, case_id in (progress(volumes) if progress else volumes):
            image = image.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            shape = tuple(image.shape[2:])
            region = scan_region(case_id, shape) if scan_region is not None else None
            if label_set.benchmark_data:
                logits = sliding_window_inference(predict, image, roi, overlap, sw_batch_size)
                label = trim_like_window(label, roi, overlap)
                inside = region and region_in_trimmed(region, shape, roi, overlap)
            else:
                if region is None:
                    raise DataError(f"case {case_id}: no case_{case_id}_geometry.json beside its arrays, so the scan's "
                                    "own voxels are unknown: preprocess the data again with preprocess_dataset.py")
                logits = flush_sliding_window_inference(predict, image, roi, overlap, sw_batch_size)
                logits, label = logits[(..., *region)], label[(..., *region)]
                inside = None  # the whole scored volume is the scan's
            loss, scores = loss_fn(logits, label).double(), foreground(score_fn(logits, label), k).double()
            sums[0] += loss
            sums[1:1 + k] += torch.nan_to_num(scores, nan=0.0)
            sums[1 + k:1 + 2 * k] += (~torch.isnan(scores)).double()
            sums[-1] += 1
            if cases is not None:
                if not label_set.benchmark_data:
                    scan_scores = scores
                else:
                    scan_scores = inside and foreground(score_fn(logits[(..., *inside)], label[(..., *inside)]), k)
                cases.append(case_scores(case_id, loss, scores, scan_scores, label_set))
    D.all_reduce_sum(sums)
    values = sums.tolist()
    loss, totals, scored, count = values[0], values[1:1 + k], values[1 + k:1 + 2 * k], values[-1]
    if count == 0:
        raise RuntimeError("no evaluation case on any rank")
    if label_set.benchmark_data:  # every case scores every label
        means = [total / count for total in totals]
    else:  # nnU-Net's: the mean over the cases that have the label (NaN when none has)
        means = [total / n if n else math.nan for total, n in zip(totals, scored)]
    return {"eval_loss": loss / count, **dict(zip(keys, means)), "mean_dice": label_set.mean(means),
            "eval_cases": int(count)}


def foreground(scores: torch.Tensor, count: int = 2) -> torch.Tensor:
    """The scores of the ``count`` foreground labels (KiTS19: kidney and tumour) of the metric's
    per-class scores: the last ``count``, as the MLCommons reference reads them (``scores[-2]``,
    ``scores[-1]``). With ``--include_background`` the metric also scores the background, first;
    it counts in the loss, never in the Dice the benchmark compares."""
    return scores[-count:]


def case_scores(case_id: str, loss: torch.Tensor, scores: torch.Tensor, inside: torch.Tensor | None,
                label_set: LabelSet = KITS19_SET) -> dict:
    """One case's numbers: its Dice as summed into the mean and, when the scan's region is known,
    the Dice inside the scan (own data: the same numbers, its scored volume is the scan's).
    The benchmark's columns are ``kidney_dice`` and ``tumour_dice``; own data's are named after
    its labels (``runtime.labels.LabelSet.keys``), NaN where a label is absent from both."""
    values = [float(v) for v in scores.tolist()]
    keys = label_set.case_keys
    record = {"case": case_id, **dict(zip(keys, values)), "mean_dice": label_set.mean(values),
              "eval_loss": float(loss), **{f"scan_{key}": None for key in keys}, "scan_mean_dice": None}
    if inside is not None:
        scan = [float(v) for v in inside.double().tolist()]
        record.update({f"scan_{key}": value for key, value in zip(keys, scan)}, scan_mean_dice=label_set.mean(scan))
    return record


def eval_metadata(plan: RunPlan, epoch: int) -> dict:
    """The metadata of an evaluation's MLPerf events after ``epoch``: ``epoch_num`` in samples
    trained (``epoch x samples_trained_per_epoch``, padding not counted; 0 in a plan that trains
    nothing), the unit of the RCPs and of real v4.0 unet3d logs, which the official
    ``rcp_checker`` reads; ``epoch`` the epoch index (this project's report)."""
    trained = plan.training.samples_trained_per_epoch if plan.training is not None else None
    return {"epoch_num": epoch * (trained or 0), "epoch": epoch}


def run_evaluation(components: Components, out: Reporters, epoch: int, cases: list | None = None) -> dict:
    """Sliding-window evaluation of all evaluation cases (MLPerf eval events around it);
    ``cases`` receives this rank's per-case scores (:func:`case_scores`)."""
    plan = components.plan
    inference = plan.inference
    # Evaluation bypasses DDP; with batch norm every rank must use rank 0's running statistics
    # (the ones the checkpoint holds), not the ones its own last training forward left.
    D.broadcast_buffers(ckpt.unwrap(components.model))
    at = eval_metadata(plan, epoch)
    out.mlperf.start(C.EVAL_START, metadata=at)
    loader = components.val_loader
    model = components.eval_model
    model.eval()
    try:
        metrics = evaluate(build_predictor(model, components.dist.device, options_from(plan.precision, inference)),
                           loader, components.loss_fn, components.score_fn, inference.window, inference.overlap,
                           inference.window_batch, components.dist.device,
                           progress=lambda it: out.progress(it, desc=f"eval {epoch} cases", total=len(loader),
                                                            always=True),
                           cases=cases, scan_region=loader.scan_region, label_set=plan.network.label_set)
    finally:
        model.train()
    out.mlperf.event(C.EVAL_ACCURACY, value=metrics["mean_dice"], metadata=at)
    out.mlperf.end(C.EVAL_STOP, metadata=at)
    return metrics
