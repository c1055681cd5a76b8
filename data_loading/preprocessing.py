"""KiTS19 preprocessing: raw NIfTI cases -> the benchmark's ``case_XXXXX_{x,y}.npy`` files.

The per-case steps use the same operations, in the same order, as the MLCommons reference, so
the files are byte-identical to its output and ``checksum.json`` verifies them:

1. ``load_pair``: image ``get_fdata()`` -> float32, label -> uint8, both (1, D, H, W); the
   spacing is ``header["pixdim"][1:4]`` as Python floats. (``read_voxels`` skips the float64
   copy where that cannot change a bit.)
2. ``resample``: if the spacing list differs from ``[1.6, 1.2, 1.2]`` (a float32 header value
   such as 1.600000023841858 counts as different), resize to ``int(spacing / target * shape)``
   with ``torch.nn.functional.interpolate``: trilinear ``align_corners=True`` for the image,
   nearest for the label.
3. ``normalize_intensity``: clip to [-79, 304], then ``(x - 101.0) / 76.9`` in float32.
4. ``pad_to_min_shape``: edge-pad each spatial axis to at least 128 (``diff // 2`` before).
5. ``save_atomic``: ``np.save(..., allow_pickle=False)`` to a temporary name, then rename;
   then ``save_geometry``: ``case_XXXXX_geometry.json`` beside them (shapes, spacing, padding;
   not part of the benchmark's files or checksums).

A described dataset (own data, :mod:`data_loading.description`) is read otherwise in step 1:
through predict's reader (:func:`load_canonical_pair`, :func:`data_loading.scan_io.read_case`),
image and label in KiTS19's axes I-P-L whatever the files' orientation, the spacing permuted
alike, so that training sees the arrays predict gives the network; steps 2-5 are the same.

Input problems raise :class:`PreprocessError` with a one-line message naming the file or case.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from data_loading import geometry
from data_loading.atomic import TEMP_SUFFIX, atomic_write
from data_loading.description import KITS19
from data_loading.fingerprint import case_fingerprint
from data_loading.nifti_read import (PreprocessError, load_image, read_nifti, read_voxels,  # noqa: F401 (API)
                                     validated_label)
from data_loading.write_errors import is_full_disk, write_or_raise

# KiTS19's facts (data_loading.description.KITS19), in the forms the reference's code uses them:
TARGET_SPACING = list(KITS19.target_spacing)  # (slices, height, width) in mm; a list, compared as one
CLIP_MIN, CLIP_MAX = KITS19.intensity.low, KITS19.intensity.high
MEAN, STD = KITS19.intensity.mean, KITS19.intensity.std
FIRST_UNLABELLED_ID = KITS19.first_unlabelled_id  # KiTS19 has labels for cases 0-209 only: the benchmark's 210
LABEL_VALUES = KITS19.label_values
MIN_SHAPE = (128, 128, 128)
IMAGE_FILE, LABEL_FILE = "imaging.nii.gz", "segmentation.nii.gz"
DEFAULT_CHECKSUM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checksum.json")
# KiTS19's evaluation split (the data loader's default, data_loading.dataset.EVALUATION_CASES_FILE)
DEFAULT_EVALUATION_CASES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                        "evaluation_cases.txt")

CASE_DIR = re.compile(r"^case_(\d{5})$")  # a KiTS19 case folder: case_00042


@dataclass(frozen=True)
class RawCase:
    """One raw KiTS19 case. For ids >= 210 (outside the benchmark) ``label_path`` is the
    ``segmentation.nii.gz`` a later KiTS (21, 23) puts there, or None where there is none.
    ``kits19``: one of KiTS19's 210 cases (id < 210, in a folder with no synthetic marker), read
    by the reference's rules, whatever its header says (:func:`load_pair`). ``canonical``: a case
    of a described dataset, read as predict reads a scan, in KiTS19's axes whatever the file's
    (:func:`load_canonical_pair`); else the benchmark's reading of the arrays as stored."""

    case_id: int
    image_path: str
    label_path: str | None
    kits19: bool = True
    label_values: tuple[int, ...] = LABEL_VALUES  # a description's labels (data_loading.description)
    canonical: bool = False

    @property
    def name(self) -> str:
        return f"case_{self.case_id:05d}"


