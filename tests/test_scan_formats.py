"""Predict's inputs beside NIfTI, through SimpleITK (optional): a folder holding a DICOM series,
NRRD (.nrrd/.nhdr) and MetaImage (.mha/.mhd); the segmentation is NIfTI in the input's geometry.

The DICOM series is written (by SimpleITK's GDCM writer) from a known KiTS19-layout volume: one
file per slice, file names in an order that is not the slices' position order, and the values
stored through RescaleSlope/Intercept (checked in the files' raw pixel bytes). Positions and
spacings are exact decimals, so the series reads to the very numbers of the KiTS19-layout NIfTI
of the same volume, and its prediction is that NIfTI's voxel for voxel. The geometry oracles
are SimpleITK's own: its NIfTI writer (LPS direction cosines to a RAS affine) and its
``DICOMOrient``; nibabel maps segmentations back to the KiTS19 layout.
"""
import csv
import locale
import os
import random
import sys

import nibabel
import numpy as np
import pytest

from data_loading.scan_checks import check_header
from data_loading.scan_io import input_files
from data_loading.scans import Scan, ScanError, find_scans, read_scan
from runtime.predict.scan import segment_scan
from segmenters import segmenter
from test_orientation import SPACING, kits_image, kits_labels, random_conv_infer, to_codes
from test_orientation import tiny_checkpoint  # noqa: F401 - the fixture
from main_runs import predict_runner

SLOPE, INTERCEPT = 2.0, -1024.0


