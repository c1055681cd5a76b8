"""Raw CT scans to segment: discovery, reading, the benchmark's preprocessing, and the way back
to the scan's own grid (drop the padding, resample class probabilities, argmax, write NIfTI).

Reading (any format, any orientation) is :mod:`data_loading.scan_io`'s: a scan arrives here in
the KiTS19 layout the network was trained in (array axis 0 the slices, axis codes I-P-L), with
its spacing permuted alike, and its segmentation goes back to the file's own axes
(:meth:`RawScan.to_file`) before it is written with the scan's header. A scan already in the
KiTS19 layout is not moved at all.

A scan goes through exactly the steps of ``preprocess_dataset.py`` (the functions of
:mod:`data_loading.preprocessing` are called, not copied): image float32 from the file,
resampled to the target spacing (trilinear, ``align_corners=True``), clipped and normalised,
edge-padded to at least 128 per axis. :class:`ScanGeometry` records the shapes on the way so
that the probabilities come back to the original voxel grid: the padding is cropped, each class
map is resampled (trilinear, ``align_corners=True``, the inverse of the forward mapping) to the
original shape, and the argmax is taken there.

Problems with an input file raise :class:`ScanError`, one line naming the file.
"""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, replace
from math import prod
from typing import Sequence

import numpy as np

from data_loading import scan_io
from data_loading.description import CHANNEL_SUFFIX
from data_loading.atomic import atomic_write
from data_loading.nifti_read import PreprocessError, read_nifti, read_voxels
from data_loading.preprocessing import (CASE_DIR, IMAGE_FILE, LABEL_FILE, LABEL_VALUES, TARGET_SPACING, case_dirs,
                                        min_shape_padding, preprocess_arrays, resampled_shape, validated_label)
from data_loading.scan_io import (LABEL_MAP_MAX, NIFTI_SUFFIXES, Orientation, ScanError, is_nifti_name, is_scan_name,
                                  label_map_values, refuse_label_map, scan_name)

__all__ = ["LABEL_MAP_MAX", "NIFTI_SUFFIXES", "ScanError", "is_nifti_name", "is_scan_name", "label_map_values",
           "refuse_label_map", "scan_name"]  # re-exported
OUTPUT_SUFFIX = ".nii.gz"
RECORD_SUFFIX = ".provenance.json"  # predict's record beside each segmentation (runtime.predict.provenance)
GZIP_LEVEL = 1  # nibabel's own default: labels compress well even at the fastest level


@dataclass(frozen=True)
class Scan:
    """One scan to segment: output name, image file and, when it lies beside, the ground truth.

    An entry of ``--input`` that is not segmented is a ``Scan`` too, so that the summary names
    it: ``left_out`` says why it is no scan (a text file, a localiser series, an empty folder),
    ``unreadable`` why a scan it may be cannot be read (a broken link, a folder that cannot be
    listed, a second scan of the same output name): that one fails."""

    name: str
    image_path: str
    label_path: str | None = None
    left_out: str = ""
    unreadable: str = ""

    @property
    def is_scan(self) -> bool:
        return not (self.left_out or self.unreadable)


@dataclass(frozen=True)
class RawScan:
    """A scan as read, in the KiTS19 layout: ``image`` float32 (1, D, H, W) in the file's units
    (HU for CT), ``spacing`` mm per axis in that order (``pixdim[1:4]`` permuted with the axes),
    ``nifti`` the NIfTI image (header, affine, the file's shape) the segmentation is written
    with, ``orientation`` the way back to the file's axes, ``file_spacing`` the file's own
    spacing in its own axis order (``pixdim[1:4]``, or the affine's voxel sizes where the two
    disagree: :func:`data_loading.scan_io.nifti_spacing`), ``note`` the line saying so."""

    image: np.ndarray
    spacing: list[float]
    nifti: object
    orientation: Orientation | None = None
    file_spacing: list[float] | None = None
    note: str = ""

    def to_file(self, labels: np.ndarray) -> np.ndarray:
        """Labels (D, H, W) of the KiTS19 layout on the file's own axes (itself when unmoved)."""
        return labels if self.orientation is None else self.orientation.to_file(labels)

    def to_kits(self, labels: np.ndarray) -> np.ndarray:
        """Labels on the file's own axes in the KiTS19 layout (itself when unmoved)."""
        return labels if self.orientation is None else self.orientation.to_kits(labels)

    @property
    def file_shape(self) -> tuple[int, ...]:
        return self.orientation.file_shape if self.orientation is not None else tuple(self.image.shape[1:])