@dataclass(frozen=True)
class CaseStats:
    """What is printed per case: shape (1, D, H, W) and intensity statistics of the image."""

    name: str
    shape: tuple[int, ...]
    mean: float
    std: float
    warning: str = ""  # one line about the case's input (a KiTS19 header that disagrees with itself)
    fingerprint: dict | None = None  # the case's entry of the dataset's fingerprint (case_fingerprint)

    def line(self) -> str:
        return f"{self.name}: shape {self.shape}, mean {self.mean:.4f}, std {self.std:.4f}"


# ----------------------------------------------------------------------------- discovery


def find_cases(data_dir: str) -> tuple[list[RawCase], list[RawCase]]:
    """Raw cases under ``data_dir`` (or ``data_dir/data``), as (labelled, unlabelled), sorted.

    Labelled cases (id < 210) must have both NIfTI files; the cases with ids >= 210 are
    returned only to be counted and skipped: KiTS19 has no labels for them, and where a later
    KiTS (21, 23) does, those labels are not KiTS19's (other cases, other label values: KiTS21
    adds 3 for cysts), so they stay out of the benchmark's data (:func:`skipped_line`).
    """
    if not os.path.isdir(data_dir):
        raise PreprocessError(f"--data_dir {data_dir}: not a directory")
    root = data_dir
    names = case_dirs(root)
    if not names and os.path.isdir(os.path.join(data_dir, "data")):
        root = os.path.join(data_dir, "data")  # the KiTS19 repository's layout
        names = case_dirs(root)
    if not names:
        raise PreprocessError(f"--data_dir {data_dir}: no case_XXXXX folders in it "
                              "(nor in its data/ folder)")
    from data_loading.synthetic import read_marker

    kits19 = all(read_marker(folder) is None for folder in {data_dir, root})  # not generated data
    labelled, unlabelled = [], []
    for name in names:
        case_id = int(CASE_DIR.match(name).group(1))
        folder = os.path.join(root, name)
        image_path = os.path.join(folder, IMAGE_FILE)
        if case_id >= FIRST_UNLABELLED_ID:
            label_path = os.path.join(folder, LABEL_FILE)
            unlabelled.append(RawCase(case_id, image_path, label_path if os.path.isfile(label_path) else None,
                                      kits19=False))
            continue
        label_path = os.path.join(folder, LABEL_FILE)
        for path in (image_path, label_path):
            if not os.path.isfile(path):
                raise PreprocessError(f"{path}: missing (case {name} is in the labelled range)")
        labelled.append(RawCase(case_id, image_path, label_path, kits19=kits19))
    return labelled, unlabelled


def skipped_line(skipped: Sequence[RawCase]) -> str:
    """The one line saying why the cases with ids >= 210 are not preprocessed (and how many of
    them carry labels)."""
    labelled = sum(case.label_path is not None for case in skipped)
    if not labelled:
        return (f"skipping {len(skipped)} cases with id >= {FIRST_UNLABELLED_ID} (KiTS19 has no labels for them)")
    return (f"skipping {len(skipped)} cases with id >= {FIRST_UNLABELLED_ID}, {labelled} of them with a "
            f"{LABEL_FILE} (KiTS21/KiTS23's): the benchmark trains and evaluates on KiTS19's cases "
            f"0-{FIRST_UNLABELLED_ID - 1} only, and later KiTS labels are not KiTS19's (KiTS21 adds 3, cysts)")


SHOWN_NAMES = 3  # names listed in a line about many files


def _some(names: Sequence[str]) -> str:
    shown = ", ".join(names[:SHOWN_NAMES])
    return shown + (", ..." if len(names) > SHOWN_NAMES else "")


def _entries(folder: str) -> list[str]:
    """The names of the files in ``folder`` that are not hidden, sorted (none when it is missing)."""
    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if not n.startswith(".") and os.path.isfile(os.path.join(folder, n)))


