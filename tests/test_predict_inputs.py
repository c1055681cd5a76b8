"""What predict takes as a scan: a label map given as a scan is refused in one line; a folder
of patients' DICOM series is a batch, each series a scan, each equal to the same volume given as
NIfTI (SimpleITK's GDCM writer, as tests/test_scan_formats.py writes series)."""
import os

import nibabel
import numpy as np
import pytest

from data_loading.scans import ScanError, label_map_values
from test_predict import blob_label, write_case, write_nifti
from test_predict_provenance import SPACING, cheap_network, predict, rows, trained_on  # noqa: F401


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return trained_on(tmp_path_factory.mktemp("ckpt") / "a.pt", (128,) * 3, filters=(2, 4, 4, 8, 8),
                      normalization="batchnorm")


# ----------------------------------------------------------------------------- a label map as a scan


def test_label_map_values_on_known_volumes():
    label = blob_label((12, 14, 13))
    assert label_map_values(label.astype(np.float32)) == [0, 1, 2]
    assert label_map_values(np.where(label > 0, 7, 0).astype(np.float32)) == [0, 7]
    ct = np.random.default_rng(0).integers(-1024, 300, (12, 14, 13)).astype(np.float32)
    assert label_map_values(ct) is None  # air is negative
    assert label_map_values(ct + 1024) is None  # unsigned CT, no intercept: values far above 9
    assert label_map_values(label * 0.5) is None  # not whole numbers
    assert label_map_values(np.full((4, 4, 4), 2, np.float32)) is None  # constant: nothing to tell


def test_a_label_map_given_as_a_scan_is_refused_in_one_line(tmp_path, capsys, checkpoint, cheap_network):
    """A KiTS19 case's segmentation.nii.gz (uint8) and the same labels stored as float32, among
    scans: each is one line naming it; the CT beside them is segmented; a single label map given
    as --input alike; the Python entry point refuses the array."""
    case = write_case(str(tmp_path / "raw"), "case_00001", (20, 24, 22), SPACING)
    folder = tmp_path / "in"
    os.makedirs(folder)
    os.link(os.path.join(case, "imaging.nii.gz"), folder / "ct.nii.gz")
    os.link(os.path.join(case, "segmentation.nii.gz"), folder / "labels.nii.gz")
    write_nifti(str(folder / "labels_float.nii.gz"), blob_label((20, 24, 22)).astype(np.float32), SPACING)
    code, stdout, stderr = predict(capsys, folder, tmp_path / "out", checkpoint)
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 2 and "Traceback" not in stderr, stderr
    for name in ("labels.nii.gz", "labels_float.nii.gz"):
        assert any(str(folder / name) + ":" in line and "label map" in line for line in lines), name
    assert {c: r["status"] for c, r in rows(tmp_path / "out").items()} == {
        "ct": "segmented", "labels": "failed", "labels_float": "failed"}
    code, _, stderr = predict(capsys, os.path.join(case, "segmentation.nii.gz"), tmp_path / "one", checkpoint)
    assert code == 1 and stderr.count("\n") == 1 and "label map" in stderr, stderr

    from runtime.predict.api import raw_from_array

    with pytest.raises(ScanError, match="array: .*label map"):
        raw_from_array(blob_label((20, 24, 22)), np.diag([*SPACING, 1.0]))


# ----------------------------------------------------------------------------- a folder of DICOM series


SERIES = {"patient1/study1/series1": 0, "patient1/study1/series2": 5, "patient2/CT": 11}  # folder: roll of the volume


def test_a_folder_of_patients_dicom_series_is_segmented_series_by_series(tmp_path, capsys, checkpoint, cheap_network):
    """Patients' folders, with study and series folders under them (and a non-DICOM file at the
    top): each series is a scan named by its path, its segmentation (mapped to the KiTS19 layout
    by nibabel) equal to that of the same volume given as NIfTI; the volumes differ, so a series
    matched with another's volume would show."""
    sitk = pytest.importorskip("SimpleITK")
    from test_orientation import kits_labels
    from test_scan_formats import kits_volume, write_dicom_series

    base = kits_volume()
    root, nifti = tmp_path / "patients", tmp_path / "nifti"
    os.makedirs(nifti)
    for i, (folder, shift) in enumerate(SERIES.items()):
        image = nibabel.Nifti1Image(np.roll(np.asarray(base.dataobj), shift, axis=2), base.affine, base.header)
        write_dicom_series(sitk, root / folder, image, f"1.2.826.0.1.3680043.9.7.2.{i + 1}", seed=i)
        nibabel.save(image, str(nifti / (folder.replace("/", "_") + ".nii.gz")))
    (root / "README.txt").write_text("exported from the PACS")
    code, stdout, stderr = predict(capsys, root, tmp_path / "out", checkpoint)
    assert code == 0 and "3 segmented" in stdout, stderr
    names = sorted(folder.replace("/", "_") for folder in SERIES)
    assert sorted(rows(tmp_path / "out")) == sorted(["README.txt", *names])  # every entry of --input named
    assert rows(tmp_path / "out")["README.txt"]["status"] == "left out"
    assert predict(capsys, nifti, tmp_path / "ref", checkpoint)[0] == 0
    labels = {name: kits_labels(str(tmp_path / "out" / f"{name}.nii.gz")) for name in names}
    for name in names:
        assert np.array_equal(labels[name], kits_labels(str(tmp_path / "ref" / f"{name}.nii.gz"))), name
    assert not np.array_equal(labels[names[0]], labels[names[1]])
    # a second series in a patient's folder: each series its own scan, named after its number and
    # description; the batch goes on
    write_dicom_series(sitk, root / "patient2" / "CT", base, "1.2.826.0.1.3680043.9.7.2.9", names=[
        f"X{i}.dcm" for i in range(base.shape[0])], number=7, description="CT VENOUS")
    code, stdout, stderr = predict(capsys, root, tmp_path / "again", checkpoint)
    assert code == 0 and "4 segmented" in stdout, stderr
    assert {"patient2_CT_CT_ABDOMEN", "patient2_CT_s7_CT_VENOUS"} <= set(rows(tmp_path / "again"))
    assert np.array_equal(kits_labels(str(tmp_path / "again" / "patient2_CT_s7_CT_VENOUS.nii.gz")),
                          kits_labels(str(tmp_path / "ref" / "patient1_study1_series1.nii.gz")))  # base, unrolled