@dataclass(frozen=True)
class ScanGeometry:
    """Spatial shapes on the way through preprocessing: ``original`` (the file's), ``resampled``
    (at the target spacing) and ``padding`` ((before, after) per axis) to the padded shape."""

    original: tuple[int, ...]
    resampled: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]

    @property
    def padded(self) -> tuple[int, ...]:
        return tuple(s + b + a for s, (b, a) in zip(self.resampled, self.padding))


# ----------------------------------------------------------------------------- discovery


def _kits_case(folder: str, name: str) -> Scan:
    label = os.path.join(folder, LABEL_FILE)
    return Scan(name, os.path.join(folder, IMAGE_FILE), label if os.path.isfile(label) else None)


def _dicom_scan(path: str) -> Scan:
    """The DICOM series ``path`` names (a folder holding one series, or a file of a series),
    named by its folder (and the series' number and description when the folder holds several:
    :attr:`data_loading.scan_io.DicomSeries.label`)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    name = os.path.basename(os.path.normpath(os.path.abspath(folder)))
    series = scan_io.dicom_series_of(path)
    if not os.path.isdir(path):
        others = [s for s in scan_io.dicom_series_in(folder) if s.files]
        if len(others) > 1:
            name = f"{name}_{_series_labels(others)[series.uid]}"
    return Scan(name, path)


MIN_SERIES_SLICES = 10  # a series of fewer images is no CT volume to segment (a localiser, a dose report)


def _series_labels(series: Sequence[scan_io.DicomSeries]) -> dict[str, str]:
    """Each series' label (:attr:`~data_loading.scan_io.DicomSeries.label`), its UID added
    where two of the folder's would be the same."""
    labels = [s.label for s in series]
    return {s.uid: label if labels.count(label) == 1 else f"{label}_{s.uid}" for s, label in zip(series, labels)}


def series_left_out(series: scan_io.DicomSeries) -> str:
    """Why a series found in a folder is not segmented, or "": a localiser, or fewer than
    :data:`MIN_SERIES_SLICES` images."""
    shown = f"series {series.number or series.uid}" + (f" '{series.description}'" if series.description else "")
    if series.localizer:
        return f"{shown}: a localiser ({series.image_type or series.description}, {len(series.files)} images)"
    if len(series.files) < MIN_SERIES_SLICES:
        return f"{shown}: {len(series.files)} images, too few slices for a CT volume (fewer than {MIN_SERIES_SLICES})"
    return ""
def is_record(stored) -> bool:
    """Whether ``stored`` (a JSON value read back) is a record of predict
    (:mod:`runtime.predict.provenance`)."""
    return isinstance(stored, dict) and isinstance(stored.get("version"), str) and "input_sha256" in stored


def recorded_files(stored, output: str) -> set[str]:
    """The names (in the output folder) of the files the record ``stored`` says its segmentation
    ``output`` made: its ``files``; a record from before they were listed vouches for
    ``output`` and its ``probabilities``. Nothing for what is no record of predict."""
    if not is_record(stored):
        return set()
    files = stored.get("files")
    if isinstance(files, list):
        return {f for f in files if isinstance(f, str) and f and os.path.basename(f) == f}
    legacy = {os.path.basename(output)}
    if isinstance(stored.get("probabilities"), str) and stored["probabilities"]:
        legacy.add(os.path.basename(stored["probabilities"]))
    return legacy


def predict_outputs_in(folder: str, names: Sequence[str]) -> set[str]:
    """The names among ``names`` (files of ``folder``) that a record of predict there says it
    wrote: segmentations of an earlier run into the scans' own folder, which are no scans."""
    made: set[str] = set()
    for name in names:
        if not name.endswith(RECORD_SUFFIX):
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                stored = json.load(handle)
        except (OSError, ValueError):
            continue
        made |= recorded_files(stored, name[: -len(RECORD_SUFFIX)] + OUTPUT_SUFFIX)
    return made