def images_tr_cases(data_dir: str, description) -> list[tuple[str, str, str]]:
    """The cases of nnU-Net's ``imagesTr`` layout under ``data_dir``, as (case, image path, label
    path), checked as nnU-Net's ``verify_dataset_integrity`` checks them: every image
    ``imagesTr/<case>_0000<file_ending>`` has its label ``labelsTr/<case><file_ending>`` and every
    label its image, every file of the two folders follows that pattern (``file_ending`` and the
    one channel ``_0000``), and the count is ``numTraining`` when the description gives it. Else
    one :class:`PreprocessError` line listing what is wrong (counts and the first names)."""
    from data_loading.description import CHANNEL_SUFFIX

    images, labels = os.path.join(data_dir, "imagesTr"), os.path.join(data_dir, "labelsTr")
    where = description.path or "given"
    if not os.path.isdir(images):
        raise PreprocessError(f"--data_dir {data_dir}: no imagesTr folder in it (the description {where} says "
                              "layout imagesTr)")
    ending, suffix = description.file_ending, CHANNEL_SUFFIX + description.file_ending
    image_names, label_names = _entries(images), _entries(labels)
    cases = {n[:-len(suffix)]: n for n in image_names if n.endswith(suffix) and len(n) > len(suffix)}
    truths = {n[:-len(ending)]: n for n in label_names if n.endswith(ending) and len(n) > len(ending)}
    wrong = []
    odd_images = [n for n in image_names if n not in cases.values()]
    if odd_images:
        wrong.append(f"{len(odd_images)} file(s) in imagesTr not named <case>{suffix} ({_some(odd_images)})")
    odd_labels = [n for n in label_names if n not in truths.values()]
    if odd_labels:
        wrong.append(f"{len(odd_labels)} file(s) in labelsTr not named <case>{ending} ({_some(odd_labels)})")
    unlabelled = sorted(set(cases) - set(truths))
    if unlabelled:
        wrong.append(f"{len(unlabelled)} image(s) without their label in labelsTr ({_some(unlabelled)})")
    orphans = sorted(set(truths) - set(cases))
    if orphans:
        wrong.append(f"{len(orphans)} label(s) without their image in imagesTr ({_some(orphans)})")
    if description.num_training is not None and len(cases) != description.num_training:
        wrong.append(f"{len(cases)} case(s) in imagesTr where numTraining says {description.num_training}")
    if wrong:
        raise PreprocessError(f"--data_dir {data_dir}: not the dataset the description {where} describes: "
                              + "; ".join(wrong))
    return [(case, os.path.join(images, cases[case]), os.path.join(labels, truths[case])) for case in sorted(cases)]


def find_described_cases(data_dir: str, description) -> tuple[list[RawCase], list[str]]:
    """Raw cases of a described dataset (:class:`data_loading.description.DatasetDescription`)
    under ``data_dir``, as (labelled cases sorted by number, names of the cases without a label
    file). ``imagesTr``: every case has its label, or the data is refused (:func:`images_tr_cases`);
    ``case_folders`` (KiTS's): every case folder with its label file is preprocessed, whatever its
    number, and those without one (KiTS's test cases) are returned to be skipped. The case's number
    is the last run of digits of its folder or file name, and two cases with one number, a name
    without one, or a count of labelled cases other than the description's ``numTraining``, are
    refused in one line naming them. The cases are read in KiTS19's axes (``canonical``)."""
    from data_loading.description import case_number

    if not os.path.isdir(data_dir):
        raise PreprocessError(f"--data_dir {data_dir}: not a directory")
    if description.layout == "imagesTr":
        found = images_tr_cases(data_dir, description)
        where = os.path.join(data_dir, "imagesTr")
    else:
        found = []  # (case name, image path, label path)
        for name in sorted(os.listdir(data_dir)):
            folder = os.path.join(data_dir, name)
            if os.path.isfile(os.path.join(folder, description.image_file)):
                found.append((name, os.path.join(folder, description.image_file),
                              os.path.join(folder, description.label_file)))
        where = f"{data_dir}/<case>/{description.image_file}"
    if not found:
        raise PreprocessError(f"--data_dir {data_dir}: no case in it ({where}, as the description "
                              f"{description.path or 'given'} says)")
    labelled, unlabelled, numbers = [], [], {}
    for name, image_path, label_path in found:
        number = case_number(name)
        if number is None:
            raise PreprocessError(f"{image_path}: case {name!r} has no number at the end of its name "
                                  "(a case is case_XXXXX_{x,y}.npy once preprocessed)")
        if number in numbers:
            raise PreprocessError(f"cases {numbers[number]!r} and {name!r} in {data_dir} have one number, {number}")
        numbers[number] = name
        if not os.path.isfile(label_path):
            unlabelled.append(name)
            continue
        labelled.append(RawCase(number, image_path, label_path, kits19=False,
                                label_values=description.label_values, canonical=True))
    if description.num_training is not None and len(labelled) != description.num_training:
        raise PreprocessError(f"--data_dir {data_dir}: {len(labelled)} labelled cases where numTraining in the "
                              f"description {description.path or 'given'} says {description.num_training}")
    return sorted(labelled, key=lambda c: c.case_id), unlabelled


