"""A scan's header checked before any of its voxels is read: a plausible spacing, and a size
after resampling that fits in this machine's memory; then its voxels: CT in Hounsfield units
(:func:`check_ct_intensities`).

nibabel "fixes" a zero pixdim to 1 mm when it loads a file (with a warning that names no file),
so the header is read here as stored (:func:`read_header`). A spacing of 1000 mm (a header in
micrometres read as millimetres, or garbage) would ask the allocator for petabytes after
resampling to 1.6 x 1.2 x 1.2 mm; such a scan is refused with one line naming it, and the other
scans of the folder still run.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from data_loading.memory_limits import read_memory
from data_loading.nifti_read import reason_text
from data_loading.preprocessing import MIN_SHAPE, TARGET_SPACING
from data_loading.scans import ScanError

# No CT (or MR) voxel is larger than this; anything beyond is a header in the wrong unit.
MAX_SPACING_MM = 50.0
# float32 copies of the resampled volume alive at the peak of predict: the image (resampled,
# normalised, padded), the window sums of 3 classes + weights, and 3 class probabilities;
# plus two float maps and the labels on the original grid (docs/reliability.md).
RESAMPLED_COPIES = 11
ORIGINAL_COPIES = 4


@dataclass(frozen=True)
class ScanHeader:
    """``shape`` (array axes) and ``spacing`` (``pixdim[1:4]``, mm) exactly as stored."""

    shape: tuple[int, ...]
    spacing: tuple[float, ...]


NIFTI_HEADER_SIZES = {348: "Nifti1Header", 540: "Nifti2Header"}  # sizeof_hdr, the first int32


def read_header(path: str) -> ScanHeader:
    """The header of the NIfTI-1 or -2 file ``path`` as stored (no fixes applied, no extension
    read); :class:`ScanError` naming the file when it is unreadable, no NIfTI or not 3-D."""
    import struct
    import zlib

    import nibabel
    from nibabel.openers import ImageOpener
    from nibabel.spatialimages import HeaderDataError

    try:
        with ImageOpener(path) as handle:
            head = handle.read(max(NIFTI_HEADER_SIZES))
        for endian in "<>":
            size = struct.unpack(f"{endian}i", head[:4])[0] if len(head) >= 4 else 0
            if size in NIFTI_HEADER_SIZES and len(head) >= size:
                klass = getattr(nibabel, NIFTI_HEADER_SIZES[size])
                header = klass(head[:size], endianness=endian, check=False)
                break
        else:
            raise ScanError(f"{path}: unreadable or corrupt NIfTI (no NIfTI header)")
        shape = tuple(int(s) for s in header.get_data_shape())
        spacing = tuple(float(s) for s in header["pixdim"][1:4])
    except (OSError, ValueError, EOFError, zlib.error, struct.error, HeaderDataError) as exc:
        if isinstance(exc, ScanError):
            raise
        raise ScanError(f"{path}: unreadable or corrupt NIfTI ({reason_text(exc)})") from None
    if len(shape) > 3 and all(s == 1 for s in shape[3:]):
        shape = shape[:3]  # (X, Y, Z, 1): read as 3-D, as nibabel's squeeze_image (data_loading.scan_io.squeezed)
    if len(shape) != 3:
        raise ScanError(f"{path}: expected a 3-D volume, got shape {shape}")
    return ScanHeader(shape, spacing)


def spacing_problem(spacing: Sequence[float]) -> str | None:
    """Why ``spacing`` (mm) cannot be a scan's, or None."""
    if any(not math.isfinite(s) or s <= 0 for s in spacing):
        return f"spacing (pixdim[1:4]) {list(spacing)} mm is not positive"
    if max(spacing) > MAX_SPACING_MM:
        return (f"spacing (pixdim[1:4]) {list(spacing)} mm is not plausible (a voxel larger than "
                f"{MAX_SPACING_MM:g} mm: a header in another unit?)")
    return None


def predict_bytes(shape: Sequence[int], spacing: Sequence[float]) -> int:
    """An estimate of predict's peak memory for one scan (see ``RESAMPLED_COPIES``)."""
    resampled = [max(int(s * p / t), m) for s, p, t, m in zip(shape, spacing, TARGET_SPACING, MIN_SHAPE)]
    return 4 * (RESAMPLED_COPIES * math.prod(resampled) + ORIGINAL_COPIES * math.prod(shape))


def memory_limit_bytes() -> int | None:
    """The most memory this process may hold: physical memory, or a smaller limit of its job's
    own cgroup (v1 or v2, found through ``/proc/self/cgroup``) or SLURM's ``--mem``
    (:mod:`data_loading.memory_limits`); None where nothing can be read."""
    return read_memory().limit