SERIES_DEPTH = 4  # patient / study / series folders below --input (and a PACS export's DICOM/ above them)
SUMMARY_NAMES = ("summary.csv", "summary.jsonl")  # predict's summary, when --output_dir is the scans' folder


def _has_dicom(folder: str, names: Sequence[str]) -> bool:
    return any(scan_io.looks_like_dicom(os.path.join(folder, n)) for n in names
               if os.path.isfile(os.path.join(folder, n)))


def _unreadable(name: str, path: str, exc: OSError) -> Scan:
    return Scan(name, path, unreadable=f"{path}: cannot be read ({exc.strerror or type(exc).__name__})")


def series_scans(folder: str, name: str) -> list[Scan]:
    """The DICOM series of ``folder`` (not its subfolders), each a scan named ``name`` (the
    folder's only series) or ``name_<label>`` (:func:`_series_labels`: one folder, several
    series, each segmented on its own); localisers and series of too few images
    (:func:`series_left_out`) are left out, named. A series of a folder of several is given by
    its first file (a file chooses its series)."""
    try:
        series = [one for one in scan_io.dicom_series_in(folder) if one.files]
    except ScanError as exc:  # SimpleITK not installed
        return [Scan(name, folder, unreadable=str(exc))]
    if len(series) == 1:
        why = series_left_out(series[0])
        return [Scan(name, folder, left_out=why)]
    labels = _series_labels(series)
    return [Scan(f"{name}_{labels[one.uid]}", one.files[0], left_out=series_left_out(one)) for one in series]


def dicom_series_below(root: str, start: str | None = None) -> list[Scan]:
    """Every DICOM series in ``start`` (default ``root``) and the folders below it (up to
    :data:`SERIES_DEPTH` levels below ``root``: a folder per patient, and the study and series
    folders under it, as TCIA downloads and PACS exports lay them out), one scan each, named by
    its folder's path below ``root`` with ``_`` between the parts (``patient1_study_series``),
    each series of a folder holding several its own scan (:func:`series_scans`); a folder that
    cannot be listed is an unreadable entry; sorted by name."""
    start = start or root
    found: list[Scan] = []

    def refused(exc: OSError) -> None:
        found.append(_unreadable("_".join(os.path.relpath(exc.filename, root).split(os.sep)) + "/",
                                 exc.filename, exc))

    for folder, subfolders, names in os.walk(start, onerror=refused):
        depth = os.path.relpath(folder, root).count(os.sep) + 1 if folder != root else 0
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".")) if depth < SERIES_DEPTH else []
        if folder == root or not _has_dicom(folder, [n for n in names if not n.startswith(".")]):
            continue
        found += series_scans(folder, "_".join(os.path.relpath(folder, root).split(os.sep)))
    return sorted(found, key=lambda scan: scan.name)


def _needs_simpleitk(names: Sequence[str], where: str) -> None:
    others = [n for n in names if not is_nifti_name(n)]
    if others:
        scan_io.simpleitk(os.path.join(where, others[0]) if where else others[0])


def _kits_cases(root: str) -> list[Scan]:
    """The case folders of a KiTS19 tree ``root``, each a scan (or left out without its image)."""
    return [_kits_case(os.path.join(root, name), name) if os.path.isfile(os.path.join(root, name, IMAGE_FILE))
            else Scan(name + "/", os.path.join(root, name), left_out=f"a case folder without {IMAGE_FILE}")
            for name in case_dirs(root)]


