"""A scan's voxels and geometry, in any orientation and format: the one module that reads them.

Every volume is described as a NIfTI file describes it: an array on the file's own axes (for
NIfTI ``(i, j, k)`` as stored) and a 4x4 affine from array index to world millimetres in
nibabel's RAS+ convention, whose axis codes (:func:`nibabel.aff2axcodes`) name the direction each
array axis runs towards.

The network was trained on KiTS19 as ``preprocess_dataset.py`` reads it, with the array as it
lies: axis 0 the slices running Inferior, axis 1 running Posterior, axis 2 running Left (axis
codes I-P-L, :data:`KITS_CODES`). :class:`Orientation` maps any scan's array to that layout from
its affine (nibabel's ``io_orientation``, ``ornt_transform``, ``apply_orientation``) and the
segmentation back to the file's own axes. A file already in the KiTS19 layout is not touched:
:meth:`Orientation.to_kits` returns the very array it is given, so such a scan takes exactly the
numerical path it took before orientations were read (and the benchmark's preprocessing, which
reads KiTS19 as it lies, is not involved here at all).

Which affine: the sform when its code is non-zero and it is usable, else the qform likewise
(nibabel's order). Unusable: not finite, singular, or sheared (the columns not orthogonal within
:data:`SHEAR_TOLERANCE`, e.g. an uncorrected gantry tilt). A scan with no usable affine is one
:class:`ScanError` line naming the file.

Formats: NIfTI through nibabel, exactly as preprocessing reads it
(:func:`data_loading.nifti_read.load_image`); NRRD (``.nrrd``/``.nhdr``), MetaImage
(``.mha``/``.mhd``) and a folder holding a DICOM series through SimpleITK, an optional dependency
(:data:`SIMPLEITK_INSTALL`). A DICOM series is read with ``ImageSeriesReader``: files sorted by
ImagePositionPatient along the slice normal (GDCM), RescaleSlope/Intercept applied; a series
whose slices are not evenly spaced (a missing slice) or not stacked along their normal (a gantry
tilt) is refused. SimpleITK's geometry (origin, spacing, direction cosines in LPS, array
``(k, j, i)``) becomes the NIfTI affine of the array ``(i, j, k)``:
``diag(-1, -1, 1) @ direction @ diag(spacing)`` and origin ``diag(-1, -1, 1) @ origin``, as
ITK's own NIfTI writer does. Segmentations of such inputs are written as NIfTI with that affine
(qform and sform, code 1, scanner) and the input's array shape ``(i, j, k)``.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from data_loading.dataset import DataError
from data_loading.description import KITS19
from data_loading.nifti_read import PreprocessError, load_image, read_nifti, read_voxels, validated_label

KITS_CODES = ("I", "P", "L")  # KiTS19's array axes as preprocessing reads them: slices, height, width
SHEAR_TOLERANCE = 1e-3  # |cos| between two affine columns above this (about 0.06 degrees): sheared
SLICE_SPACING_TOLERANCE = 1e-2  # relative: a DICOM slice step further than this from the mean is uneven
SPACING_TOLERANCE = 1e-3  # relative: pixdim[1:4] further than this from the affine's voxel sizes disagrees
GRID_TOLERANCE = 1e-2  # voxels: a label's voxel centres further than this from its scan's are another grid
NIFTI_SUFFIXES = (".nii.gz", ".nii")
SIMPLEITK_SUFFIXES = (".nrrd", ".nhdr", ".mha", ".mhd")
SCAN_SUFFIXES = NIFTI_SUFFIXES + SIMPLEITK_SUFFIXES
DICOM_SUFFIXES = (".dcm", ".dicom", ".ima")
SIMPLEITK_INSTALL = "pip install SimpleITK"


class ScanError(DataError):
    """A scan (or the input/output folder) that cannot be used; ``str()`` is one line."""


# ----------------------------------------------------------------------------- orientation


def _kits_ornt():
    from nibabel.orientations import axcodes2ornt

    return axcodes2ornt(KITS_CODES)


@dataclass(frozen=True)
class Orientation:
    """How a scan's array axes map to the KiTS19 layout.

    ``codes``: the file's axis codes (``aff2axcodes``, e.g. ``('R', 'A', 'S')``);
    ``to_kits_ornt``/``to_file_ornt``: nibabel orientation transforms (row ``i``: array axis
    ``i`` goes to axis ``ornt[i, 0]``, reversed when ``ornt[i, 1]`` is -1); ``file_shape``: the
    file's array shape.
    """

    codes: tuple[str, ...]
    to_kits_ornt: np.ndarray
    to_file_ornt: np.ndarray
    file_shape: tuple[int, ...]
    affine: np.ndarray | None = field(default=None, compare=False)  # the file's affine it was read from

    @property
    def identity(self) -> bool:
        """The file is in the KiTS19 layout already: nothing is moved."""
        return bool(np.array_equal(self.to_kits_ornt, [[0, 1], [1, 1], [2, 1]]))

    @property
    def kits_shape(self) -> tuple[int, ...]:
        shape = [0, 0, 0]
        for size, (axis, _) in zip(self.file_shape, self.to_kits_ornt):
            shape[int(axis)] = int(size)
        return tuple(shape)

    def spacing_to_kits(self, spacing: Sequence[float]) -> list[float]:
        """``spacing`` (file axis order) permuted with the axes; the very list when nothing moves."""
        if self.identity:
            return spacing if isinstance(spacing, list) else list(spacing)
        kits = [0.0, 0.0, 0.0]
        for value, (axis, _) in zip(spacing, self.to_kits_ornt):
            kits[int(axis)] = value
        return kits

    def to_kits(self, array: np.ndarray, dtype=None) -> np.ndarray:
        """A (D, H, W) array of the file's axes in the KiTS19 layout, contiguous (and cast to
        ``dtype`` in the same copy when given); ``array`` itself when the file is in that
        layout and no ``dtype`` is asked for."""
        if self.identity and dtype is None:
            return array
        from nibabel.orientations import apply_orientation

        if tuple(array.shape) != self.file_shape:
            raise ValueError(f"array {array.shape} is not of the file's shape {self.file_shape}")
        moved = array if self.identity else apply_orientation(array, self.to_kits_ornt)  # a view
        return np.ascontiguousarray(moved, dtype=dtype)

    def to_file(self, array: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`to_kits`: a KiTS19-layout array back on the file's axes."""
        if self.identity:
            return array
        from nibabel.orientations import apply_orientation

        if tuple(array.shape) != self.kits_shape:
            raise ValueError(f"array {array.shape} is not of the KiTS19-layout shape {self.kits_shape}")
        out = np.ascontiguousarray(apply_orientation(array, self.to_file_ornt))
        assert out.shape == self.file_shape
        return out