def case_dirs(root: str) -> list[str]:
    """The KiTS19 case folders (``case_XXXXX``) in ``root``, sorted."""
    return sorted(n for n in os.listdir(root)
                  if CASE_DIR.match(n) and os.path.isdir(os.path.join(root, n)))


# ----------------------------------------------------------------------------- per-case steps


def load_pair(case: RawCase, warn: Callable[[str], None] | None = None) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """Image float32 (1, D, H, W), label uint8 (1, D, H, W) and the spacing (3 floats).

    Raises :class:`PreprocessError` for unreadable files, NaN or infinite intensities, label
    values outside {0, 1, 2} (checked before the uint8 cast would wrap them), an image whose
    ``pixdim[1:4]`` disagrees with its own affine (the orientation is the affine's: two spacings
    for one file) unless it is one of KiTS19's cases (``case.kits19``), and a label not on the
    image's voxel grid. KiTS19's own cases are read by the reference's rule, ``pixdim``, whatever
    the affine says (the benchmark's files, which ``checksum.json`` verifies, are made so): a
    disagreement is one line through ``warn`` (default: printed on stderr) naming the case. A label
    stored in another axis order or with axes flipped (the same voxels in space, as its affine
    says) is brought to the image's axes exactly (:func:`data_loading.scan_io.label_on_scan_grid`);
    a label on the image's grid is used as read, so KiTS19's outputs stay byte-identical.
    """
    from data_loading import scan_io

    image, spacing, image_nifti = load_image(case.image_path)
    image_affine = scan_io.file_affine(image_nifti)
    if scan_io.spacing_disagrees(spacing, image_affine):
        sizes = [float(f"{s:.6g}") for s in scan_io.voxel_sizes(image_affine)]
        disagree = (f"{case.image_path}: pixdim[1:4] {[float(f'{p:.6g}') for p in spacing]} mm disagrees with the "
                    f"affine's voxel sizes {sizes} mm")
        if not case.kits19:
            raise PreprocessError(f"{disagree} (case {case.name}, not KiTS19's: which spacing is the scan's?)")
        line = f"warning: {disagree}; case {case.name} is KiTS19's: pixdim used, as the reference reads it"
        (warn or (lambda text: print(text, file=sys.stderr)))(line)
    label_nifti = read_nifti(case.label_path)
    label = validated_label(read_voxels(label_nifti, case.label_path), case.name, case.label_values)
    try:
        label = scan_io.label_file_on_scan_grid(label, label_nifti, image_affine, image.shape[1:], case.label_path,
                                                case.image_path, scan_io.states_orientation(image_nifti))
    except scan_io.ScanError as exc:
        raise PreprocessError(str(exc)) from None
    return image, np.expand_dims(label, 0), spacing


