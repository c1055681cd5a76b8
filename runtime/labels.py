"""The run's label set: which classes the network segments, how each is named and how it is scored.

A :class:`LabelSet` is ``labels`` (plain data, ``(("background", 0), ("kidney", 1), ...)``, ordered
by value 0..N-1, 0 the background: the network's N output channels, the loss's and the metric's N
classes), the Dice definition (``dice``) and nnU-Net's ``ignore`` label, if the data has one.

**The data chooses the Dice, never a label's name.** The benchmark's data (a preprocessed folder
without a description: KiTS19 as ``preprocess_dataset.py`` makes it) keeps the benchmark's names
(``l1_dice``, ``l2_dice``) and definition (:data:`BENCHMARK`: a label absent from both the
prediction and the truth scores 1.0, every stored voxel scored, the MLCommons reference's). Every
described folder (own data, whatever its labels are called or how many) is scored as nnU-Net
scores it (:data:`NNUNET`): ``2·TP / (2·TP + FP + FN)`` per label, NaN for a label absent from
both, left out of the means, on the scan's own voxels only; each label's key is named after it
(``kidney_dice``, ``cyst_dice``). The same definition holds in training's evaluations, evaluate,
the report, predict's summary and the API's ``score()``.

``ignore``: nnU-Net's ``ignore`` label (its value, the largest of the description's), which is no
class: no output, no loss and no Dice in its voxels (sparse annotations).

A label set is a decision of the run (the ``labels``, ``dice`` and ``ignore_label`` fields and
decisions of its ``RunPlan``, which the checkpoint saves), made once, before the MLPerf clock, by
the pure :func:`decide_label_set` from the trained network's (a checkpoint's) and the data's
(its ``dataset.json``, read before ``run_start``: a description is no training data). Standard
library only.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

from data_loading.description import KITS19

Labels = tuple[tuple[str, int], ...]

KITS19_LABELS: Labels = KITS19.labels  # data_loading.description.KITS19, the benchmark's dataset
BENCHMARK = "benchmark"  # a label absent from both scores 1.0 (the MLPerf reference's smoothing)
NNUNET = "nnunet"  # a label absent from both is NaN, left out of the means; the scan's voxels only
DEFINITIONS = (BENCHMARK, NNUNET)
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


@dataclass(frozen=True)
class LabelSet:
    """The classes a network segments (``labels``), how they are scored (``dice``: :data:`BENCHMARK`
    or :data:`NNUNET`) and the value of nnU-Net's ``ignore`` label (None: the data has none)."""

    labels: Labels
    dice: str = NNUNET
    ignore: int | None = None

    @property
    def n_classes(self) -> int:
        """The network's output channels: one per label, the background included."""
        return len(self.labels)

    @property
    def foreground(self) -> Labels:
        """The labels that are scored (all but the background, value 0)."""
        return tuple(pair for pair in self.labels if pair[1] != 0)

    @property
    def benchmark_data(self) -> bool:
        """Scored as the benchmark scores KiTS19 (a folder preprocessed without a description)."""
        return self.dice == BENCHMARK

    @property
    def keys(self) -> tuple[str, ...]:
        """The metric key of each foreground label: the benchmark's ``l1_dice``, ``l2_dice``, else
        ``<name>_dice`` (lower case, other characters as ``_``; ``l<value>_dice`` where that would
        be no name or another key)."""
        if self.benchmark_data:
            return tuple(f"l{value}_dice" for _, value in self.foreground)
        keys: list[str] = []
        for name, value in self.foreground:
            stem = _NOT_NAME.sub("_", name.lower()).strip("_")
            key = f"{stem}_dice" if stem else ""
            if not key or key in RESERVED_KEYS or key in keys or re.fullmatch(r"l\d+_dice", key):
                key = f"l{value}_dice"
            keys.append(key)
        return tuple(keys)

    @property
    def case_keys(self) -> tuple[str, ...]:
        """The per-case columns of ``eval_cases.csv``: the benchmark's ``kidney_dice``,
        ``tumour_dice`` (KiTS19's CSV since the first round), else :attr:`keys`."""
        return ("kidney_dice", "tumour_dice") if self.benchmark_data else self.keys

    def mean(self, scores: Sequence[float]) -> float:
        """``mean_dice`` of per-label scores: the plain mean for the benchmark; nnU-Net's mean of
        the scores that are not NaN (NaN when none is)."""
        if self.benchmark_data:
            return sum(scores) / len(scores)
        kept = [s for s in scores if not math.isnan(s)]
        return sum(kept) / len(kept) if kept else math.nan

    def text(self) -> str:
        """``background 0, kidney 1, tumor 2`` (and ``ignore 3`` when it has one)."""
        return labels_text(self.labels) + (f", ignore {self.ignore}" if self.ignore is not None else "")

    def scored_as(self) -> str:
        """The Dice in words."""
        if self.benchmark_data:
            return "the benchmark's Dice (absent from both: 1.0; every stored voxel)"
        return "nnU-Net's Dice (absent from both: NaN, left out of the means; the scan's own voxels)"


KITS19_SET = LabelSet(KITS19_LABELS, BENCHMARK)  # the benchmark's data


def of_description(description) -> LabelSet:
    """The label set of a preprocessed folder's description (``data_loading.description``): the
    benchmark's for None (KiTS19 preprocessed without one), nnU-Net's scoring for any other."""
    if description is None:
        return KITS19_SET
    return LabelSet(as_labels(description.labels), NNUNET, description.ignore)


def same_classes(a: LabelSet, b: LabelSet) -> bool:
    """Whether networks of ``a`` and ``b`` segment the same classes (names, values, ignore)."""
    return a.labels == b.labels and a.ignore == b.ignore


def decide_label_set(network: LabelSet | None, data: LabelSet | None, network_path: str = "",
                     data_path: str = "", fine_tune: bool = False) -> tuple[LabelSet, str]:
    """``(label_set, why)``: the run's label set from the trained network's (``network``: its
    checkpoint's; None: none) and the data's (``data``: its description's; None: not read, as in
    predict). The data's when known (it chooses the Dice); a network of other classes is a
    :class:`LabelError`, one line naming both, unless the run ``fine_tune``s it (its output layer
    is then trained anew). Neither: KiTS19's."""
    checkpoint = f"the checkpoint {network_path}" if network_path else "the checkpoint"
    folder = f"the data {data_path}" if data_path else "the data"
    if network is not None and data is not None and not same_classes(network, data):
        if not fine_tune:
            raise LabelError(f"{checkpoint} was trained on labels {network.text()}; {folder} has labels "
                             f"{data.text()}: use a checkpoint trained on this label set, or start from its weights with --pretrained_weights")
        return data, f"{folder}'s; {checkpoint}'s ({network.text()}) fine-tuned to them"
    if data is not None:
        why = f"the description {data_path}" if data_path else "KiTS19's (the data has no description)"
        return data, f"{why}; {data.scored_as()}"
    if network is not None:
        return network, f"{checkpoint}'s"
    return KITS19_SET, "KiTS19's (no checkpoint, no data)"
