"""Reading a NIfTI file as the benchmark's preprocessing reads it (``nibabel``'s ``get_fdata()``
values), for preprocessing and for the scans predict reads (``data_loading.scan_io``): one place,
so that both read the same numbers. Problems raise :class:`PreprocessError` (one line naming
the file)."""
from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from data_loading.description import KITS19


class PreprocessError(Exception):
    """A problem with the input or output data; ``str()`` is a single line for the user."""


def read_nifti(path: str):
    """Open a NIfTI file; returns the nibabel image (data read lazily)."""
    import nibabel
    from nibabel.filebasedimages import ImageFileError

    try:
        return nibabel.load(path)
    except (ImageFileError, OSError, EOFError, ValueError, zlib.error) as exc:
        raise PreprocessError(f"{path}: unreadable or corrupt NIfTI ({reason_text(exc)})") from None


def read_voxels(nifti, path: str) -> np.ndarray:
    """The voxel values that ``nifti.get_fdata()`` gives, in the narrowest exact dtype.

    ``get_fdata()`` always builds a float64 copy (1.3 GB for a 611 x 512 x 512 case), which
    costs time too (docs/performance.md, "Preprocessing"). When the file has no scaling (slope
    1, intercept 0) and its dtype converts to float64 exactly (floats, integers of up to 32
    bits), the stored array holds the very same numbers, so a later cast to float32 (rounding to
    nearest from the exact value) or, for validated labels, to uint8 gives the same bits either
    way. Other files go through ``get_fdata()``. A truncated or corrupt payload becomes one
    :class:`PreprocessError`.
    """
    from nibabel.filebasedimages import ImageFileError

    dtype = nifti.get_data_dtype()
    exact = dtype.kind == "f" or (dtype.kind in "iu" and dtype.itemsize <= 4)
    proxy = nifti.dataobj
    unscaled = getattr(proxy, "slope", None) == 1 and getattr(proxy, "inter", None) == 0
    try:
        return np.asanyarray(proxy) if exact and unscaled else nifti.get_fdata()
    except (ImageFileError, OSError, EOFError, ValueError, zlib.error) as exc:
        raise PreprocessError(f"{path}: unreadable or corrupt NIfTI ({reason_text(exc)})") from None


def reason_text(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_image(path: str) -> tuple[np.ndarray, list[float], object]:
    """Image float32 (1, D, H, W), spacing (3 floats, ``pixdim[1:4]``) and the nibabel image.

    Raises :class:`PreprocessError` for an unreadable file, a volume that is not 3-D and NaN or
    infinite intensities.
    """
    nifti = read_nifti(path)
    spacing = nifti.header["pixdim"][1:4].tolist()
    image = read_voxels(nifti, path).astype(np.float32)  # get_fdata() bit for bit
    if image.ndim != 3:
        raise PreprocessError(f"{path}: expected a 3-D volume, got shape {image.shape}")
    finite = np.isfinite(image)
    if not finite.all():
        raise PreprocessError(f"{path}: {image.size - int(finite.sum())} NaN or "
                              "infinite intensities")
    return np.expand_dims(image, 0), spacing, nifti


def validated_label(raw_label: np.ndarray, name: str, label_values: Sequence[int] = KITS19.label_values) -> np.ndarray:
    """``raw_label`` as uint8; :class:`PreprocessError` naming ``name`` for values outside
    ``label_values`` (KiTS19's {0, 1, 2} by default; checked before the cast would wrap them)."""
    bad = raw_label != label_values[0]
    for value in label_values[1:]:
        bad &= raw_label != value
    if bad.any():
        values = np.unique(raw_label[bad])
        shown = ", ".join(f"{v:g}" for v in values[:8]) + (", ..." if values.size > 8 else "")
        allowed = ", ".join(str(v) for v in label_values)
        raise PreprocessError(f"{name}: label values outside {{{allowed}}}: {shown}")
    return raw_label.astype(np.uint8)