def kits_volume():
    """The KiTS19-layout image's voxels, even HU values so that (HU - intercept) / slope is whole."""
    image = kits_image()
    data = (np.asarray(image.dataobj) // 2 * 2).astype(np.int16)
    return nibabel.Nifti1Image(data, image.affine, image.header)


def write_dicom_series(sitk, folder, image, uid, description="CT ABDOMEN", names=None, seed=0, number=None,
                       image_type=None):
    """``image`` (a KiTS19-layout nibabel image: slices running Inferior, rows Posterior, columns
    Left) as a DICOM series: one file per slice, ImagePositionPatient from the image's affine in
    LPS, rows along +y and columns along +x (ImageOrientationPatient 1\\0\\0\\0\\1\\0), values
    stored through RescaleSlope/Intercept; SeriesNumber ``number`` and ImageType ``image_type``
    when given. Files named in a shuffled order; returns the names by slice of ``image``."""
    os.makedirs(folder, exist_ok=True)
    data, affine = np.asarray(image.dataobj), image.affine
    depth, height, width = data.shape
    spacing_d, spacing_h, spacing_w = (float(z) for z in image.header.get_zooms())
    order = list(range(depth))
    random.Random(seed).shuffle(order)
    names = names or [f"IM{order[d]:04d}.dcm" for d in range(depth)]
    writer = sitk.ImageFileWriter()
    writer.KeepOriginalImageUIDOn()
    # GDCM's writer leaves the process in the C locale (ASCII as the preferred encoding) once it
    # writes a decimal string such as ImagePositionPatient: put the test process's locale back
    saved = locale.setlocale(locale.LC_ALL)
    try:
        extra = {key: value for key, value in (("0020|0011", number), ("0008|0008", image_type)) if value is not None}
        _write_slices(sitk, writer, folder, data, names, uid, description, depth, affine,
                      (spacing_d, spacing_h, spacing_w), extra)
    finally:
        locale.setlocale(locale.LC_ALL, saved)
    return names


def _write_slices(sitk, writer, folder, data, names, uid, description, depth, affine, spacing, extra=None):
    spacing_d, spacing_h, spacing_w = spacing
    for d in range(depth):
        ras = affine @ np.array([d, 0, 0, 1.0])
        position = (-ras[0], -ras[1], ras[2])  # LPS
        slice_image = sitk.GetImageFromArray(data[d])  # rows (h), columns (w)
        slice_image.SetSpacing((spacing_w, spacing_h))
        tags = {"0008|0060": "CT", "0020|000d": "1.2.826.0.1.3680043.9.7.1", "0020|000e": uid,
                "0008|0018": f"{uid}.{d + 1}", "0008|103e": description, "0020|0013": str(depth - d),
                "0020|0032": "\\".join(f"{p:g}" for p in position), "0020|0037": "1\\0\\0\\0\\1\\0",
                "0018|0050": f"{spacing_d:g}", "0028|1053": f"{SLOPE:g}", "0028|1052": f"{INTERCEPT:g}",
                **{key: str(value) for key, value in (extra or {}).items()}}
        for key, value in tags.items():
            slice_image.SetMetaData(key, value)
        writer.SetFileName(os.path.join(str(folder), names[d]))
        writer.Execute(slice_image)


def stored_pixels(path, shape):
    """The raw pixel values of an uncompressed DICOM file: its last bytes (PixelData last)."""
    count = int(np.prod(shape))
    return np.frombuffer(open(path, "rb").read()[-2 * count:], dtype="<i2").reshape(shape)


@pytest.fixture
def sitk():
    return pytest.importorskip("SimpleITK")


predict = predict_runner("--val_input_shape", "128", "128", "128")


# ----------------------------------------------------------------------------- DICOM


def test_dicom_series_segments_as_the_kits_nifti(tmp_path, sitk, tiny_checkpoint, capsys):
    image = kits_volume()
    nibabel.save(image, str(tmp_path / "kits.nii.gz"))
    series = tmp_path / "series"
    uid = "1.2.826.0.1.3680043.9.7.1.1"
    names = write_dicom_series(sitk, series, image, uid)
    data = np.asarray(image.dataobj)
    # the setting is what the test says: name order is not position order, values are rescaled
    by_position = sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(series), uid)
    assert [os.path.basename(f) for f in by_position] == names[::-1]  # slices run Superior in DICOM
    assert sorted(names) != names[::-1] and sorted(names) != names
    stored = stored_pixels(str(series / names[3]), data.shape[1:])
    assert np.array_equal(stored * SLOPE + INTERCEPT, data[3]) and not np.array_equal(stored, data[3])

    raw, kits = read_scan(str(series)), read_scan(str(tmp_path / "kits.nii.gz"))
    assert np.array_equal(raw.image, kits.image)
    assert raw.spacing == pytest.approx(kits.spacing, abs=1e-6)
    header = check_header(str(series), limit=2**40)  # the header alone: the file's (i, j, k) axes
    assert header.shape == data.shape[::-1] and header.spacing == pytest.approx(SPACING[::-1], abs=1e-6)

    code, _, stderr = predict(capsys, series, tmp_path / "out", tiny_checkpoint)  # the command line, a tiny U-Net
    assert code == 0, stderr
    assert nibabel.load(str(tmp_path / "out" / "series.nii.gz")).shape == data.shape[::-1]
    infer = random_conv_infer()  # the comparison: one network, no symmetry, on both inputs
    segment_scan(Scan("series", str(series)), segmenter(infer), str(tmp_path / "out"))
    segment_scan(Scan("kits", str(tmp_path / "kits.nii.gz")), segmenter(infer), str(tmp_path / "out"))
    written = nibabel.load(str(tmp_path / "out" / "series.nii.gz"))
    assert written.shape == data.shape[::-1]  # (columns, rows, slices) as ITK writes a series
    reference = str(tmp_path / "itk.nii.gz")  # SimpleITK's own NIfTI geometry of the series
    sitk.WriteImage(sitk.ReadImage(by_position), reference)
    assert np.allclose(written.affine, nibabel.load(reference).affine, atol=1e-5)
    assert np.allclose(to_codes(written, ("I", "P", "L")).affine, image.affine, atol=1e-5)  # the known volume's
    labels, expected = kits_labels(str(tmp_path / "out" / "series.nii.gz")), kits_labels(str(tmp_path / "out" / "kits.nii.gz"))
    assert len(np.unique(expected)) == 3
    assert np.array_equal(labels, expected), float(np.mean(labels == expected))