def affine_problem(affine: np.ndarray) -> str | None:
    """Why ``affine`` (4x4) cannot orient a scan, or None."""
    affine = np.asarray(affine, dtype=np.float64)
    if affine.shape != (4, 4) or not np.all(np.isfinite(affine)):
        return "not finite"
    columns = affine[:3, :3]
    norms = np.linalg.norm(columns, axis=0)
    if np.any(norms <= 0) or abs(np.linalg.det(columns)) <= 1e-12 * float(np.prod(norms)):
        return "singular (an axis of zero length)"
    unit = columns / norms
    cosines = np.abs(unit.T @ unit - np.eye(3))
    if cosines.max() > SHEAR_TOLERANCE:
        degrees = np.degrees(np.arcsin(min(1.0, float(cosines.max()))))
        return f"sheared (axes {degrees:.2g} degrees off perpendicular: a gantry tilt?)"
    return None


def orientation_from_affine(affine: np.ndarray, shape: Sequence[int], path: str, what: str = "affine") -> Orientation:
    """The :class:`Orientation` of a scan of array ``shape`` whose ``affine`` maps it to RAS+;
    :class:`ScanError` naming ``path`` when the affine is unusable."""
    from nibabel.orientations import aff2axcodes, io_orientation, ornt_transform

    problem = affine_problem(affine)
    if problem:
        raise ScanError(f"{path}: the {what} is {problem}: the scan's orientation cannot be read")
    if len(shape) != 3:
        raise ScanError(f"{path}: expected a 3-D volume, got shape {tuple(shape)}")
    ornt = io_orientation(affine)
    kits = _kits_ornt()
    return Orientation(tuple(aff2axcodes(affine)), ornt_transform(ornt, kits).astype(int),
                       ornt_transform(kits, ornt).astype(int), tuple(int(s) for s in shape),
                       np.asarray(affine, dtype=np.float64))


def nifti_affine(header, path: str) -> tuple[np.ndarray, str]:
    """The affine that orients a NIfTI file, and which one it is: the sform if its code is
    non-zero and it is usable, else the qform likewise; :class:`ScanError` naming ``path``
    when neither is (a sheared sform is refused, not passed over: it is the scan's geometry)."""
    if int(header["sform_code"]) == 0 and int(header["qform_code"]) == 0:  # nibabel's own fallback
        return np.asarray(header.get_base_affine(), dtype=np.float64), FALLBACK_FORM
    reasons = []
    for form in ("sform", "qform"):
        code = int(header[f"{form}_code"])
        if code == 0:
            reasons.append(f"{form}_code 0")
            continue
        try:
            affine = header.get_sform() if form == "sform" else header.get_qform()
        except Exception as exc:  # noqa: BLE001 - nibabel's own errors for a broken quaternion or pixdim
            reasons.append(f"{form} unreadable ({type(exc).__name__})")
            continue
        problem = affine_problem(affine)
        if problem is None:
            return affine, form
        if problem.startswith("sheared"):
            raise ScanError(f"{path}: the {form} is {problem}: the scan's orientation cannot be read")
        reasons.append(f"{form} {problem}")
    raise ScanError(f"{path}: no usable orientation ({', '.join(reasons)}): the scan's orientation "
                    "cannot be read")


FALLBACK_FORM = "fallback affine from pixdim"  # sform and qform codes 0: nibabel's img.affine then


def fallback_note(path: str, affine: np.ndarray) -> str:
    """The line saying that a NIfTI file states no orientation and how it is read."""
    return (f"{path}: sform_code and qform_code are 0 (no orientation stated): read as nibabel reads it, with its "
            f"fallback affine from pixdim (axes {''.join(aff2codes(affine))}, voxel sizes "
            f"{[float(f'{v:.6g}') for v in voxel_sizes(affine)]} mm)")