def check_header(path: str, limit: int | None = None) -> ScanHeader:
    """Read and check the header of ``path`` before any voxel is read: :class:`ScanError`
    (one line naming the file) for a bad spacing, an orientation that cannot be read (no usable
    sform or qform, a shear; :mod:`data_loading.scan_io`) or a scan too large for ``limit``
    bytes (default :func:`memory_limit_bytes`). NRRD, MetaImage and DICOM headers are read by
    :mod:`data_loading.scan_io` (SimpleITK). The returned shape and spacing are the file's own
    (array-axis order); the memory is estimated in the KiTS19 layout the scan is predicted in."""
    from data_loading import scan_io

    affine = None
    if os.path.isfile(path) and scan_io.is_nifti_name(path):
        header = read_header(path)
    else:
        shape, spacing, affine = scan_io.sitk_header(path)
        header = ScanHeader(shape, spacing)
    problem = spacing_problem(header.spacing)
    if problem:
        raise ScanError(f"{path}: {problem}")
    if affine is None:  # NIfTI: the spacing the scan is read with (the affine's where pixdim disagrees)
        _, file_spacing, orientation = scan_io.header_geometry(path)
        problem = spacing_problem(file_spacing)
        if problem:
            raise ScanError(f"{path}: {problem.replace('(pixdim[1:4])', '(the affine voxel sizes)')}")
    else:
        orientation = scan_io.orientation_from_affine(affine, header.shape, path, "direction")
        file_spacing = header.spacing
    shape, spacing = orientation.kits_shape, orientation.spacing_to_kits(list(file_spacing))
    need, limit = predict_bytes(shape, spacing), limit or memory_limit_bytes()
    if limit is not None and need > limit:
        raise ScanError(f"{path}: shape {header.shape} at spacing {list(file_spacing)} mm needs about "
                        f"{need / 2**30:.3g} GiB to segment at {TARGET_SPACING} mm, more than the "
                        f"{limit / 2**30:.3g} GiB of memory here")
    return header


# ----------------------------------------------------------------------------- the voxels: CT in HU?

AIR_HU = -500.0  # below: air (about -1000 HU) or outside the field of view (-1024 or lower)
TISSUE_HU = (-150.0, 250.0)  # fat (about -100), soft tissue, organs, contrast-enhanced kidney
DENSE_HU = 500.0  # above: cortical bone, metal; a few percent of an abdominal CT
# Measured on data_loading.synthetic's KiTS-like scans (small, medium and realistic presets, 12
# scans): air 39-52 % of the voxels, tissue 47-60 %, dense 0.9-1.0 %. The same scans broken: as
# HU + 1024 (a lost rescale intercept) no air and 48-61 % dense; as HU - 1024 or a constant -1000
# volume 0 % tissue. Air is not required: a scan cropped to the body has none (docs/predict.md).
MIN_TISSUE_FRACTION = 0.01
MAX_DENSE_FRACTION = 0.2  # with no air (below MIN_AIR_FRACTION)
MIN_AIR_FRACTION = 0.001


def intensity_fractions(image: np.ndarray) -> tuple[float, float, float]:
    """The fractions of ``image``'s voxels (any shape, HU) that are air (below :data:`AIR_HU`),
    tissue (within :data:`TISSUE_HU`) and dense (above :data:`DENSE_HU`), counted on every
    second voxel of the last two axes."""
    sample = image[..., ::2, ::2]
    air = np.count_nonzero(sample < AIR_HU)
    tissue = np.count_nonzero((sample >= TISSUE_HU[0]) & (sample <= TISSUE_HU[1]))
    dense = np.count_nonzero(sample > DENSE_HU)
    return air / sample.size, tissue / sample.size, dense / sample.size


def intensity_problem(image: np.ndarray) -> str | None:
    """Why ``image`` (HU) does not look like CT in Hounsfield units, or None: almost no soft
    tissue (a constant or empty volume, HU - 1024), or a fifth of it denser than bone with no
    air at all (HU + 1024: the scan stored without its rescale intercept)."""
    air, tissue, dense = intensity_fractions(image)
    lo, hi = TISSUE_HU
    values = f"values {float(image.min()):g} to {float(image.max()):g}"
    if tissue < MIN_TISSUE_FRACTION:
        return (f"{tissue:.1%} of the voxels within {lo:g}..{hi:g} HU (soft tissue, at least "
                f"{MIN_TISSUE_FRACTION:.0%} in a CT; {values})")
    if dense >= MAX_DENSE_FRACTION and air < MIN_AIR_FRACTION:
        return (f"{dense:.0%} of the voxels above {DENSE_HU:g} HU (denser than most bone; at most "
                f"{MAX_DENSE_FRACTION:.0%} in a CT) and {air:.1%} below {AIR_HU:g} HU (air; {values}): the scan "
                "looks stored without its rescale intercept (HU + 1024)")
    return None


def check_ct_intensities(image: np.ndarray, path: str) -> None:
    """:class:`ScanError` (one line naming ``path``) when ``image`` (HU) does not look like CT in
    Hounsfield units (:func:`intensity_problem`). The preprocessing clips to the benchmark's HU
    window, so such a scan would give a segmentation (and volumes in mL) of nothing real."""
    problem = intensity_problem(image)
    if problem:
        raise ScanError(f"{path}: the intensities do not look like CT in Hounsfield units: {problem}; "
                        "give the scan in HU")
