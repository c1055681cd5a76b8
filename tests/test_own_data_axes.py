"""One reading of a scan (issue 56, item 1): own data is preprocessed through predict's reader,
in KiTS19's axes I-P-L whatever the file's, and says where its target spacing came from.

The data is written in nnU-Net v2's raw layout (tests/nnunet_raw.py: RAS, slices last, a spacing
per case, twins stored in other orientations, an empty label map). Oracles, none of them the
code under test: predict's own path (``read_scan`` + ``preprocess_scan``) for "the array training
sees is the array predict feeds"; nibabel's ``as_reoriented`` (the files) and the arrays drawn
before they were stored (``nnunet_raw.kits_arrays``), resampled by test_preprocess's numpy
re-derivation of torch's arithmetic (``expected_arrays``), for "any orientation gives one array";
nibabel's header zooms permuted by its ``aff2axcodes`` for the fingerprint's spacings.
"""
from __future__ import annotations

import json
import os
import statistics
from types import SimpleNamespace

import nibabel
import numpy as np
import pytest

import preprocess_dataset
from data_loading import description as ds
from data_loading.scans import preprocess_scan, read_scan
from nnunet_raw import RawCase, kits_arrays, stored, write_raw_dataset
from test_preprocess import expected_arrays

CANONICAL_INDEX = {"I": 0, "S": 0, "P": 1, "A": 1, "L": 2, "R": 2}  # axis code -> KiTS19's axis (I-P-L)


def preprocess(*args):
    return preprocess_dataset.main([*map(str, args), "--num_workers", "1"])


def image_path(raw, name):
    return os.path.join(str(raw), "imagesTr", f"{name}_0000.nii.gz")


def canonical_by_nibabel(path):
    """(spacing, shape) of the file ``path`` in KiTS19's axis order, from nibabel alone: the
    header's zooms and shape permuted by the axis codes of its affine."""
    nifti = nibabel.load(path)
    spacing, shape = [0.0] * 3, [0] * 3
    for code, zoom, size in zip(nibabel.aff2axcodes(nifti.affine), nifti.header.get_zooms(), nifti.shape):
        spacing[CANONICAL_INDEX[code]], shape[CANONICAL_INDEX[code]] = float(zoom), int(size)
    return spacing, shape


def test_the_array_a_network_trains_on_is_the_array_predict_gives_it(tmp_path):
    """RAS, slices last (nnU-Net's own storage), two spacings: each x.npy equals predict's input
    for the same file at the folder's target spacing, exactly."""
    cases = [RawCase("case_001", spacing=(2.5, 1.5, 1.4)),
             RawCase("case_002", shape=(12, 22, 18), spacing=(3.0, 0.8, 1.1))]
    raw = write_raw_dataset(tmp_path / "raw", cases)
    assert nibabel.aff2axcodes(nibabel.load(image_path(raw, "case_001")).affine) == ("R", "A", "S")
    out = tmp_path / "out"
    assert preprocess("--data_dir", raw, "--results_dir", out) == 0
    target = json.loads((out / ds.DESCRIPTION_FILE).read_text())["target_spacing"]
    for number, case in enumerate(cases, 1):
        path = image_path(raw, case.name)
        fed, _ = preprocess_scan(read_scan(path), "", target)
        trained = np.load(out / f"case_{number:05d}_x.npy")
        assert trained.shape == fed.shape and np.array_equal(trained, fed), case.name


def test_one_scan_in_any_orientation_preprocesses_to_one_array(tmp_path):
    """Twins (one seed): RAS slices last, LPS, P-S-L, and RAS with its label stored LPS. Every
    x.npy and y.npy is the same, and the arrays drawn before storing (KiTS19's layout) resampled
    by test_preprocess's numpy oracle of the benchmark's steps."""
    twins = [RawCase("case_001", codes=("R", "A", "S"), seed=5), RawCase("case_002", codes=("L", "P", "S"), seed=5),
             RawCase("case_003", codes=("P", "S", "L"), seed=5), RawCase("case_004", codes=("R", "A", "S"), seed=5)]
    raw = write_raw_dataset(tmp_path / "raw", twins)
    _, label = kits_arrays(twins[3], 3)
    nibabel.save(stored(label, twins[3].spacing, ("L", "P", "S"), np.uint8),
                 os.path.join(raw, "labelsTr", "case_004.nii.gz"))
    on_disk = [np.asarray(nibabel.load(image_path(raw, c.name)).dataobj) for c in twins[:3]]
    assert all(a.shape != b.shape or not np.array_equal(a, b)   # three arrays on disk, one scan
               for i, a in enumerate(on_disk) for b in on_disk[i + 1:])
    out = tmp_path / "out"
    assert preprocess("--data_dir", raw, "--results_dir", out) == 0
    image, label = kits_arrays(twins[0], 0)
    drawn = SimpleNamespace(image=image, label=label, spacing=twins[0].spacing)
    (x_fused, x_plain), y_expected = expected_arrays(drawn)
    assert label.any()
    for number in range(1, 5):
        x, y = np.load(out / f"case_{number:05d}_x.npy"), np.load(out / f"case_{number:05d}_y.npy")
        assert np.array_equal(y, y_expected), number
        assert np.array_equal(x, x_fused) or np.array_equal(x, x_plain), number