def squeezed(nifti, path: str) -> tuple[object, str]:
    """A NIfTI image of shape (X, Y, Z, 1[, 1...]) as the 3-D image nibabel's ``squeeze_image``
    makes of it, and the line saying so; any other image as it is, and ""."""
    shape = tuple(int(s) for s in nifti.shape)
    if len(shape) <= 3 or any(s != 1 for s in shape[3:]):
        return nifti, ""
    from nibabel.funcs import squeeze_image

    return squeeze_image(nifti), (f"{path}: shape {shape} read as the 3-D volume {shape[:3]} (its trailing axes of "
                                  "length 1 dropped, as nibabel's squeeze_image does); the segmentation is 3-D")


def nifti_orientation(nifti, path: str) -> Orientation:
    """The :class:`Orientation` of a loaded nibabel image."""
    affine, form = nifti_affine(nifti.header, path)
    return orientation_from_affine(affine, nifti.shape, path, form)


# ----------------------------------------------------------------------------- one spacing, one grid


def voxel_sizes(affine: np.ndarray) -> list[float]:
    """mm per array axis of ``affine``: the norms of its first three columns (nibabel's
    ``voxel_sizes``)."""
    return [float(s) for s in np.linalg.norm(np.asarray(affine, dtype=np.float64)[:3, :3], axis=0)]


def spacing_disagrees(pixdim: Sequence[float], affine: np.ndarray) -> bool:
    """``pixdim[1:4]`` and the affine's voxel sizes further apart than :data:`SPACING_TOLERANCE`
    (relative) on some axis."""
    sizes = voxel_sizes(affine)
    return any(not np.isfinite(p) or abs(float(p) - s) > SPACING_TOLERANCE * s for p, s in zip(pixdim, sizes))


def nifti_spacing(pixdim: list[float], affine: np.ndarray, form: str, path: str) -> tuple[list[float], str]:
    """The one spacing of a NIfTI scan (file axis order) and a note, empty unless the header
    disagrees with itself: ``pixdim`` (the very list, the benchmark's reading bit for bit) when
    it agrees with the voxel sizes of ``affine`` (the ``form`` the orientation is read from)
    within :data:`SPACING_TOLERANCE`, else those voxel sizes, with one line saying so."""
    if not spacing_disagrees(pixdim, affine):
        return pixdim, ""
    sizes = voxel_sizes(affine)
    shown = [float(f"{s:.6g}") for s in sizes]
    return sizes, (f"{path}: pixdim[1:4] {[float(f'{p:.6g}') for p in pixdim]} mm disagrees with the {form}'s "
                   f"voxel sizes {shown} mm; the {form}'s are used (the orientation is read from it)")


def file_affine(nifti) -> np.ndarray:
    """The affine nibabel gives a NIfTI file (``nifti.affine``: the sform when its code is
    non-zero, else the qform likewise, else one from ``pixdim``): what a label's grid and a
    KiTS case's image are compared with."""
    return np.asarray(nifti.affine, dtype=np.float64)


def grid_distance(affine: np.ndarray, reference: np.ndarray, shape: Sequence[int]) -> float:
    """How far (in voxels of ``reference``) the voxel centres of a grid of ``shape`` placed by
    ``affine`` lie from the same indices placed by ``reference``: the largest over the grid's
    corners (the map between the two is affine, so its largest displacement is at one)."""
    to_reference = np.linalg.inv(np.asarray(reference, dtype=np.float64)) @ np.asarray(affine, dtype=np.float64)
    corners = np.array([[i, j, k, 1.0] for i in (0, shape[0] - 1) for j in (0, shape[1] - 1)
                        for k in (0, shape[2] - 1)]).T
    return float(np.abs(to_reference @ corners - corners)[:3].max())


def label_on_scan_grid(label: np.ndarray, label_affine: np.ndarray, scan_affine: np.ndarray,
                       scan_shape: Sequence[int], label_path: str, scan_path: str) -> np.ndarray:
    """``label`` (the array of ``label_path``, whose affine is ``label_affine``) on the voxel
    grid of its scan (``scan_shape``, ``scan_affine``): itself when the two grids are one (same
    shape, voxel centres within :data:`GRID_TOLERANCE` voxels); moved by the axis permutation
    and flips that the two affines imply (nibabel's ``io_orientation``/``ornt_transform``/
    ``apply_orientation``: every value kept, none interpolated) when the label is the same grid
    stored in another axis order; else :class:`ScanError`, one line naming both files."""
    from nibabel.orientations import apply_orientation, inv_ornt_aff, io_orientation, ornt_transform

    scan_shape = tuple(int(s) for s in scan_shape)
    if label.ndim != 3:
        raise ScanError(f"{label_path}: shape {tuple(label.shape)} is not 3-D: it cannot be a label of its scan "
                        f"{scan_path}")
    for path, affine in ((label_path, label_affine), (scan_path, scan_affine)):
        problem = affine_problem(affine)
        if problem and not problem.startswith("sheared"):
            raise ScanError(f"{path}: the affine is {problem}: the label {label_path} cannot be placed on its scan "
                            f"{scan_path}")
    if tuple(label.shape) == scan_shape and grid_distance(label_affine, scan_affine, scan_shape) <= GRID_TOLERANCE:
        return label
    transform = ornt_transform(io_orientation(label_affine), io_orientation(scan_affine))
    moved_affine = np.asarray(label_affine, dtype=np.float64) @ inv_ornt_aff(transform, label.shape)
    moved_shape = [0, 0, 0]
    for size, (axis, _) in zip(label.shape, transform):
        moved_shape[int(axis)] = int(size)
    if tuple(moved_shape) == scan_shape:
        distance = grid_distance(moved_affine, scan_affine, scan_shape)
        if distance <= GRID_TOLERANCE:
            return np.ascontiguousarray(apply_orientation(label, transform))
        where = f"its voxels lie up to {distance:.3g} voxels off the scan's"
    else:
        where = (f"shape {tuple(label.shape)}, {tuple(moved_shape)} in the scan's axis order, differs from the "
                 f"scan's {scan_shape}")
    raise ScanError(f"{label_path}: not on the voxel grid of its scan {scan_path} ({where}; "
                    f"label axes {''.join(aff2codes(label_affine))}, scan axes {''.join(aff2codes(scan_affine))})")