def folder_scans(root: str, name: str) -> list[Scan]:
    """What the folder ``name`` of ``--input`` ``root`` holds: a KiTS19 case (``imaging.nii.gz``
    inside), a KiTS19 tree (``case_XXXXX/`` folders, as the KiTS19 repository's ``data/``), or
    DICOM series (:func:`dicom_series_below`); else one entry left out, saying what it holds."""
    path = os.path.join(root, name)
    try:
        names = sorted(n for n in os.listdir(path) if not n.startswith("."))
    except OSError as exc:
        return [_unreadable(name + "/", path, exc)]
    if IMAGE_FILE in names and os.path.isfile(os.path.join(path, IMAGE_FILE)):
        return [_kits_case(path, name)]
    cases = _kits_cases(path)
    if cases:
        return cases
    if CASE_DIR.match(name):
        return [Scan(name + "/", path, left_out=f"a case folder without {IMAGE_FILE}")]
    series = dicom_series_below(root, path)
    if series:
        return series
    files = [n for n in names if is_scan_name(n) and os.path.isfile(os.path.join(path, n))]
    if not names:
        why = "an empty folder"
    elif files:
        why = (f"a folder of {len(files)} scan file{'s' if len(files) > 1 else ''} (folders of scan files are not "
               f"searched: give it as --input to segment them)")
    else:
        why = "a folder holding no scan (no DICOM series, imaging.nii.gz or case_XXXXX folder)"
    if is_scan_name(name):
        why = f"a folder named like a scan file: {why}"
    return [Scan(name + "/", path, left_out=why)]


def _data_files(folder: str, names: Sequence[str]) -> set[str]:
    """The data files that ``.mhd``/``.nhdr`` headers among ``names`` name: part of their scan."""
    found = set()
    for name in names:
        if _lower_name(name).endswith((".mhd", ".nhdr")):
            data = scan_io.detached_data_file(os.path.join(folder, name))
            if data and os.path.dirname(os.path.abspath(data)) == os.path.abspath(folder):
                found.add(os.path.basename(data))
    return found


def _lower_name(name: str) -> str:
    return name.lower()


def _entry(root: str, name: str) -> list[Scan] | None:
    """The scans (or the entry left out, or unreadable) of one entry ``name`` of the folder
    ``root``; None for a DICOM file (the folder's own series: :func:`series_scans`)."""
    path = os.path.join(root, name)
    if os.path.islink(path) and not os.path.exists(path):
        return [Scan(name, path, unreadable=f"{path}: a broken symbolic link (to {os.readlink(path)})")]
    if os.path.isdir(path):
        return folder_scans(root, name)
    if not os.path.isfile(path):
        return [Scan(name, path, left_out="neither a file nor a folder (a device, a pipe or a socket)")]
    if is_scan_name(name):
        return [Scan(scan_name(name), path)]
    if scan_io.looks_like_dicom(path):
        return None
    if not os.access(path, os.R_OK):
        return [Scan(name, path, unreadable=f"{path}: cannot be read (permission denied)")]
    return [Scan(name, path, left_out="not a scan file (.nii, .nii.gz, .nrrd, .nhdr, .mha, .mhd, DICOM)")]


def _one_name_each(found: Sequence[Scan], root: str) -> list[Scan]:
    """``found`` sorted by name, every name once: a second scan that would be written under the
    name of an earlier one fails, named by its path below ``root``."""
    seen: dict[str, Scan] = {}
    out = []
    for scan in sorted(found, key=lambda s: (s.name, s.image_path)):
        first = seen.get(scan.name)
        if first is None:
            seen[scan.name] = scan
            out.append(scan)
            continue
        shown = os.path.relpath(scan.image_path, root)
        out.append(Scan(shown, scan.image_path, unreadable=(
            f"--input {root}: {first.image_path} and {scan.image_path} would both be written as "
            f"{scan.name}{OUTPUT_SUFFIX}; the first is segmented")))
    return sorted(out, key=lambda s: s.name)


