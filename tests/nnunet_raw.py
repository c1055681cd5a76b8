"""Tiny labelled CT sets written as nnU-Net v2's raw layout holds them, for the own-data tests.

``Dataset/imagesTr/<case>_0000.nii.gz``, ``Dataset/labelsTr/<case>.nii.gz`` and an nnU-Net
``dataset.json`` (``channel_names``, ``labels``, ``numTraining``, ``file_ending``). Each case is
one of the generator's KiTS-like anatomies (``data_loading.synthetic.make_case``: a body, two
kidneys, a tumour), stored as nnU-Net's own conversions store CT: RAS, the slices on the last
array axis, a spacing of its own per case. A case can be stored in any other orientation
(``codes``: the axis codes of the file's array), e.g. the twin of another case, the same voxels
in space, so that reading must give the same array; and a case can have an empty label map.

The anatomy is drawn on an array in KiTS19's layout (axes I, P, L: slices, height, width) and
the file is that array reoriented by nibabel (``as_reoriented``), which keeps every voxel where
it lies in space: the oracle of what reading the file back in that layout must give.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import nibabel
import numpy as np
from nibabel.orientations import axcodes2ornt, io_orientation, ornt_transform

from data_loading import synthetic

KITS_CODES = ("I", "P", "L")
LABELS = {"background": 0, "organ": 1, "lesion": 2}


@dataclass(frozen=True)
class RawCase:
    """One case to write: its anatomy's ``shape`` and ``spacing`` in KiTS19's layout (slices,
    height, width; mm), the file's axis ``codes``, and whether its label map is ``empty``.
    ``seed`` draws the anatomy (two cases with one seed are twins)."""

    name: str
    shape: tuple[int, int, int] = (14, 20, 22)
    spacing: tuple[float, float, float] = (2.5, 1.5, 1.4)
    codes: tuple[str, str, str] = ("R", "A", "S")
    empty: bool = False
    seed: int | None = None


def kits_affine(spacing, origin=(12.0, -30.0, 40.0)) -> np.ndarray:
    """The RAS+ affine of an array in KiTS19's layout: axis 0 runs Inferior, 1 Posterior, 2 Left."""
    affine = np.eye(4)
    affine[:3, :3] = [[0, 0, -spacing[2]], [0, -spacing[1], 0], [-spacing[0], 0, 0]]
    affine[:3, 3] = origin
    return affine


def anatomy(case: RawCase, index: int) -> tuple[np.ndarray, np.ndarray]:
    """``(image int16, label uint8)`` of ``case`` in KiTS19's layout."""
    seed = case.seed if case.seed is not None else 100 + index
    made = synthetic.make_case(seed, case.shape, case.spacing, synthetic.case_rng(7, seed))
    label = np.zeros_like(made.label) if case.empty else made.label
    return made.image, label


def stored(array: np.ndarray, spacing, codes, dtype) -> nibabel.Nifti1Image:
    """``array`` (KiTS19's layout, ``spacing``) as a NIfTI image whose array has axis ``codes``."""
    image = nibabel.Nifti1Image(np.asarray(array, dtype=dtype), kits_affine(spacing))
    image = image.as_reoriented(ornt_transform(io_orientation(image.affine), axcodes2ornt(codes)))
    image.set_qform(image.affine, code=1)
    image.set_sform(image.affine, code=1)
    return image


def write_raw_dataset(root, cases, labels=LABELS, file_ending=".nii.gz", description: dict | None = None,
                      extra: dict | None = None) -> str:
    """Write ``cases`` (:class:`RawCase`) under ``root`` in nnU-Net's raw layout and its
    ``dataset.json`` (``description``: keys laid over nnU-Net's); returns ``root``.
    ``extra``: ``{case name: label array in KiTS19's layout}`` written in place of the anatomy's."""
    root = str(root)
    os.makedirs(os.path.join(root, "imagesTr"), exist_ok=True)
    os.makedirs(os.path.join(root, "labelsTr"), exist_ok=True)
    for index, case in enumerate(cases):
        image, label = anatomy(case, index)
        if extra and case.name in extra:
            label = extra[case.name]
        nibabel.save(stored(image, case.spacing, case.codes, np.int16),
                     os.path.join(root, "imagesTr", f"{case.name}_0000{file_ending}"))
        nibabel.save(stored(label, case.spacing, case.codes, np.uint8),
                     os.path.join(root, "labelsTr", f"{case.name}{file_ending}"))
    record = {"channel_names": {"0": "CT"}, "labels": dict(labels), "numTraining": len(cases),
              "file_ending": file_ending, "name": "Dataset901_Tiny", **(description or {})}
    with open(os.path.join(root, "dataset.json"), "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1)
    return root


def kits_arrays(case: RawCase, index: int) -> tuple[np.ndarray, np.ndarray]:
    """The oracle: ``(image float32, label uint8)`` of ``case`` in KiTS19's layout, as written."""
    image, label = anatomy(case, index)
    return image.astype(np.float32), label