def states_orientation(nifti) -> bool:
    """Whether a NIfTI file states where its voxels are (a non-zero ``sform_code`` or
    ``qform_code``); without, nibabel's affine is only ``pixdim`` about the array's centre."""
    return int(nifti.header["sform_code"]) != 0 or int(nifti.header["qform_code"]) != 0


def label_file_on_scan_grid(label: np.ndarray, nifti, scan_affine: np.ndarray, scan_shape: Sequence[int],
                            label_path: str, scan_path: str, scan_states: bool = True) -> np.ndarray:
    """:func:`label_on_scan_grid` for the label file ``nifti`` (its array ``label``). Where the
    label or the scan (``scan_states`` False) states no orientation (:func:`states_orientation`)
    there is no pair of affines to compare: the label is taken as stored on its scan's grid when
    its shape and voxel sizes are the scan's, else refused (one line naming both files)."""
    if states_orientation(nifti) and scan_states:
        return label_on_scan_grid(label, file_affine(nifti), scan_affine, scan_shape, label_path, scan_path)
    sizes = voxel_sizes(file_affine(nifti))  # pixdim's, for a label that states no orientation
    if tuple(label.shape) == tuple(int(s) for s in scan_shape) and not spacing_disagrees(sizes, scan_affine):
        return label
    who = "it" if not states_orientation(nifti) else f"its scan {scan_path}"
    raise ScanError(f"{label_path}: {who} states no orientation (sform_code and qform_code 0) and its shape "
                    f"{tuple(label.shape)} and voxel sizes {[float(f'{v:.6g}') for v in sizes]} mm are not those of "
                    f"its scan {scan_path} ({tuple(int(s) for s in scan_shape)}, "
                    f"{[float(f'{v:.6g}') for v in voxel_sizes(scan_affine)]} mm): it cannot be placed on that grid")


def aff2codes(affine: np.ndarray) -> tuple[str, ...]:
    from nibabel.orientations import aff2axcodes

    return tuple(str(c) for c in aff2axcodes(affine))


# ----------------------------------------------------------------------------- formats


def _lower(path: str) -> str:
    return os.path.basename(path).lower()


def is_nifti_name(path: str) -> bool:
    return _lower(path).endswith(NIFTI_SUFFIXES)


def is_scan_name(path: str) -> bool:
    """A file name predict reads as one scan (NIfTI, NRRD, MetaImage)."""
    return _lower(path).endswith(SCAN_SUFFIXES)


def scan_name(path: str) -> str:
    """File name without its scan suffix (``.nii.gz``, ``.nrrd``, ...)."""
    name = os.path.basename(path)
    for suffix in SCAN_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[:-len(suffix)]
    return name


def looks_like_dicom(path: str) -> bool:
    """A DICOM file by its name or its preamble (``DICM`` at byte 128)."""
    if _lower(path).endswith(DICOM_SUFFIXES):
        return True
    try:
        with open(path, "rb") as handle:
            head = handle.read(132)
    except OSError:
        return False
    return len(head) == 132 and head[128:] == b"DICM"


def simpleitk(what: str):
    """The SimpleITK module; :class:`ScanError` naming ``what`` and the install command when
    it is not installed."""
    try:
        import SimpleITK
    except ImportError:
        raise ScanError(f"{what}: reading it needs SimpleITK, which is not installed ({SIMPLEITK_INSTALL})") from None
    return SimpleITK


def lps_affine(direction: Sequence[float], spacing: Sequence[float], origin: Sequence[float]) -> np.ndarray:
    """The RAS+ affine of the array ``(i, j, k)`` of an ITK image: its direction cosines
    (row-major 3x3) and origin are LPS+, hence x and y negated."""
    lps_to_ras = np.diag([-1.0, -1.0, 1.0])
    affine = np.eye(4)
    affine[:3, :3] = lps_to_ras @ np.asarray(direction, dtype=np.float64).reshape(3, 3) @ np.diag(
        np.asarray(spacing, dtype=np.float64))
    affine[:3, 3] = lps_to_ras @ np.asarray(origin, dtype=np.float64)
    return affine


def sitk_affine(image) -> np.ndarray:
    """The RAS+ affine of the array ``(i, j, k)`` of a SimpleITK image."""
    return lps_affine(image.GetDirection(), image.GetSpacing(), image.GetOrigin())