def load_canonical_pair(case: RawCase, warn: Callable[[str], None] | None = None
                        ) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """A described dataset's case as predict reads a scan (:func:`data_loading.scan_io.read_case`,
    the one reader of both): image float32 (1, D, H, W) and label uint8 (1, D, H, W) in KiTS19's
    axes (I-P-L: :data:`data_loading.description.CANONICAL_AXES`) whatever the file's, and the
    spacing in that order. The same checks as :func:`load_pair` for a case that is not KiTS19's
    (pixdim against the affine, label values, the label on the image's grid), one line naming
    the file or case; a note on how a file was read (no orientation stated, a trailing axis of
    length 1) goes through ``warn``."""
    from data_loading import scan_io

    try:
        read = scan_io.read_case(case.image_path, case.label_path, case.label_values, case.name, one_spacing=True)
    except scan_io.ScanError as exc:
        raise PreprocessError(str(exc)) from None
    for line in read.volume.note.splitlines():
        (warn or (lambda text: print(text, file=sys.stderr)))(f"note: {line}")
    return read.volume.image, np.expand_dims(read.label, 0), list(read.volume.spacing)


def load_case(case: RawCase, warn: Callable[[str], None] | None = None) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """:func:`load_canonical_pair` for a described dataset's case, else :func:`load_pair` (the
    benchmark's reading, byte for byte the reference's)."""
    return (load_canonical_pair if case.canonical else load_pair)(case, warn)


def resampled_shape(shape: Sequence[int], spacing: list[float],
                    target: list[float] = TARGET_SPACING) -> list[int]:
    """Spatial shape after :func:`resample`: ``int(spacing / target * shape)`` per axis, or
    ``shape`` itself when the spacing list equals ``target``."""
    if spacing == list(target):
        return list(shape)
    return (np.array(spacing) / np.array(target) * np.array(shape)).astype(int).tolist()


def resample(image: np.ndarray, label: np.ndarray | None, spacing: list[float],
             target: list[float] = TARGET_SPACING) -> tuple[np.ndarray, np.ndarray | None]:
    """Resize (1, D, H, W) image and label to ``target`` spacing; unchanged if equal.

    The comparison is of Python lists, exactly as the reference does it. ``label`` may be
    None (a scan to segment): then None is returned in its place.
    """
    if spacing == list(target):
        return image, label
    import torch
    from torch.nn.functional import interpolate

    new_shape = resampled_shape(image.shape[1:], spacing, target)
    image = interpolate(torch.from_numpy(np.expand_dims(image, 0)), size=new_shape,
                        mode="trilinear", align_corners=True)
    if label is not None:
        label = interpolate(torch.from_numpy(np.expand_dims(label, 0)), size=new_shape,
                            mode="nearest")
        label = np.squeeze(label.numpy(), 0)
    return np.squeeze(image.numpy(), 0), label


def normalize_intensity(image: np.ndarray) -> np.ndarray:
    """Clip to [CLIP_MIN, CLIP_MAX] and standardise with the dataset's MEAN and STD (float32)."""
    image = np.clip(image, CLIP_MIN, CLIP_MAX)
    return (image - MEAN) / STD


