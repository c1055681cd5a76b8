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
from dataclasses import dataclass
from math import prod
from typing import Sequence

import numpy as np

from data_loading import scan_io
from data_loading.atomic import atomic_write
from data_loading.nifti_read import PreprocessError, read_nifti, read_voxels
from data_loading.preprocessing import (IMAGE_FILE, LABEL_FILE, _case_dirs, min_shape_padding, preprocess_arrays,
                                        resampled_shape, validated_label)
from data_loading.scan_io import NIFTI_SUFFIXES, Orientation, ScanError, is_nifti_name, is_scan_name, scan_name

__all__ = ["NIFTI_SUFFIXES", "ScanError", "is_nifti_name", "is_scan_name", "scan_name"]  # re-exported
OUTPUT_SUFFIX = ".nii.gz"
RECORD_SUFFIX = ".provenance.json"  # predict's record beside each segmentation (runtime.predict.provenance)
GZIP_LEVEL = 1  # nibabel's own default: labels compress well even at the fastest level


@dataclass(frozen=True)
class Scan:
    """One scan to segment: output name, image file and, when it lies beside, the ground truth."""

    name: str
    image_path: str
    label_path: str | None = None


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
    named by its folder (and its SeriesInstanceUID when the folder holds several)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    name = os.path.basename(os.path.normpath(os.path.abspath(folder)))
    series = scan_io.dicom_series_of(path)
    if not os.path.isdir(path) and len(scan_io.dicom_series_in(folder)) > 1:
        name = f"{name}_{series.uid}"
    return Scan(name, path)


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


def _has_dicom(folder: str, names: Sequence[str]) -> bool:
    return any(scan_io.looks_like_dicom(os.path.join(folder, n)) for n in names
               if os.path.isfile(os.path.join(folder, n)))


def dicom_series_below(root: str) -> list[Scan]:
    """Every DICOM series in the folders below ``root`` (up to :data:`SERIES_DEPTH` levels: a
    folder per patient, and the study and series folders under it, as TCIA downloads and PACS
    exports lay them out), one scan each, named by its folder's path below ``root`` with ``_``
    between the parts (``patient1_study_series``), sorted by name. A folder holding several
    series is refused (the one-folder rule), and so are two folders whose names would collide;
    :class:`ScanError` naming them."""
    scans: dict[str, Scan] = {}
    for folder, subfolders, names in os.walk(root):
        depth = os.path.relpath(folder, root).count(os.sep) + 1 if folder != root else 0
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".")) if depth < SERIES_DEPTH else []
        if folder == root or not _has_dicom(folder, [n for n in names if not n.startswith(".")]):
            continue
        series = [one for one in scan_io.dicom_series_in(folder) if one.files]
        if len(series) > 1:
            raise ScanError(scan_io.several_series_message(folder, series))
        if not series:
            continue  # a DICOMDIR, a report: DICOM files that hold no image series
        name = "_".join(os.path.relpath(folder, root).split(os.sep))
        if name in scans:
            raise ScanError(f"--input {root}: the DICOM series in {scans[name].image_path} and {folder} would both "
                            f"be written as {name}{OUTPUT_SUFFIX}")
        scans[name] = Scan(name, folder)
    return [scans[name] for name in sorted(scans)]


def _needs_simpleitk(names: Sequence[str], where: str) -> None:
    others = [n for n in names if not is_nifti_name(n)]
    if others:
        scan_io.simpleitk(os.path.join(where, others[0]) if where else others[0])