def nifti_reference(affine: np.ndarray, shape: Sequence[int], spacing: Sequence[float]):
    """A header-only NIfTI image (no voxels allocated) of ``shape`` with ``affine`` as qform and
    sform (code 1, scanner) and ``spacing`` as pixdim: what a segmentation of a non-NIfTI scan
    is written with."""
    import nibabel

    header = nibabel.Nifti1Header()
    header.set_data_shape(tuple(int(s) for s in shape))
    header.set_data_dtype(np.uint8)
    header.set_qform(affine, code=1)
    header.set_sform(affine, code=1)
    header.set_zooms(tuple(float(s) for s in spacing))
    header.set_xyzt_units("mm", "sec")
    return nibabel.Nifti1Image(np.broadcast_to(np.uint8(0), tuple(int(s) for s in shape)), affine, header)


# ----------------------------------------------------------------------------- DICOM series


@dataclass(frozen=True)
class DicomSeries:
    uid: str
    files: tuple[str, ...]  # sorted by position along the slice normal (GDCM)
    description: str = ""  # SeriesDescription (0008,103E)
    number: str = ""  # SeriesNumber (0020,0011)
    image_type: str = ""  # ImageType (0008,0008), e.g. ORIGINAL\PRIMARY\LOCALIZER

    @property
    def label(self) -> str:
        """The series in a file name: ``s<SeriesNumber>_<description>`` (characters other than
        letters and digits as ``_``), or its SeriesInstanceUID when it has neither."""
        description = re.sub(r"[^A-Za-z0-9]+", "_", self.description).strip("_")[:48]
        parts = ([f"s{re.sub(r'[^A-Za-z0-9]+', '_', self.number)}"] if self.number else []) + (
            [description] if description else [])
        return "_".join(parts) or self.uid

    @property
    def localizer(self) -> bool:
        """A localiser (scout, topogram): ImageType's LOCALIZER, or a description that says so."""
        return "LOCALIZER" in self.image_type.upper() or bool(LOCALIZER_WORDS.search(self.description))


LOCALIZER_WORDS = re.compile(r"locali[sz]er|scout|topogram|surview|scanogram|survey", re.IGNORECASE)


def dicom_series_in(folder: str) -> list[DicomSeries]:
    """The DICOM series of ``folder`` (not its subfolders), by SeriesInstanceUID."""
    sitk = simpleitk(folder)
    reader = sitk.ImageSeriesReader()
    series = []
    for uid in reader.GetGDCMSeriesIDs(folder):
        files = tuple(reader.GetGDCMSeriesFileNames(folder, uid))
        series.append(DicomSeries(uid, files, *(_series_tags(sitk, files[0]) if files else ())))
    return series


def _series_tags(sitk, path: str) -> tuple[str, str, str]:
    """SeriesDescription, SeriesNumber and ImageType of the DICOM file ``path`` ("" when absent)."""
    reader = sitk.ImageFileReader()
    reader.SetFileName(path)
    try:
        reader.ReadImageInformation()
    except RuntimeError:
        return "", "", ""
    return tuple(reader.GetMetaData(key).strip() if reader.HasMetaDataKey(key) else ""
                 for key in ("0008|103e", "0020|0011", "0008|0008"))


def describe_series(series: Sequence[DicomSeries]) -> str:
    return ", ".join(f"{s.uid} ({len(s.files)} files" + (f", '{s.description}'" if s.description else "") + ")"
                     for s in series)


def several_series_message(folder: str, series: Sequence[DicomSeries]) -> str:
    example = series[0].files[0] if series and series[0].files else os.path.join(folder, "FILE")
    return (f"--input {folder}: holds {len(series)} DICOM series: {describe_series(series)}; give one file "
            f"of the series to segment as --input (e.g. --input {example})")


