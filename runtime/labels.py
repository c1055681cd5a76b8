"""The run's label set: which labels the network segments, how each is named and how it is scored.

A label set is plain data, ``(("background", 0), ("kidney", 1), ...)``, ordered by value (0..N-1,
0 the background): the network has N output channels, the loss and the metric N classes. It is a
decision of the run (the ``labels`` field and decision of its ``RunPlan``, which the checkpoint
saves), made by the pure :func:`decide_labels` from what is known at each stage of
``runtime.resolve`` (``decide_labels_before_data``, ``decide_labels_with_data``):

* before the MLPerf ``run_start`` (``resolve``): the checkpoint's labels (a checkpoint written
  before label sets, or the reference's, holds KiTS19's), else KiTS19's; the network is built
  with them. The data folder is not read there (the clock has not started).
* after it (``resolve_data``): the data folder's description (``dataset.json``; none: KiTS19's),
  which must be the checkpoint's label set. A run without a checkpoint on data with another
  class count has its network built again after ``run_start`` (``runtime.clocked.start``): an
  own-data run is open, and its clock then counts that build.

KiTS19's label set keeps the benchmark's names (``l1_dice``, ``l2_dice``) and Dice (a label absent
from both the prediction and the truth scores 1.0); any other set is named after its labels
(``kidney_dice``, ``tumor_dice``, ``cyst_dice``) and scored as nnU-Net reports it: a label absent
from both is NaN and left out of the means (:data:`BENCHMARK` / :data:`NNUNET`). Standard library
only.
"""
from __future__ import annotations

import math
import re
from typing import Sequence

from data_loading.description import KITS19

Labels = tuple[tuple[str, int], ...]

KITS19_LABELS: Labels = KITS19.labels  # data_loading.description.KITS19, the benchmark's dataset
BENCHMARK = "benchmark"  # a label absent from both scores 1.0 (the MLPerf reference's smoothing)
NNUNET = "nnunet"  # a label absent from both is NaN, left out of the means
RESERVED_KEYS = ("mean_dice", "eval_loss", "eval_cases")
_NOT_NAME = re.compile(r"[^0-9a-z]+")


class LabelError(ValueError):
    """Two label sets that cannot run together (one line naming both)."""


def as_labels(labels) -> Labels | None:
    """A label set from a dict (name -> value), pairs or lists of pairs (as JSON and checkpoints
    hold them), ordered by value; None stays None."""
    if labels is None:
        return None
    items = labels.items() if isinstance(labels, dict) else labels
    return tuple(sorted(((str(name), int(value)) for name, value in items), key=lambda pair: pair[1]))


def labels_text(labels: Labels) -> str:
    """``background 0, kidney 1, tumor 2``."""
    return ", ".join(f"{name} {value}" for name, value in labels)


def is_kits19(labels: Labels) -> bool:
    return tuple(labels) == KITS19_LABELS


def n_classes(labels: Labels) -> int:
    """The network's output channels: one per label, the background included."""
    return len(labels)


def foreground(labels: Labels) -> Labels:
    """The labels that are scored (all but the background, value 0)."""
    return tuple(pair for pair in labels if pair[1] != 0)


def dice_definition(labels: Labels) -> str:
    """:data:`BENCHMARK` for KiTS19's label set, :data:`NNUNET` for any other."""
    return BENCHMARK if is_kits19(labels) else NNUNET


def dice_keys(labels: Labels) -> tuple[str, ...]:
    """The metric key of each foreground label: KiTS19's ``l1_dice``, ``l2_dice`` (the benchmark's
    names), else ``<name>_dice`` (lower case, other characters as ``_``; ``l<value>_dice`` where
    that would be no name or another key)."""
    if is_kits19(labels):
        return ("l1_dice", "l2_dice")
    keys = []
    for name, value in foreground(labels):
        stem = _NOT_NAME.sub("_", name.lower()).strip("_")
        key = f"{stem}_dice" if stem else ""
        if not key or key in RESERVED_KEYS or key in keys or re.fullmatch(r"l\d+_dice", key):
            key = f"l{value}_dice"
        keys.append(key)
    return tuple(keys)


def mean_of(scores: Sequence[float], labels: Labels) -> float:
    """``mean_dice`` of one volume's (or the averaged) per-label scores: the plain mean for KiTS19;
    for others the mean of the scores that are not NaN (NaN when none is)."""
    if dice_definition(labels) == BENCHMARK:
        return sum(scores) / len(scores)
    kept = [s for s in scores if not math.isnan(s)]
    return sum(kept) / len(kept) if kept else math.nan


def decide_labels(saved: Labels | None, data: Labels | None, saved_path: str = "",
                  data_path: str = "") -> tuple[Labels, str]:
    """``(labels, why)``: the run's label set from the checkpoint's (``saved``; None: no
    checkpoint) and the data's (``data``; None: not read at this stage). Both known and different:
    :class:`LabelError`, one line naming both. Neither: KiTS19's."""
    saved, data = as_labels(saved), as_labels(data)
    if saved is not None and data is not None and saved != data:
        checkpoint = f"the checkpoint {saved_path}" if saved_path else "the checkpoint"
        folder = f"the data {data_path}" if data_path else "the data"
        raise LabelError(f"{checkpoint} was trained on labels {labels_text(saved)}; {folder} has labels "
                         f"{labels_text(data)}: use a checkpoint trained on this label set")
    if data is not None:
        return data, ("KiTS19's (the data has no description)" if is_kits19(data) and not data_path
                      else f"the description of {data_path}" if data_path else "the data's")
    if saved is not None:
        return saved, f"the checkpoint's ({saved_path})" if saved_path else "the checkpoint's"
    return KITS19_LABELS, "KiTS19's (no checkpoint; the data's description is read after run_start)"


def run_labels(plan) -> Labels:
    """The label set of a resolved ``plan`` (its ``labels``), else KiTS19's (a bare ``Config``:
    the tools and tests that build a network directly)."""
    labels = getattr(plan, "labels", None)
    return as_labels(labels) if labels is not None else KITS19_LABELS