def find_scans(input_path: str) -> list[Scan]:
    """The scans ``--input`` names, sorted by name.

    One scan file (``.nii``/``.nii.gz``; ``.nrrd``/``.nhdr``/``.mha``/``.mhd`` and a DICOM
    file, which names its series, through SimpleITK); a KiTS19 case folder (``imaging.nii.gz``
    inside); a KiTS19 tree (``case_XXXXX/`` folders, or its parent with ``data/``), named by case
    folder with ``segmentation.nii.gz`` as ground truth where present; a folder of scan files,
    named by file (but the segmentations a record of predict there says it wrote); a folder
    holding one DICOM series (several are named and refused: one file of the series to segment
    chooses it), named by the folder; or a folder of folders of DICOM series (patients, their
    studies and series: :func:`dicom_series_below`), each series a scan named by its path.
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
    root = input_path
    cases = _case_dirs(root)
    if not cases and os.path.isdir(os.path.join(input_path, "data")):
        root = os.path.join(input_path, "data")
        cases = _case_dirs(root)
    if cases:
        return [_kits_case(os.path.join(root, name), name) for name in cases]
    entries = sorted(f for f in os.listdir(input_path)
                     if not f.startswith(".") and os.path.isfile(os.path.join(input_path, f)))
    made = predict_outputs_in(input_path, entries)
    files = [f for f in entries if is_scan_name(f) and f not in made]
    if not files:
        top = any(scan_io.looks_like_dicom(os.path.join(input_path, f)) for f in entries)
        if top and scan_io.dicom_series_in(input_path):
            return [_dicom_scan(input_path)]
        below = dicom_series_below(input_path) if any(
            os.path.isdir(os.path.join(input_path, d)) and not d.startswith(".") for d in os.listdir(input_path)) else []
        if below:
            return below
        if top:
            return [_dicom_scan(input_path)]
        raise ScanError(f"--input {input_path}: no scan files (.nii, .nii.gz, .nrrd, .nhdr, .mha, .mhd), no "
                        "DICOM series and no case_XXXXX folders in it")
    _needs_simpleitk(files, input_path)
    seen: dict[str, str] = {}
    for f in files:
        if scan_name(f) in seen:
            raise ScanError(f"--input {input_path}: {seen[scan_name(f)]} and {f} would both be written "
                            f"as {scan_name(f)}{OUTPUT_SUFFIX}")
        seen[scan_name(f)] = f
    return [Scan(scan_name(f), os.path.join(input_path, f)) for f in files]


def output_path(output_dir: str, scan: Scan) -> str:
    return os.path.join(output_dir, scan.name + OUTPUT_SUFFIX)


# ----------------------------------------------------------------------------- reading


LABEL_MAP_MAX = 9  # a volume of whole numbers in 0..9 only (two of them at least) is a label map, not CT


def label_map_values(image: np.ndarray) -> list[int] | None:
    """The values of ``image`` when they look like a label map's (whole numbers from 0 to
    :data:`LABEL_MAP_MAX` only, at least two of them: a segmentation given as a scan), else None.
    A CT in HU has negative values (air), or values far above 9."""
    low, high = float(np.min(image)), float(np.max(image))
    if low < 0 or high > LABEL_MAP_MAX or low == high:
        return None
    whole = image.astype(np.uint8)
    if not np.array_equal(whole, image):
        return None
    return [int(v) for v in np.flatnonzero(np.bincount(whole.ravel(), minlength=LABEL_MAP_MAX + 1))]


def refuse_label_map(image: np.ndarray, path: str) -> None:
    """:class:`ScanError` naming ``path`` when ``image`` looks like a label map (:func:`label_map_values`)."""
    values = label_map_values(image)
    if values is not None:
        raise ScanError(f"{path}: every voxel is one of {values}: this looks like a label map (a segmentation), "
                        "not a CT scan in HU; give the CT scan itself")


def read_scan(path: str) -> RawScan:
    """Read one CT scan into the KiTS19 layout (see :class:`RawScan`); :class:`ScanError`
    naming ``path`` on failure (a label map given as a scan too: :func:`refuse_label_map`)."""
    volume = scan_io.read_volume(path)
    if any(not np.isfinite(s) or s <= 0 for s in volume.spacing):
        raise ScanError(f"{path}: spacing (pixdim[1:4]) {volume.file_spacing} is not positive")
    refuse_label_map(volume.image, path)
    return RawScan(volume.image, volume.spacing, volume.nifti, volume.orientation, volume.file_spacing,
                   volume.note)


def read_label(path: str, shape: Sequence[int], scan: Orientation | None = None, scan_path: str = "") -> np.ndarray:
    """Ground truth uint8 (D, H, W) on the grid of its scan of spatial ``shape`` (the file's
    own axes); ``scan`` the scan's :class:`Orientation` (its affine) or None to read the scan
    ``scan_path``'s header for it. A label stored in another axis order or with axes flipped
    (the same voxels in space: its affine says so) is brought to the scan's axes exactly; one
    on another grid, of another shape, unreadable or with values outside {0, 1, 2} is a
    :class:`ScanError` naming it (and the scan): :func:`data_loading.scan_io.label_on_scan_grid`."""
    try:
        nifti = read_nifti(path)
        raw = read_voxels(nifti, path)
        if scan is None and scan_path:
            scan = scan_io.header_geometry(scan_path)[2]
        if scan is None or scan.affine is None:
            if tuple(raw.shape) != tuple(shape):
                raise ScanError(f"{path}: shape {tuple(raw.shape)} differs from the scan's {tuple(shape)}")
            return validated_label(raw, path)
        label = validated_label(raw, path)
        return scan_io.label_file_on_scan_grid(label, nifti, scan.affine, shape, path, scan_path or "the scan")
    except PreprocessError as exc:
        raise ScanError(str(exc)) from None


def read_labels_file(path: str) -> tuple[np.ndarray, list[float]]:
    """A segmentation written earlier: labels uint8 (D, H, W) and its spacing (mm: the scan's,
    :func:`data_loading.scan_io.nifti_spacing`'s rule on its header, which is the scan's)."""
    try:
        nifti = read_nifti(path)
        labels = validated_label(read_voxels(nifti, path), path)
    except PreprocessError as exc:
        raise ScanError(f"{exc} (an earlier output; --force rewrites it)") from None
    pixdim = nifti.header["pixdim"][1:4].tolist()
    try:
        affine, form = scan_io.nifti_affine(nifti.header, path)
    except ScanError:
        return labels, pixdim
    return labels, scan_io.nifti_spacing(pixdim, affine, form, path)[0]


# ----------------------------------------------------------------------------- preprocessing


def scan_geometry(shape: Sequence[int], spacing: list[float]) -> ScanGeometry:
    """Where the preprocessing takes a scan of spatial ``shape`` at ``spacing`` (pure)."""
    resampled = tuple(resampled_shape(shape, spacing))
    return ScanGeometry(tuple(int(s) for s in shape), resampled, tuple(min_shape_padding(resampled)))


def preprocess_scan(raw: RawScan, path: str = "") -> tuple[np.ndarray, ScanGeometry]:
    """The network's input float32 (1, D', H', W') exactly as ``preprocess_dataset.py`` makes
    it, and the geometry to come back."""
    geometry = scan_geometry(raw.image.shape[1:], raw.spacing)
    if min(geometry.resampled) < 1:
        raise ScanError(f"{path}: shape {geometry.original} at spacing {raw.spacing} mm resamples "
                        f"to {geometry.resampled} voxels: too small")
    image, _ = preprocess_arrays(raw.image, None, raw.spacing)
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