def test_writing_and_reading_a_series_leave_the_locale_as_it_was(tmp_path, sitk):
    """GDCM's writer leaves the C locale behind (the preferred encoding ASCII: every later
    ``read_text()`` of a UTF-8 file in the process fails); the tests' writer puts it back, and the
    project's reading of a series (headers, the volume) changes nothing."""
    before = locale.setlocale(locale.LC_ALL), locale.getpreferredencoding(False)
    series = tmp_path / "series"
    write_dicom_series(sitk, series, kits_volume(), "1.2.826.0.1.3680043.9.7.2.1")
    assert (locale.setlocale(locale.LC_ALL), locale.getpreferredencoding(False)) == before
    raw = read_scan(str(series))
    assert raw.image.size == np.asarray(kits_volume().dataobj).size
    assert (locale.setlocale(locale.LC_ALL), locale.getpreferredencoding(False)) == before
    text = tmp_path / "ünïcode.txt"
    text.write_bytes("Größe ✓".encode("utf-8"))
    assert text.read_text() == "Größe ✓"        # the test process's own text I/O, as the suite does it


def test_several_series_in_one_folder_each_its_own_scan_a_localiser_left_out(tmp_path, sitk, tiny_checkpoint,
                                                                              capsys):
    """A folder holding a diagnostic series and a 6-image localiser: the diagnostic one is
    segmented, named after its number and description, the localiser left out and named with its
    reason in the output and the summary (exit 0); one file of the localiser chooses it."""
    folder = tmp_path / "study"
    first, second = "1.2.826.0.1.3680043.9.7.1.1", "1.2.826.0.1.3680043.9.7.1.2"
    write_dicom_series(sitk, folder, kits_volume(), first, number=3)
    small = nibabel.Nifti1Image(np.asarray(kits_volume().dataobj)[:6], kits_volume().affine, kits_volume().header)
    chosen = write_dicom_series(sitk, folder, small, second, description="LOCALIZER",
                                names=[f"B{i}.dcm" for i in range(6)], number=1)
    code, stdout, stderr = predict(capsys, folder, tmp_path / "out", tiny_checkpoint)
    assert code == 0 and "Traceback" not in stderr and "1 segmented" in stdout, stderr
    table = {row["case"]: row for row in csv.DictReader(open(tmp_path / "out" / "summary.csv"))}
    assert table["study_s3_CT_ABDOMEN"]["status"] == "segmented"
    assert table["study_s1_LOCALIZER"]["status"] == "left out" and "localiser" in table["study_s1_LOCALIZER"]["error"]
    assert "study_s1_LOCALIZER (series 1 'LOCALIZER': a localiser" in stdout
    assert nibabel.load(str(tmp_path / "out" / "study_s3_CT_ABDOMEN.nii.gz")).shape == kits_volume().shape[::-1]
    code, _, stderr = predict(capsys, folder / chosen[2], tmp_path / "out", tiny_checkpoint)
    assert code == 0, stderr
    written = nibabel.load(str(tmp_path / "out" / "study_s1_LOCALIZER.nii.gz"))
    assert written.shape == (small.shape[2], small.shape[1], 6)
    # what the output was made from: the chosen series' files, by position (slices run Superior)
    assert input_files(str(folder / chosen[0])) == [str(folder / name) for name in chosen[::-1]]


def test_a_series_with_a_missing_slice_is_one_line(tmp_path, sitk, tiny_checkpoint, capsys):
    names = write_dicom_series(sitk, tmp_path / "series", kits_volume(), "1.2.826.0.1.3680043.9.7.1.1")
    os.remove(tmp_path / "series" / names[5])
    code, _, stderr = predict(capsys, tmp_path / "series", tmp_path / "out", tiny_checkpoint)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert str(tmp_path / "series") in lines[0] and "not evenly spaced" in lines[0]


# ----------------------------------------------------------------------------- NRRD, MetaImage