def find_inputs(input_path: str, output_dir: str | None = None) -> list[Scan]:
    """Every entry of ``--input``, sorted by name: the scans to segment and, for a folder, each
    entry that is no scan (``left_out``) or cannot be read (``unreadable``), so that none is
    passed over without a word.

    One scan file (``.nii``/``.nii.gz``; ``.nrrd``/``.nhdr``/``.mha``/``.mhd`` and a DICOM
    file, which names its series, through SimpleITK); a KiTS19 case folder (``imaging.nii.gz``
    inside); or a folder, each of whose entries (hidden ones aside) is, side by side: a scan
    file, named by file; a KiTS19 case folder (``case_XXXXX/``, ``segmentation.nii.gz`` as
    ground truth where present) or a KiTS19 tree (such folders in a folder, as ``data/``),
    named by case; a folder of DICOM series (patients, their studies and series:
    :func:`dicom_series_below`), each series a scan named by its path; the folder's own DICOM
    files, its series named by the folder. The segmentations, records and summary of an earlier
    run into the same folder (a record of predict there says it wrote them), and the data files
    of ``.mhd``/``.nhdr`` headers, are no entries of their own. A folder holding no scan at all
    is one :class:`ScanError` line. ``output_dir`` (predict's ``--output_dir``) inside the folder is
    left out as this run's outputs, never read as scans.
    """
    if os.path.isfile(input_path):
        if is_scan_name(input_path):
            _needs_simpleitk([input_path], "")
            return [Scan(scan_name(input_path), input_path)]
        if scan_io.looks_like_dicom(input_path):
            return [_dicom_scan(input_path)]
        raise ScanError(f"--input {input_path}: not a scan file (expected .nii, .nii.gz, .nrrd, .nhdr, .mha, "
                        ".mhd or a DICOM file)")
    if not os.path.isdir(input_path):
        raise ScanError(f"--input {input_path}: no such file or folder")
    if os.path.isfile(os.path.join(input_path, IMAGE_FILE)):
        return [_kits_case(input_path, os.path.basename(os.path.normpath(input_path)))]
    try:
        names = sorted(n for n in os.listdir(input_path) if not n.startswith("."))
    except OSError as exc:
        raise ScanError(f"--input {input_path}: cannot be read ({exc.strerror})") from None
    made = predict_outputs_in(input_path, names)
    ours = made | _data_files(input_path, names) | {
        n for n in names if n.endswith(RECORD_SUFFIX) and n[: -len(RECORD_SUFFIX)] + OUTPUT_SUFFIX in made}
    if made:
        ours |= set(SUMMARY_NAMES)
    found: list[Scan] = []
    own_series = False
    outputs = os.path.realpath(output_dir) if output_dir else None
    for name in names:
        if name in ours:
            continue
        if outputs and os.path.realpath(os.path.join(input_path, name)) == outputs:
            found.append(Scan(name + "/", os.path.join(input_path, name), left_out="the --output_dir of this run"))
            continue
        scans = _entry(input_path, name)
        own_series |= scans is None
        found += scans or []
    if own_series:
        found += series_scans(input_path, os.path.basename(os.path.normpath(os.path.abspath(input_path))))
    if not any(scan.is_scan or scan.unreadable for scan in found):
        raise ScanError(f"--input {input_path}: no scan files (.nii, .nii.gz, .nrrd, .nhdr, .mha, .mhd), no "
                        "DICOM series and no case_XXXXX folders in it")
    return _one_name_each(found, input_path)


LABEL_FOLDERS = {"imagesTr": "labelsTr", "imagesTs": "labelsTs"}  # nnU-Net's raw layout


def truth_names(scan: Scan) -> list[str]:
    """The file names a ground truth of ``scan`` may have: ``<name>`` with a scan suffix, and
    ``<name>`` without nnU-Net's channel suffix (``case_0000`` -> ``case``), each ``.nii.gz`` or
    ``.nii``, as ``labelsTr`` holds them."""
    stems = [scan.name] + ([scan.name[:-len(CHANNEL_SUFFIX)]] if scan.name.endswith(CHANNEL_SUFFIX) else [])
    return [stem + suffix for stem in reversed(stems) for suffix in NIFTI_SUFFIXES]


def truth_in(folder: str, scan: Scan) -> str | None:
    """The ground truth of ``scan`` in ``folder``: a file of :func:`truth_names`, or a KiTS case
    folder's ``<name>/segmentation.nii.gz``; None when there is none."""
    for name in truth_names(scan) + [os.path.join(scan.name, LABEL_FILE)]:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def with_truths(scans: Sequence[Scan], truth_dir: str = "") -> list[Scan]:
    """``scans`` with the ground truth each has: in ``truth_dir`` (``--truth``) when given, else
    where the data keeps it: a KiTS case's ``segmentation.nii.gz`` beside its scan (found
    already), or nnU-Net's ``labelsTr`` (``labelsTs``) beside the scan file's ``imagesTr``
    (``imagesTs``) folder. A scan of no such place has none (it is segmented, not scored)."""
    out = []
    for scan in scans:
        if not scan.is_scan or not os.path.isfile(scan.image_path):
            out.append(scan)
            continue
        folder = os.path.dirname(os.path.abspath(scan.image_path))
        labels = LABEL_FOLDERS.get(os.path.basename(folder))
        found = (truth_in(truth_dir, scan) if truth_dir else
                 scan.label_path or (truth_in(os.path.join(os.path.dirname(folder), labels), scan) if labels else None))
        out.append(replace(scan, label_path=found))
    return out