def test_the_fingerprint_and_the_median_spacing_are_in_canonical_order(tmp_path, capsys):
    """RAS slices last, a spacing per case and an empty label map: the fingerprint's spacings,
    shapes and medians are nibabel's zooms and shapes permuted by its axis codes (slices first);
    ``--target_spacing median`` resamples each case by it in that order."""
    cases = [RawCase("case_001", spacing=(2.5, 1.5, 1.4)),
             RawCase("case_002", shape=(12, 22, 18), spacing=(3.0, 0.8, 1.1)),
             RawCase("case_003", shape=(10, 16, 20), spacing=(2.0, 1.25, 0.9), empty=True)]
    raw = write_raw_dataset(tmp_path / "raw", cases)
    out = tmp_path / "out"
    assert preprocess("--data_dir", raw, "--results_dir", out, "--target_spacing", "median") == 0
    printed = capsys.readouterr().out
    oracle = [canonical_by_nibabel(image_path(raw, c.name)) for c in cases]
    assert [s for s, _ in oracle][0] != nibabel.load(image_path(raw, "case_001")).header.get_zooms()  # not as stored
    median = [statistics.median(axis) for axis in zip(*(s for s, _ in oracle))]
    fingerprint = json.loads((out / ds.FINGERPRINT_FILE).read_text())
    assert fingerprint["spacings"] == [s for s, _ in oracle] and fingerprint["shapes"] == [s for _, s in oracle]
    assert fingerprint["median_spacing"] == median and fingerprint["target_spacing"] == median
    assert fingerprint["target_spacing_from"] == "median" and "(the median of the cases)" in printed
    record = json.loads((out / ds.DESCRIPTION_FILE).read_text())
    assert record["axes"] == ds.CANONICAL_AXES == "I-P-L" and record["target_spacing"] == median
    for number, (spacing, shape) in enumerate(oracle, 1):
        geometry = json.loads((out / f"case_{number:05d}_geometry.json").read_text())
        assert geometry["original_shape"] == shape and geometry["original_spacing"] == spacing
        assert geometry["resampled_shape"] == [int(s / t * n) for s, t, n in zip(spacing, median, shape)]
    assert fingerprint["per_case"][2]["label_voxels"][1:] == [0, 0]
    assert not np.load(out / "case_00003_y.npy").any()


SOURCES = {   # how the spacing is given -> (extra description keys, flags, record token, words printed)
    "description": ({"target_spacing": [2.0, 1.5, 1.5]}, [], "description", "the description"),
    "none_named": ({}, [], "kits19", "KiTS19's default (the description names none)"),
    "flag": ({"target_spacing": [2.0, 1.5, 1.5]}, ["--target_spacing", "2.5,1.5,1.4"], "--target_spacing",
             "--target_spacing"),
    "median": ({}, ["--target_spacing", "median"], "median", "the median of the cases"),
}


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_the_lines_say_where_the_target_spacing_came_from(tmp_path, capsys, source):
    keys, flags, token, words = SOURCES[source]
    raw = write_raw_dataset(tmp_path / "raw", [RawCase("case_001", shape=(8, 10, 12))], description=keys)
    out = tmp_path / "out"
    assert preprocess("--data_dir", raw, "--results_dir", out, *flags) == 0
    lines = capsys.readouterr().out.splitlines()
    said = [line for line in lines if "target spacing" in line]
    assert len(said) == 2 and all(f"{words})" in line for line in said), said   # the header line, the fingerprint's
    assert all(ds.CANONICAL_AXES in line for line in said) and not any("(description)" in line for line in lines)
    for name in (ds.DESCRIPTION_FILE, ds.FINGERPRINT_FILE):
        assert json.loads((out / name).read_text())["target_spacing_from"] == token