def dicom_series_of(path: str) -> DicomSeries:
    """The series ``path`` names: the only series of a folder, or the series a file belongs to;
    :class:`ScanError` naming ``path`` otherwise (no series, several series in the folder)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    series = [s for s in dicom_series_in(folder) if s.files]
    if os.path.isdir(path):
        if not series:
            raise ScanError(f"{path}: no DICOM series in it")
        if len(series) > 1:
            raise ScanError(several_series_message(path, series))
        return series[0]
    wanted = os.path.realpath(path)
    for s in series:
        if any(os.path.realpath(f) == wanted for f in s.files):
            return s
    raise ScanError(f"{path}: not a readable DICOM image (no DICOM series in {folder} holds it)")


def _positions(reader, count: int) -> np.ndarray | None:
    try:
        return np.array([[float(v) for v in reader.GetMetaData(i, "0020|0032").split("\\")] for i in range(count)])
    except (RuntimeError, ValueError):
        return None


def check_slices(image, positions: np.ndarray | None, path: str) -> None:
    """:class:`ScanError` naming ``path`` when the slices (ImagePositionPatient, in the order
    read) are not evenly stacked along the slice normal of ``image``: a missing or doubled
    slice, or a gantry tilt (the slices sheared against the normal)."""
    if positions is None or len(positions) < 2:
        return
    normal = np.asarray(image.GetDirection(), dtype=np.float64).reshape(3, 3)[:, 2]
    steps = np.diff(positions, axis=0)
    along = steps @ normal
    mean = float(along.mean())
    if abs(mean) <= 1e-6:
        raise ScanError(f"{path}: the DICOM slices share one position: not a volume")
    if np.max(np.abs(along - mean)) > SLICE_SPACING_TOLERANCE * abs(mean):
        raise ScanError(f"{path}: the DICOM slices are not evenly spaced ({abs(along).min():.4g} to "
                        f"{abs(along).max():.4g} mm between neighbours: a missing slice?)")
    across = np.linalg.norm(steps - np.outer(along, normal), axis=1)
    if across.max() > SHEAR_TOLERANCE * abs(mean) + 1e-4:
        raise ScanError(f"{path}: the DICOM slices are not stacked along their normal (a gantry tilt: "
                        f"{np.degrees(np.arctan(across.max() / abs(mean))):.2g} degrees)")
    spacing_k = image.GetSpacing()[2]
    if abs(spacing_k - abs(mean)) > SLICE_SPACING_TOLERANCE * abs(mean):
        raise ScanError(f"{path}: the series' slice spacing {spacing_k:.4g} mm differs from its slice positions' "
                        f"{abs(mean):.4g} mm")


def read_dicom(path: str):
    """The SimpleITK image of the DICOM series ``path`` names (see :func:`dicom_series_of`)."""
    sitk = simpleitk(path)
    series = dicom_series_of(path)
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(list(series.files))
    reader.MetaDataDictionaryArrayUpdateOn()
    shown = sitk.ProcessObject.GetGlobalWarningDisplay()
    sitk.ProcessObject.SetGlobalWarningDisplay(False)  # ITK's own multi-line warnings: checked below instead
    try:
        image = reader.Execute()
    except RuntimeError as exc:
        raise ScanError(f"{path}: unreadable DICOM series {series.uid} ({_first_line(exc)})") from None
    finally:
        sitk.ProcessObject.SetGlobalWarningDisplay(shown)
    check_slices(image, _positions(reader, len(series.files)), path)
    return image


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if "ERROR" in line or "error" in line]
    return (useful or lines or [type(exc).__name__])[-1][:200]


def read_sitk_image(path: str):
    """A SimpleITK image from an NRRD/MetaImage file or a DICOM series."""
    if os.path.isdir(path) or not is_scan_name(path):
        return read_dicom(path)
    sitk = simpleitk(path)
    try:
        return sitk.ReadImage(path)
    except RuntimeError as exc:
        raise ScanError(f"{path}: unreadable or corrupt file ({_first_line(exc)})") from None


def _information(sitk, path: str, shown: str):
    reader = sitk.ImageFileReader()
    reader.SetFileName(path)
    try:
        reader.ReadImageInformation()
    except RuntimeError as exc:
        raise ScanError(f"{shown}: unreadable or corrupt file ({_first_line(exc)})") from None
    return reader


def sitk_header(path: str) -> tuple[tuple[int, ...], tuple[float, ...], np.ndarray]:
    """Shape ``(i, j, k)``, spacing (same order, mm) and affine of a scan SimpleITK reads,
    from headers only: the file's, or a DICOM series' first and last files' (the slice count
    is the series' file count, the slice step their distance along the normal over it)."""
    sitk = simpleitk(path)
    if os.path.isfile(path) and is_scan_name(path):
        reader = _information(sitk, path, path)
        size, spacing, direction, origin = reader.GetSize(), reader.GetSpacing(), reader.GetDirection(), reader.GetOrigin()
    else:
        files = dicom_series_of(path).files
        first = _information(sitk, files[0], path)
        size, spacing, direction, origin = first.GetSize(), first.GetSpacing(), first.GetDirection(), first.GetOrigin()
        if len(size) == 3:
            size, spacing = (size[0], size[1], len(files)), list(spacing)
            if len(files) > 1:
                normal = np.asarray(direction, dtype=np.float64).reshape(3, 3)[:, 2]
                last = np.asarray(_information(sitk, files[-1], path).GetOrigin(), dtype=np.float64)
                step = abs(float((last - np.asarray(origin)) @ normal)) / (len(files) - 1)
                spacing[2] = step if step > 0 else spacing[2]
        reader = first
    if len(size) != 3 or reader.GetNumberOfComponents() != 1:
        raise ScanError(f"{path}: expected a 3-D volume of one channel, got size {tuple(size)} with "
                        f"{reader.GetNumberOfComponents()} component(s)")
    spacing = tuple(float(s) for s in spacing)
    return tuple(int(s) for s in size), spacing, lps_affine(direction, spacing, origin)


def detached_data_file(path: str) -> str | None:
    """The data file a ``.mhd`` (``ElementDataFile``) or ``.nhdr`` (``data file``) header names,
    when it is one plain file beside it."""
    try:
        with open(path, encoding="latin-1") as handle:
            lines = handle.read(65536).splitlines()
    except OSError:
        return None
    for line in lines:
        key, sep, value = line.partition("=" if _lower(path).endswith(".mhd") else ":")
        if sep and key.strip().lower() in ("elementdatafile", "data file", "datafile"):
            name = value.strip()
            candidate = os.path.join(os.path.dirname(path), name)
            return candidate if name and os.path.isfile(candidate) else None
    return None