def find_scans(input_path: str) -> list[Scan]:
    """The scans ``--input`` names (:func:`find_inputs`, without the entries that are none)."""
    return [scan for scan in find_inputs(input_path) if scan.is_scan]


def output_path(output_dir: str, scan: Scan) -> str:
    return os.path.join(output_dir, scan.name + OUTPUT_SUFFIX)


# ----------------------------------------------------------------------------- reading


def read_scan(path: str) -> RawScan:
    """Read one CT scan into the KiTS19 layout (see :class:`RawScan`) as preprocessing reads own
    data (:func:`data_loading.scan_io.read_case`); :class:`ScanError` naming ``path`` on failure
    (a label map given as a scan too: :func:`refuse_label_map`)."""
    volume = scan_io.read_case(path).volume
    return RawScan(volume.image, volume.spacing, volume.nifti, volume.orientation, volume.file_spacing,
                   volume.note)


def read_label(path: str, shape: Sequence[int], scan: Orientation | None = None, scan_path: str = "",
               label_values: Sequence[int] = LABEL_VALUES) -> np.ndarray:
    """Ground truth uint8 (D, H, W) on the grid of its scan of spatial ``shape`` (the file's
    own axes); ``scan`` the scan's :class:`Orientation` (its affine) or None to read the scan
    ``scan_path``'s header for it. A label stored in another axis order or with axes flipped
    (the same voxels in space: its affine says so) is brought to the scan's axes exactly; one
    on another grid, of another shape, unreadable or with values outside ``label_values``
    (KiTS19's {0, 1, 2}; the network's label set) is a :class:`ScanError` naming it (and the
    scan): :func:`data_loading.scan_io.read_label_on_scan`, preprocessing's reader of labels."""
    if scan is None and scan_path:
        scan = scan_io.header_geometry(scan_path)[2]
    if scan is not None and scan.affine is not None:
        return scan_io.read_label_on_scan(path, scan.affine, shape, scan_path or "the scan", label_values)
    try:
        raw = read_voxels(read_nifti(path), path)
        if tuple(raw.shape) != tuple(shape):
            raise ScanError(f"{path}: shape {tuple(raw.shape)} differs from the scan's {tuple(shape)}")
        return validated_label(raw, path, label_values)
    except PreprocessError as exc:
        raise ScanError(str(exc)) from None


def read_labels_file(path: str, label_values: Sequence[int] = LABEL_VALUES) -> tuple[np.ndarray, list[float]]:
    """A segmentation written earlier: labels uint8 (D, H, W) and its spacing (mm: the scan's,
    :func:`data_loading.scan_io.nifti_spacing`'s rule on its header, which is the scan's)."""
    try:
        nifti = read_nifti(path)
        labels = validated_label(read_voxels(nifti, path), path, label_values)
    except PreprocessError as exc:
        raise ScanError(f"{exc} (an earlier output; --force rewrites it)") from None
    pixdim = nifti.header["pixdim"][1:4].tolist()
    try:
        affine, form = scan_io.nifti_affine(nifti.header, path)
    except ScanError:
        return labels, pixdim
    return labels, scan_io.nifti_spacing(pixdim, affine, form, path)[0]


# ----------------------------------------------------------------------------- preprocessing


def scan_geometry(shape: Sequence[int], spacing: list[float],
                  target: Sequence[float] = TARGET_SPACING) -> ScanGeometry:
    """Where the preprocessing takes a scan of spatial ``shape`` at ``spacing`` to ``target``
    (mm per axis, KiTS19's by default) (pure)."""
    resampled = tuple(resampled_shape(shape, spacing, list(target)))
    return ScanGeometry(tuple(int(s) for s in shape), resampled, tuple(min_shape_padding(resampled)))