def test_nrrd_and_metaimage_round_trips(tmp_path, sitk):
    """The KiTS19-layout scan converted by SimpleITK (reoriented by its ``DICOMOrient``) to
    .nrrd, .nhdr, .mha and .mhd: each segmentation is NIfTI on the input's own grid (size,
    spacing, origin and direction as SimpleITK reads them from both files) with the labels of
    the KiTS19-layout NIfTI, reoriented by SimpleITK alike."""
    infer = random_conv_infer()
    os.makedirs(tmp_path / "out")
    nibabel.save(kits_volume(), str(tmp_path / "kits.nii.gz"))
    segment_scan(Scan("kits", str(tmp_path / "kits.nii.gz")), segmenter(infer), str(tmp_path / "out"))
    kits_out = sitk.ReadImage(str(tmp_path / "out" / "kits.nii.gz"))
    source = sitk.ReadImage(str(tmp_path / "kits.nii.gz"))
    for key in source.GetMetaDataKeys():  # NIfTI header fields MetaImage would warn about
        source.EraseMetaData(key)
    folder = tmp_path / "in"
    folder.mkdir()
    variants = {"a.nrrd": "LPS", "b.nhdr": "RAI", "c.mha": "SPL", "d.mhd": None}
    for name, codes in variants.items():
        sitk.WriteImage(sitk.DICOMOrient(source, codes) if codes else source, str(folder / name))
    assert [s.name for s in find_scans(str(folder))] == ["a", "b", "c", "d"]  # no .raw data files
    assert [os.path.basename(f) for f in input_files(str(folder / "b.nhdr")) + input_files(str(folder / "d.mhd"))] \
        == ["b.nhdr", "b.raw.gz" if os.path.exists(folder / "b.raw.gz") else "b.raw", "d.mhd", "d.raw"]
    for scan in find_scans(str(folder)):
        segment_scan(scan, segmenter(infer), str(tmp_path / "out"))
        given, written = sitk.ReadImage(scan.image_path), sitk.ReadImage(str(tmp_path / "out" / f"{scan.name}.nii.gz"))
        assert written.GetSize() == given.GetSize()
        for get in ("GetSpacing", "GetOrigin", "GetDirection"):
            assert np.allclose(getattr(written, get)(), getattr(given, get)(), atol=1e-5), (scan.name, get)
        orientation = sitk.DICOMOrientImageFilter.GetOrientationFromDirectionCosines(given.GetDirection())
        expected = sitk.GetArrayFromImage(sitk.DICOMOrient(kits_out, orientation))
        assert np.array_equal(sitk.GetArrayFromImage(written), expected), scan.name


# ----------------------------------------------------------------------------- without SimpleITK


@pytest.mark.parametrize("what", ["nrrd", "dicom_folder"])
def test_without_simpleitk_is_one_line_with_the_install_command(tmp_path, tiny_checkpoint, capsys,
                                                                  monkeypatch, what):
    monkeypatch.setitem(sys.modules, "SimpleITK", None)  # import SimpleITK raises ImportError
    if what == "nrrd":
        path = tmp_path / "scan.nrrd"
        path.write_text("NRRD0004\n")
    else:
        path = tmp_path / "series"
        path.mkdir()
        (path / "IM0001").write_bytes(b"\0" * 128 + b"DICM" + b"\0" * 64)
    code, _, stderr = predict(capsys, path, tmp_path / "out", tiny_checkpoint)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert str(path) in lines[0] and "pip install SimpleITK" in lines[0]


def test_check_header_refuses_a_too_large_nrrd(tmp_path, sitk):
    """The header check reads NRRD headers too (no voxels), and estimates in the KiTS19 layout."""
    sitk.WriteImage(sitk.DICOMOrient(sitk.ReadImage(str(_saved(tmp_path))), "LPS"), str(tmp_path / "scan.nrrd"))
    assert check_header(str(tmp_path / "scan.nrrd"), limit=2**40).shape == kits_volume().shape[::-1]
    with pytest.raises(ScanError, match="GiB") as info:
        check_header(str(tmp_path / "scan.nrrd"), limit=2**20)
    assert "scan.nrrd" in str(info.value)


def _saved(tmp_path):
    path = tmp_path / "kits.nii.gz"
    nibabel.save(kits_volume(), str(path))
    return path

