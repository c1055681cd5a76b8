"""The run's target spacing: the voxel size (mm per axis: slices, height, width) the network's
data was resampled to, which predict resamples a raw scan to before segmenting it.

Like the label set (:mod:`runtime.labels`), it is a decision of the run (the ``target_spacing``
field and decision of its ``RunPlan``, which the checkpoint saves), made by the pure
:func:`decide_spacing` from what is known at each stage of ``runtime.resolve``:

* before the MLPerf ``run_start`` (``resolve``): the checkpoint's (a checkpoint written before
  the spacing was recorded, or the reference's, was trained at KiTS19's), else KiTS19's. Predict
  stops here: it resamples each scan to the checkpoint's spacing.
* after it (``resolve_data``): the preprocessed folder's (its ``dataset.json``'s
  ``target_spacing``; none: KiTS19's). Evaluate with a checkpoint trained at another spacing is
  refused (its Dice would be of a network fed voxels of another size); training runs at the
  folder's spacing, which its checkpoints then carry.

Standard library only.
"""
from __future__ import annotations

from typing import Sequence

from data_loading.description import KITS19

Spacing = tuple[float, ...]

KITS19_SPACING: Spacing = KITS19.target_spacing  # data_loading.description.KITS19, the benchmark's dataset


class SpacingError(ValueError):
    """A checkpoint and a data folder at different target spacings (one line naming both)."""


def as_spacing(value: Sequence[float] | None) -> Spacing | None:
    """Three floats from a list or tuple (as JSON and checkpoints hold them); None stays None."""
    return None if value is None else tuple(float(v) for v in value)


def spacing_text(spacing: Sequence[float]) -> str:
    """``1.6 x 1.2 x 1.2 mm``."""
    return " x ".join(f"{v:g}" for v in spacing) + " mm"


def decide_spacing(saved: Sequence[float] | None, data: Sequence[float] | None, saved_path: str = "",
                   data_path: str = "", trains: bool = False) -> tuple[Spacing, str]:
    """``(spacing, why)``: the run's target spacing from the checkpoint's (``saved``; None: no
    checkpoint) and the data folder's (``data``; None: not read at this stage). Both known and
    different: the data's when the run ``trains`` (its network learns at that spacing), else
    :class:`SpacingError`, one line naming both. Neither: KiTS19's."""
    saved, data = as_spacing(saved), as_spacing(data)
    checkpoint = f"the checkpoint {saved_path}" if saved_path else "the checkpoint"
    folder = f"the data {data_path}" if data_path else "the data"
    if saved is not None and data is not None and saved != data:
        if not trains:
            raise SpacingError(f"{checkpoint} was trained on data resampled to {spacing_text(saved)}; {folder} is "
                               f"resampled to {spacing_text(data)}: use a checkpoint trained at this spacing, or "
                               f"preprocess the data with --target_spacing {','.join(f'{v:g}' for v in saved)}")
        return data, f"{folder}'s; {checkpoint} was trained at {spacing_text(saved)}"
    if data is not None:
        return data, f"{folder}'s" if data_path else "KiTS19's (the data has no description)"
    if saved is not None:
        return saved, f"{checkpoint}'s"
    return KITS19_SPACING, "KiTS19's (no checkpoint; the data's description is read after run_start)"