def input_files(path: str) -> list[str]:
    """The files whose bytes make the scan ``path`` names: the file itself (and a ``.mhd`` or
    ``.nhdr`` header's data file), or a DICOM series' files in position order (for a record of
    what an output was made from)."""
    if os.path.isfile(path) and is_nifti_name(path):
        return [path]
    if os.path.isfile(path) and is_scan_name(path):
        data = detached_data_file(path) if _lower(path).endswith((".mhd", ".nhdr")) else None
        return [path] + ([data] if data else [])
    return list(dicom_series_of(path).files)


# ----------------------------------------------------------------------------- one volume


@dataclass(frozen=True)
class Volume:
    """A scan as read, in the KiTS19 layout: ``image`` float32 (1, D, H, W) in the file's units
    (HU for CT), ``spacing`` its mm per axis (D, H, W; for NIfTI ``pixdim`` permuted with the
    axes, the very list ``pixdim[1:4].tolist()`` when nothing moves); ``orientation`` the way
    back to the file's axes; ``file_spacing`` the file's own (for NIfTI :func:`nifti_spacing`'s:
    ``pixdim[1:4]``, or the affine's voxel sizes where the two disagree); ``nifti`` the NIfTI
    image (header, affine, file's shape) the segmentation is written with; ``note`` the one line
    saying which spacing was used where the header disagrees with itself, else empty."""

    image: np.ndarray
    spacing: list[float]
    orientation: Orientation
    file_spacing: list[float]
    nifti: object
    note: str = ""


def _finite_float32(array: np.ndarray, path: str) -> np.ndarray:
    image = array.astype(np.float32, copy=False)
    finite = np.isfinite(image)
    if not finite.all():
        raise ScanError(f"{path}: {image.size - int(finite.sum())} NaN or infinite intensities")
    return image


def _squeezed_image(path: str) -> tuple[np.ndarray, list[float], object, str] | None:
    """:func:`load_image`'s values for a file of shape (X, Y, Z, 1) (:func:`squeezed`), and the
    line saying so; None for any other file (read by :func:`load_image` itself)."""
    try:
        nifti = read_nifti(path)
        if len(nifti.shape) <= 3:
            return None
        nifti, note = squeezed(nifti, path)
        if not note:
            return None
        image = read_voxels(nifti, path).astype(np.float32)
    except PreprocessError as exc:
        raise ScanError(str(exc)) from None
    return _finite_float32(image, path)[None], nifti.header["pixdim"][1:4].tolist(), nifti, note


def read_nifti_volume(path: str) -> Volume:
    squeezed_image = _squeezed_image(path)
    if squeezed_image is not None:
        image, spacing, nifti, shape_note = squeezed_image
    else:
        shape_note = ""
        try:
            image, spacing, nifti = load_image(path)  # exactly preprocessing's reading
        except PreprocessError as exc:
            raise ScanError(str(exc)) from None
    affine, form = nifti_affine(nifti.header, path)
    orientation = orientation_from_affine(affine, nifti.shape, path, form)
    spacing, note = nifti_spacing(spacing, affine, form, path)  # pixdim, the very list, unless it disagrees
    notes = [shape_note] + ([fallback_note(path, affine)] if form == FALLBACK_FORM else []) + [note]
    note = "\n".join(n for n in notes if n)
    if orientation.identity:
        return Volume(image, spacing, orientation, spacing, nifti, note)
    return Volume(orientation.to_kits(image[0])[None], orientation.spacing_to_kits(spacing), orientation,
                  spacing, nifti, note)


def read_sitk_volume(path: str) -> Volume:
    sitk = simpleitk(path)
    image = read_sitk_image(path)
    if image.GetDimension() != 3 or image.GetNumberOfComponentsPerPixel() != 1:
        raise ScanError(f"{path}: expected a 3-D volume of one channel, got size {image.GetSize()} with "
                        f"{image.GetNumberOfComponentsPerPixel()} component(s)")
    affine = sitk_affine(image)
    file_array = sitk.GetArrayViewFromImage(image).T  # (k, j, i) -> (i, j, k): a view of ITK's buffer
    shape, spacing = file_array.shape, [float(s) for s in image.GetSpacing()]
    orientation = orientation_from_affine(affine, shape, path, "direction")
    voxels = _finite_float32(orientation.to_kits(file_array, dtype=np.float32), path)  # the one copy
    del file_array, image
    return Volume(voxels[None], orientation.spacing_to_kits(spacing), orientation, spacing,
                  nifti_reference(affine, shape, spacing))


def read_volume(path: str) -> Volume:
    """Read one scan into the KiTS19 layout (see :class:`Volume`); :class:`ScanError` naming
    ``path`` on failure."""
    if not os.path.exists(path):
        raise ScanError(f"{path}: missing")
    if os.path.isfile(path) and is_nifti_name(path):
        return read_nifti_volume(path)
    return read_sitk_volume(path)