def preprocess_scan(raw: RawScan, path: str = "",
                    target: Sequence[float] = TARGET_SPACING) -> tuple[np.ndarray, ScanGeometry]:
    """The network's input float32 (1, D', H', W') exactly as ``preprocess_dataset.py`` makes
    it at the ``target`` spacing (the network's: ``runtime.spacing``; KiTS19's by default), and
    the geometry to come back."""
    geometry = scan_geometry(raw.image.shape[1:], raw.spacing, target)
    if min(geometry.resampled) < 1:
        raise ScanError(f"{path}: shape {geometry.original} at spacing {raw.spacing} mm resamples "
                        f"to {geometry.resampled} voxels: too small")
    image, _ = preprocess_arrays(raw.image, None, raw.spacing, list(target))
    if tuple(image.shape[1:]) != geometry.padded:  # the two must describe the same steps
        raise AssertionError(f"preprocessed shape {image.shape[1:]} != geometry {geometry.padded}")
    return image, geometry


# ----------------------------------------------------------------------------- back to the scan


def crop_padding(volume, geometry: ScanGeometry):
    """``volume[..., D', H', W']`` without the min-shape padding: ``[..., resampled]``."""
    index = tuple(slice(b, b + s) for (b, _), s in zip(geometry.padding, geometry.resampled))
    return volume[(..., *index)]


def labels_in_original_grid(probabilities, geometry: ScanGeometry):
    """Class probabilities (C, D', H', W') torch float on the padded grid -> labels uint8
    (D, H, W) numpy on the original grid.

    The padding is cropped, each class map is resampled to the original shape (trilinear,
    ``align_corners=True``: the inverse of the forward resampling) and the argmax is taken
    there. One class at a time, keeping the running maximum, so the peak memory is two float
    maps of the original grid (rather than C); ties go to the lower class, as ``argmax``.
    """
    import torch
    from torch.nn.functional import interpolate

    probabilities = crop_padding(probabilities, geometry)
    if tuple(probabilities.shape[1:]) == geometry.original:
        return probabilities.argmax(0).to(torch.uint8).cpu().numpy()
    labels = torch.zeros(geometry.original, dtype=torch.uint8, device=probabilities.device)
    best = None
    for c in range(probabilities.shape[0]):
        p = interpolate(probabilities[c][None, None].float(), size=geometry.original, mode="trilinear",
                        align_corners=True)[0, 0]
        if best is None:
            best = p
            continue
        better = p > best
        labels[better] = c
        best = torch.maximum(best, p, out=best)
        del p, better
    return labels.cpu().numpy()


def voxel_volume_ml(spacing: Sequence[float]) -> float:
    """Millilitres per voxel for ``spacing`` in mm."""
    return prod(abs(float(s)) for s in spacing) / 1000.0


def class_volumes_ml(labels: np.ndarray, spacing: Sequence[float], classes: Sequence[int] = (1, 2)) -> list[float]:
    """Volume of each class in ``labels`` (voxel count x voxel volume), in millilitres."""
    per_voxel = voxel_volume_ml(spacing)
    return [int(np.count_nonzero(labels == c)) * per_voxel for c in classes]


def segmentation_nifti(labels: np.ndarray, reference):
    """A NIfTI image of ``labels`` (uint8, the reference's array shape) with the reference's
    affine and header: qform, sform (and their codes), pixdim, units and description unchanged.
    Only the data type changes, and the display range (``cal_min``/``cal_max``) is cleared
    since a CT window makes no sense for labels."""
    if tuple(labels.shape) != tuple(reference.shape):
        raise ValueError(f"labels {labels.shape} do not fit the scan {reference.shape}")
    header = reference.header.copy()
    header.set_data_dtype(np.uint8)
    header["cal_min"], header["cal_max"] = 0, 0
    return type(reference)(np.asarray(labels, dtype=np.uint8), reference.affine, header)


def write_segmentation(path: str, labels: np.ndarray, reference) -> None:
    """Write ``labels`` as ``path`` (.nii.gz) atomically: a temporary name, then a rename."""
    payload = segmentation_nifti(labels, reference).to_bytes()

    def write(handle):
        with gzip.GzipFile(fileobj=handle, mode="wb", compresslevel=GZIP_LEVEL, mtime=0) as stream:
            stream.write(payload)

    atomic_write(path, write)