def test_kits19_without_a_description_says_the_benchmarks_spacing(tmp_path, capsys):
    from data_loading import synthetic

    synthetic.generate(str(tmp_path / "raw"), cases=1, seed=0, size="small")
    assert preprocess("--data_dir", tmp_path / "raw", "--results_dir", tmp_path / "out") == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "target spacing" in line]
    assert len(said) == 1 and "(KiTS19's, the benchmark's (no description))" in said[0], said
    assert not (tmp_path / "out" / ds.DESCRIPTION_FILE).exists()


def test_a_folder_preprocessed_in_stored_order_is_not_added_to(tmp_path, capsys):
    """A saved description without "axes" (an earlier version kept each file's axis order): one
    line, exit 1, nothing in the folder touched."""
    raw = write_raw_dataset(tmp_path / "raw", [RawCase("case_001", shape=(8, 10, 12))])
    out = tmp_path / "out"
    assert preprocess("--data_dir", raw, "--results_dir", out) == 0
    record = json.loads((out / ds.DESCRIPTION_FILE).read_text())
    del record["axes"]
    (out / ds.DESCRIPTION_FILE).write_text(json.dumps(record))
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    capsys.readouterr()
    assert preprocess("--data_dir", raw, "--results_dir", out, "--force") == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "earlier version" in err[0] and "use another --results_dir" in err[0], err
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before


def test_own_data_whose_pixdim_disagrees_with_its_affine_is_refused_in_one_line(tmp_path, capsys):
    raw = write_raw_dataset(tmp_path / "raw", [RawCase("case_001", shape=(8, 10, 12)),
                                               RawCase("case_002", shape=(8, 10, 12))])
    path = image_path(raw, "case_002")
    nifti = nibabel.load(path)
    stale = nibabel.Nifti1Image(np.asarray(nifti.dataobj), nifti.affine, nifti.header)
    stale.header.set_zooms((3.0, 3.0, 3.0))                       # over the affine's: a stale pixdim
    nibabel.save(stale, path)
    assert not np.allclose(nibabel.affines.voxel_sizes(nibabel.load(path).affine), 3.0)
    code = preprocess("--data_dir", raw, "--results_dir", tmp_path / "out")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and len(err) == 1 and path in err[0] and "pixdim" in err[0] and "affine" in err[0], err


def test_a_set_stored_as_nrrd_preprocesses_as_its_nifti_twin(tmp_path):
    """nnU-Net's SimpleITK formats: the same set rewritten by SimpleITK as NRRD (``file_ending``
    ``.nrrd``), image and label read as predict reads such a scan: the same arrays."""
    sitk = pytest.importorskip("SimpleITK")
    cases = [RawCase("case_001", codes=("L", "P", "S")),
             RawCase("case_002", shape=(12, 22, 18), spacing=(3.0, 0.8, 1.1))]
    nifti = write_raw_dataset(tmp_path / "nifti", cases)
    nrrd = write_raw_dataset(tmp_path / "nrrd", [], file_ending=".nrrd", description={"numTraining": 2})
    for folder in ("imagesTr", "labelsTr"):
        for name in os.listdir(os.path.join(nifti, folder)):
            sitk.WriteImage(sitk.ReadImage(os.path.join(nifti, folder, name)),
                            os.path.join(nrrd, folder, name.replace(".nii.gz", ".nrrd")))
    for raw in (nifti, nrrd):
        assert preprocess("--data_dir", raw, "--results_dir", f"{raw}-out") == 0
    for name in sorted(n for n in os.listdir(f"{nifti}-out") if n.endswith(".npy")):
        assert np.array_equal(np.load(f"{nifti}-out/{name}"), np.load(f"{nrrd}-out/{name}")), name


def test_a_label_map_in_place_of_an_image_is_refused_as_predict_refuses_it(tmp_path, capsys):
    """imagesTr and labelsTr swapped for one case: its "image" holds the label values only."""
    raw = write_raw_dataset(tmp_path / "raw", [RawCase("case_001", shape=(8, 10, 12))])
    path = image_path(raw, "case_001")
    with open(os.path.join(raw, "labelsTr", "case_001.nii.gz"), "rb") as label, open(path, "wb") as image:
        image.write(label.read())
    code = preprocess("--data_dir", raw, "--results_dir", tmp_path / "out")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and len(err) == 1 and path in err[0] and "label map" in err[0], err