def header_geometry(path: str) -> tuple[tuple[int, ...], tuple[float, ...], Orientation]:
    """Shape and spacing in the file's axis order (for NIfTI :func:`nifti_spacing`'s: the
    spacing the scan is read with), and the orientation, from the header only (no voxel is
    read); :class:`ScanError` naming ``path`` for an unusable one."""
    if os.path.isfile(path) and is_nifti_name(path):
        import nibabel

        try:
            nifti = nibabel.load(path)  # the header only: the voxels stay on disk
        except Exception as exc:  # noqa: BLE001 - nibabel's many header errors: one line
            raise ScanError(f"{path}: unreadable or corrupt NIfTI ({type(exc).__name__})") from None
        shape = tuple(int(s) for s in nifti.shape)
        if len(shape) > 3 and all(s == 1 for s in shape[3:]):
            shape = shape[:3]  # (X, Y, Z, 1): read as 3-D (squeezed)
        affine, form = nifti_affine(nifti.header, path)
        orientation = orientation_from_affine(affine, shape, path, form)
        pixdim = [float(s) for s in nifti.header["pixdim"][1:4]]
        spacing = tuple(nifti_spacing(pixdim, orientation.affine, "affine", path)[0])
        return shape, spacing, orientation
    shape, spacing, affine = sitk_header(path)
    return shape, spacing, orientation_from_affine(affine, shape, path, "direction")


# ----------------------------------------------------------------------------- one case: a scan and its label


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


def read_label_on_scan(path: str, scan_affine: np.ndarray, scan_shape: Sequence[int], scan_path: str,
                       label_values: Sequence[int], scan_states: bool = True, name: str = "") -> np.ndarray:
    """The label file ``path`` as uint8 on the voxel grid of its scan (``scan_shape`` and
    ``scan_affine``: the file's own axes), its values checked against ``label_values`` (an error
    names ``name``, else ``path``) before any cast; :func:`label_file_on_scan_grid` for NIfTI
    (``scan_states``: the scan states an orientation), :func:`label_on_scan_grid` for a label
    SimpleITK reads (NRRD, MetaImage). :class:`ScanError`, one line, naming the file(s)."""
    try:
        if is_nifti_name(path):
            nifti = read_nifti(path)
            label = validated_label(read_voxels(nifti, path), name or path, label_values)
            return label_file_on_scan_grid(label, nifti, scan_affine, scan_shape, path, scan_path, scan_states)
        image = read_sitk_image(path)
        if image.GetDimension() != 3 or image.GetNumberOfComponentsPerPixel() != 1:
            raise ScanError(f"{path}: expected a 3-D label map of one channel, got size {image.GetSize()}")
        array = simpleitk(path).GetArrayFromImage(image).T  # (k, j, i) -> (i, j, k)
        label = validated_label(array, name or path, label_values)
        return label_on_scan_grid(label, sitk_affine(image), scan_affine, scan_shape, path, scan_path)
    except PreprocessError as exc:
        raise ScanError(str(exc)) from None


@dataclass(frozen=True)
class Case:
    """A scan (and its label) as training and inference read it: ``volume`` (:class:`Volume`,
    the image float32 (1, D, H, W) in the KiTS19 layout, axes I-P-L, and its spacing in that
    order); ``label`` uint8 (D, H, W) in the same layout, or None."""

    volume: Volume
    label: np.ndarray | None = None


def read_case(image_path: str, label_path: str | None = None, label_values: Sequence[int] = KITS19.label_values,
              name: str = "", one_spacing: bool = False) -> Case:
    """Read a scan into the KiTS19 layout (:func:`read_volume`) and its label file, when given,
    onto the scan's voxel grid (:func:`read_label_on_scan`) and then into the same layout: the one
    reader of a scan for predict and for the preprocessing of own data, so that both give the
    network the same array. Refused (:class:`ScanError`, one line naming the file): a spacing that
    is not positive, an image that looks like a label map (:func:`refuse_label_map`), and, with
    ``one_spacing``, a NIfTI image whose ``pixdim[1:4]`` disagrees with its affine (which spacing
    is the scan's? predict takes the affine's, with a note). ``name`` names the case in an error
    about label values."""
    volume = read_volume(image_path)
    if any(not np.isfinite(s) or s <= 0 for s in volume.spacing):
        raise ScanError(f"{image_path}: spacing (pixdim[1:4]) {volume.file_spacing} is not positive")
    refuse_label_map(volume.image, image_path)
    if one_spacing and is_nifti_name(image_path):
        pixdim = [float(p) for p in volume.nifti.header["pixdim"][1:4]]
        if spacing_disagrees(pixdim, volume.orientation.affine):
            sizes = [float(f"{s:.6g}") for s in voxel_sizes(volume.orientation.affine)]
            case = f"case {name}, " if name else ""
            raise ScanError(f"{image_path}: pixdim[1:4] {[float(f'{p:.6g}') for p in pixdim]} mm disagrees with the "
                            f"affine's voxel sizes {sizes} mm ({case}not KiTS19's: which spacing is the scan's?)")
    if label_path is None:
        return Case(volume)
    orientation = volume.orientation
    label = read_label_on_scan(label_path, orientation.affine, orientation.file_shape, image_path, label_values,
                               states_orientation(volume.nifti), name)
    return Case(volume, orientation.to_kits(label))


def input_digest(path: str) -> str:
    """sha256 of the input scan ``path``: of the file's bytes (what ``sha256sum`` prints) when
    one file makes it, else of the name and bytes of each file that does, in order (a DICOM
    series' files in position order, a ``.mhd``/``.nhdr`` header and its data file:
    :func:`input_files`)."""
    files = input_files(path)
    digest = hashlib.sha256()
    for name in files:
        if len(files) > 1:
            digest.update(os.path.basename(name).encode() + b"\0")
        with open(name, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