def min_shape_padding(shape: Sequence[int],
                      min_shape: Sequence[int] = MIN_SHAPE) -> list[tuple[int, int]]:
    """``(before, after)`` per spatial axis that brings ``shape`` to at least ``min_shape``."""
    bounds = [max(0, m - s) for m, s in zip(min_shape, shape)]
    return [(b // 2, b - b // 2) for b in bounds]


def pad_to_min_shape(image: np.ndarray, label: np.ndarray | None,
                     min_shape: Sequence[int] = MIN_SHAPE) -> tuple[np.ndarray, np.ndarray | None]:
    """Edge-pad each spatial axis of (1, D, H, W) arrays to at least ``min_shape`` (``label``
    may be None)."""
    paddings = [(0, 0)] + min_shape_padding(image.shape[1:], min_shape)
    padded_label = None if label is None else np.pad(label, paddings, mode="edge")
    return np.pad(image, paddings, mode="edge"), padded_label


def preprocess_arrays(image: np.ndarray, label: np.ndarray | None, spacing: list[float],
                      target: Sequence[float] = TARGET_SPACING) -> tuple[np.ndarray, np.ndarray | None]:
    """Steps 2-4 on loaded arrays: resample (to ``target``, KiTS19's by default), normalise,
    pad. Shapes (1, D, H, W); ``label`` may be None (a scan without ground truth)."""
    image, label = resample(image, label, spacing, list(target))
    image = normalize_intensity(image)
    return pad_to_min_shape(image, label)


# ----------------------------------------------------------------------------- outputs


def output_paths(results_dir: str, name: str) -> tuple[str, str]:
    return (os.path.join(results_dir, f"{name}_x.npy"), os.path.join(results_dir, f"{name}_y.npy"))


def save_atomic(path: str, array: np.ndarray) -> None:
    """``np.save`` through :func:`atomic_write`: a crash leaves at most a hidden
    ``.<name>.<random>.tmp`` file, never a partial ``.npy``. (A file object, because np.save would
    append ".npy" to a temporary name.)"""
    write_or_explain(path, lambda handle: np.save(handle, array, allow_pickle=False))


def write_or_explain(path: str, write) -> None:
    """:func:`atomic_write`; a failure to write (full disk, quota, read-only: the temporary file
    is gone) is one :class:`PreprocessError` naming ``path`` and the reason."""
    def error(reason: str, exc: BaseException) -> PreprocessError:
        then = "free space and run again to resume" if is_full_disk(exc) else "run again to resume"
        return PreprocessError(f"cannot write {path}: {reason}; finished cases are kept, {then}")

    write_or_raise(lambda: atomic_write(path, write), error)


def save_geometry(results_dir: str, name: str, shape: Sequence[int], spacing: list[float],
                  target: Sequence[float] = TARGET_SPACING) -> None:
    """``<name>_geometry.json`` (:mod:`data_loading.geometry`): original shape and spacing,
    resampled shape and padding of the case, as :func:`preprocess_arrays` makes them."""
    resampled = resampled_shape(shape, spacing, list(target))
    record = geometry.geometry_record(name, shape, spacing, list(target), resampled, min_shape_padding(resampled))
    write_or_explain(geometry.record_path(results_dir, name), lambda handle: handle.write(geometry.record_bytes(record)))


def header_geometry(case: RawCase) -> tuple[list[int], list[float]]:
    """The spatial shape and spacing of ``case``'s image as preprocessing reads it, from its
    header alone (no voxel is read): in KiTS19's axes for a described dataset's case
    (:func:`data_loading.scan_io.header_geometry`, permuted as :func:`load_canonical_pair`
    permutes the arrays), else ``pixdim[1:4]`` and the shape as stored (:func:`load_pair`)."""
    if case.canonical:
        from data_loading import scan_io

        try:
            shape, spacing, orientation = scan_io.header_geometry(case.image_path)
        except scan_io.ScanError as exc:
            raise PreprocessError(str(exc)) from None
        return list(orientation.kits_shape), [float(s) for s in orientation.spacing_to_kits(list(spacing))]
    nifti = read_nifti(case.image_path)
    if len(nifti.shape) != 3:
        raise PreprocessError(f"{case.image_path}: expected a 3-D volume, got shape {nifti.shape}")
    return list(nifti.shape), nifti.header["pixdim"][1:4].tolist()


def save_missing_geometry(cases: Sequence[RawCase], results_dir: str,
                          target: Sequence[float] = TARGET_SPACING) -> int:
    """The geometry record of each case preprocessed before records existed, from its image's
    header alone (:func:`header_geometry`); returns how many were written."""
    written = 0
    for case in cases:
        if os.path.exists(geometry.record_path(results_dir, case.name)):
            continue
        shape, spacing = header_geometry(case)
        save_geometry(results_dir, case.name, shape, spacing, target)
        written += 1
    return written


def kept_fingerprints(cases: Sequence[RawCase], results_dir: str) -> list[dict]:
    """The fingerprint entries of ``cases`` finished by an earlier run: from the fingerprint that
    run saved in ``results_dir`` when it has them, else read again from the raw files."""
    from data_loading.description import FINGERPRINT_FILE

    saved = {}
    try:
        with open(os.path.join(results_dir, FINGERPRINT_FILE), encoding="utf-8") as handle:
            saved = {e["case"]: e for e in json.load(handle).get("per_case", []) if isinstance(e, dict) and "case" in e}
    except (OSError, ValueError, AttributeError, TypeError):
        saved = {}
    entries = []
    for case in cases:
        entry = saved.get(case.name)
        if entry is None or entry.get("image") != case.image_path:
            image, label, spacing = load_case(case, warn=lambda text: None)
            entry = case_fingerprint(case, image, label, spacing)
        entries.append(entry)
    return entries


def carry_synthetic_marker(data_dir: str, results_dir: str) -> str | None:
    """Copy the synthetic marker of ``data_dir`` (or its ``data/`` folder; written by
    ``data_loading.synthetic``) into ``results_dir``, so that a run on the preprocessed folder
    knows its data is not KiTS19 (``runtime.division``); returns the copy's path, or None when
    ``data_dir`` carries none. The raw folder is only read; no .npy file changes."""
    from data_loading.synthetic import MARKER_NAME

    for folder in (data_dir, os.path.join(data_dir, "data")):
        source = os.path.join(folder, MARKER_NAME)
        if os.path.isfile(source):
            try:
                with open(source, "rb") as handle:
                    content = handle.read()
            except OSError as exc:
                raise PreprocessError(f"{source}: cannot read ({exc.strerror or type(exc).__name__})") from None
            target = os.path.join(results_dir, MARKER_NAME)
            write_or_explain(target, lambda out: out.write(content))
            return target
    return None


def prepare_results_dir(results_dir: str) -> None:
    """Create ``results_dir`` if needed and prove that a file can be written in it."""
    import tempfile

    try:
        os.makedirs(results_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=results_dir):
            pass
    except OSError as exc:
        raise PreprocessError(f"--results_dir {results_dir}: not writable "
                              f"({exc.strerror or type(exc).__name__})") from None


def remove_stale_temporaries(results_dir: str) -> int:
    """Delete temporary files that an interrupted run left behind; returns how many."""
    removed = 0
    for name in os.listdir(results_dir):
        if name.startswith(".case_") and name.endswith(TEMP_SUFFIX):
            os.remove(os.path.join(results_dir, name))
            removed += 1
    return removed


def is_complete(results_dir: str, name: str) -> bool:
    """Both outputs exist, parse as .npy, and have the right dtypes and matching shapes."""
    x_path, y_path = output_paths(results_dir, name)
    try:
        x = np.load(x_path, mmap_mode="r", allow_pickle=False)
        y = np.load(y_path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return False
    return (x.dtype == np.float32 and y.dtype == np.uint8 and x.ndim == 4 and x.shape[0] == 1
            and x.shape == y.shape and all(s >= m for s, m in zip(x.shape[1:], MIN_SHAPE)))


@contextmanager
def _torch_threads(count: int | None):
    if count is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def process_case(case: RawCase, results_dir: str, torch_threads: int | None = None,
                 target: Sequence[float] = TARGET_SPACING) -> CaseStats:
    """Load, preprocess (to ``target`` spacing) and save one case; returns its statistics and
    its fingerprint entry (:func:`case_fingerprint`, from the arrays as read).

    ``torch_threads`` limits torch's threads for the resampling only (None: leave as set), so
    a case that fails to load never pays for importing torch.
    """
    warnings: list[str] = []
    image, label, spacing = load_case(case, warn=warnings.append)
    shape = image.shape[1:]
    fingerprint = case_fingerprint(case, image, label, spacing)
    with _torch_threads(torch_threads):
        image, label = preprocess_arrays(image, label, spacing, target)
    x_path, y_path = output_paths(results_dir, case.name)
    save_atomic(x_path, image)
    save_atomic(y_path, label)
    save_geometry(results_dir, case.name, shape, spacing, target)
    return CaseStats(case.name, tuple(image.shape), float(image.mean(dtype=np.float64)),
                     float(image.std(dtype=np.float64)), " ".join(warnings), fingerprint)


def median_line(stats: Sequence[CaseStats]) -> str:
    """Median shape (per axis), mean and std over cases."""
    shape = tuple(int(statistics.median(s.shape[i] for s in stats)) for i in range(4))
    return (f"median over {len(stats)} cases: shape {shape}, "
            f"mean {statistics.median(s.mean for s in stats):.4f}, "
            f"std {statistics.median(s.std for s in stats):.4f}")


# ----------------------------------------------------------------------------- parallel runs


def _worker_context():
    """Start worker processes from a clean single-threaded server, never by forking this one.

    Forking a process whose torch has started OpenMP threads can deadlock the child. A
    forkserver that has imported the heavy modules (and run nothing) forks each worker cheaply;
    where there is none (Windows), workers are spawned and import them themselves.
    """
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, "nibabel", "torch"])
    return context


def preprocess_cases(cases: Sequence[RawCase], results_dir: str, num_workers: int,
                     on_done: Callable[[CaseStats], None],
                     target: Sequence[float] = TARGET_SPACING) -> list[CaseStats]:
    """Process ``cases`` across ``num_workers`` processes, calling ``on_done`` per case.

    One worker runs in this process (no start-up cost). Several use a process pool (see
    ``_worker_context``). Either way torch gets one thread per process: the processes already
    use every core, and more threads would only contend. The first error cancels the cases not
    yet started and is raised here. ``on_done`` runs as each case finishes, in finishing order.
    """
    os.makedirs(results_dir, exist_ok=True)
    stats = []
    if num_workers <= 1 or len(cases) <= 1:
        for case in cases:
            stats.append(process_case(case, results_dir, 1, target))
            on_done(stats[-1])
        return stats

    with ProcessPoolExecutor(max_workers=min(num_workers, len(cases)),
                             mp_context=_worker_context()) as pool:
        futures = [pool.submit(process_case, case, results_dir, 1, target) for case in cases]
        try:
            for future in as_completed(futures):
                stats.append(future.result())
                on_done(stats[-1])
        except BrokenProcessPool:
            raise PreprocessError("a worker process ended abruptly; "
                                  "finished cases are kept, run again to resume") from None
        finally:
            for future in futures:
                future.cancel()
    return stats


# ----------------------------------------------------------------------------- verification


@dataclass(frozen=True)
class Problem:
    """One file that fails verification: ``kind`` is "missing", "extra" or "mismatch"."""

    kind: str
    file: str


def md5_file(path: str, chunk: int = 1 << 22) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def load_checksums(path: str) -> dict[str, str]:
    """``{file name: md5}`` from a JSON checksum file."""
    try:
        with open(path) as handle:
            sums = json.load(handle)
    except OSError as exc:
        raise PreprocessError(f"--checksum {path}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise PreprocessError(f"--checksum {path}: not valid JSON ({exc})") from None
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise PreprocessError(f"--checksum {path}: expected a JSON object of file name -> md5")
    return sums


def verify(results_dir: str, checksums: dict[str, str], num_workers: int = 1) -> list[Problem]:
    """Every missing, extra (``.npy`` not in ``checksums``) and mismatching file, by name."""
    if not os.path.isdir(results_dir):
        raise PreprocessError(f"--results_dir {results_dir}: not a directory")
    present = {n for n in os.listdir(results_dir)
               if n.endswith(".npy") and not n.startswith(".")
               and os.path.isfile(os.path.join(results_dir, n))}
    expected = set(checksums)
    to_hash = sorted(present & expected)
    # hashlib releases the GIL on large blocks, so threads hash files in parallel.
    with ThreadPoolExecutor(max_workers=max(1, num_workers)) as pool:
        sums = dict(zip(to_hash, pool.map(md5_file, (os.path.join(results_dir, n)
                                                      for n in to_hash))))
    problems = [Problem("missing", n) for n in expected - present]
    problems += [Problem("extra", n) for n in present - expected]
    problems += [Problem("mismatch", n) for n in to_hash if sums[n] != checksums[n].lower()]
    return sorted(problems, key=lambda p: (p.file, p.kind))

