"""Every label checked against its scan's geometry, one spacing per file, and the KiTS cases
beyond KiTS19's 210 (issue 42, items 2, 3 and 7's first part).

The oracle for "the same voxels in space" is nibabel's own geometry: a label written with
``as_reoriented`` (its array permuted and flipped, its affine changed to match) holds the very
labels the original does at every world position; a label whose affine is shifted does not. The
spacing oracle is nibabel's ``voxel_sizes`` of the file's affine. (SimpleITK is no oracle for the
stale-pixdim case: ITK reads such a file's spacing from ``pixdim`` and warns that the sform has
"unexpected scales".)
"""
import os
import sys

import nibabel
import numpy as np
import pytest
import torch
from nibabel.affines import voxel_sizes
from nibabel.orientations import axcodes2ornt, io_orientation, ornt_transform

import preprocess_dataset
from data_loading import synthetic
from data_loading.preprocessing import FIRST_UNLABELLED_ID, PreprocessError, RawCase, find_cases, load_pair
from data_loading.scan_checks import check_header
from data_loading.scans import (Scan, ScanError, read_label, read_labels_file, read_scan, segmentation_nifti,
                                write_segmentation)
from runtime.predict.scan import segment_scan
from segmenters import segmenter

ORIGIN = (12.5, -40.0, 7.25)
SHAPE = (14, 18, 16)
SPACING = (2.5, 1.5, 1.7)


def blob_label(shape):
    """An asymmetric kidney (1) with a tumour (2): any flip or swap of axes moves voxels."""
    grid = np.meshgrid(*[np.linspace(-1, 1, s) for s in shape], indexing="ij")
    label = np.zeros(shape, np.uint8)
    label[sum(((x - o) / r) ** 2 for x, o, r in zip(grid, (0.2, 0.25, -0.3), (0.55, 0.5, 0.45))) <= 1] = 1
    label[sum(((x - o) / r) ** 2 for x, o, r in zip(grid, (0.35, 0.4, -0.4), (0.3, 0.25, 0.25))) <= 1] = 2
    return label


def kits_nifti(array, spacing=SPACING, origin=ORIGIN, pixdim=None):
    """``array`` with a KiTS19-like affine (sform and qform, code 1); ``pixdim`` written over
    the header's after the affine (a stale one) when given."""
    affine = synthetic.kits_affine(spacing)
    affine[:3, 3] = origin
    image = nibabel.Nifti1Image(array, affine)
    image.header.set_qform(affine, code=1)
    image.header.set_sform(affine, code=1)
    image.header.set_zooms(tuple(pixdim or spacing))
    return image


def save(image, path):
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    nibabel.save(image, str(path))
    return str(path)


def reoriented(image, codes):
    """The same voxels in space stored with axis codes ``codes`` (nibabel's own transform)."""
    return image.as_reoriented(ornt_transform(io_orientation(image.affine), axcodes2ornt(codes)))


def ct_of(label, seed=0):
    rng = np.random.default_rng(seed)
    return (np.choose(label, [30, 180, 105]) + rng.normal(0, 12, label.shape)).astype(np.int16)


def threshold_infer(image):
    """Class probabilities from intensities alone (an oracle "network"): kidney bright,
    tumour between, with a margin that leaves some voxels wrong (Dice below 1)."""
    x = torch.from_numpy(np.asarray(image[0]))
    kidney = (x > 0.65).float()
    tumour = ((x > -0.2) & (x <= 0.65)).float()
    return torch.stack([1 - kidney - tumour, kidney, tumour])


def out_dir(path):
    os.makedirs(str(path), exist_ok=True)
    return str(path)


def write_scan_and_truth(folder, label_image):
    label = blob_label(SHAPE)
    scan = save(kits_nifti(ct_of(label)), os.path.join(folder, "imaging.nii.gz"))
    truth = save(label_image(kits_nifti(label)), os.path.join(folder, "segmentation.nii.gz"))
    return Scan("case", scan, truth)


# ----------------------------------------------------------------------------- predict's scores


@pytest.mark.parametrize("codes", [("S", "A", "R"), ("I", "A", "L"), ("R", "A", "S"), ("L", "S", "P")])
def test_a_ground_truth_stored_in_another_axis_order_scores_as_the_original(tmp_path, codes):
    original = segment_scan(write_scan_and_truth(str(tmp_path / "a"), lambda img: img), segmenter(threshold_infer),
                            out_dir(tmp_path / "out_a"))
    moved = write_scan_and_truth(str(tmp_path / "b"), lambda img: reoriented(img, codes))
    assert nibabel.aff2axcodes(nibabel.load(moved.label_path).affine) == codes     # stored otherwise
    result = segment_scan(moved, segmenter(threshold_infer), out_dir(tmp_path / "out_b"))
    assert 0.3 < original.l1_dice < 1 and 0.3 < original.l2_dice < 1
    assert (result.l1_dice, result.l2_dice, result.kits_kidney_dice) == (
        original.l1_dice, original.l2_dice, original.kits_kidney_dice)


def test_read_label_brings_a_flipped_label_to_the_scans_grid_exactly(tmp_path):
    label = blob_label(SHAPE)
    scan = save(kits_nifti(ct_of(label)), tmp_path / "scan.nii.gz")
    flipped = save(reoriented(kits_nifti(label), ("I", "P", "R")), tmp_path / "flipped.nii.gz")
    assert not np.array_equal(np.asarray(nibabel.load(flipped).dataobj), label)   # the stored array differs
    raw = read_scan(scan)
    assert np.array_equal(read_label(flipped, raw.file_shape, raw.orientation, scan), label)
    assert np.array_equal(read_label(flipped, raw.file_shape, scan_path=scan), label)   # header read for it


@pytest.mark.parametrize("how", ["shifted", "other_shape", "rotated_grid"])
def test_a_label_on_another_grid_is_refused_naming_both_files(tmp_path, how):
    label = blob_label(SHAPE)
    scan = save(kits_nifti(ct_of(label)), tmp_path / "scan.nii.gz")
    if how == "shifted":     # the same shape and axes, two voxels further along z
        other = kits_nifti(label, origin=(ORIGIN[0], ORIGIN[1], ORIGIN[2] + 2 * SPACING[0]))
    elif how == "other_shape":
        other = kits_nifti(np.zeros((14, 18, 15), np.uint8))
    else:                    # the array transposed but the affine kept: not the same voxels in space
        other = kits_nifti(np.ascontiguousarray(label.transpose(0, 2, 1)), spacing=(2.5, 1.5, 1.5))
    path = save(other, tmp_path / "truth.nii.gz")
    raw = read_scan(scan)
    with pytest.raises(ScanError) as info:
        read_label(path, raw.file_shape, raw.orientation, scan)
    text = str(info.value)
    assert "\n" not in text and path in text and scan in text and "grid" in text


def test_a_refused_label_fails_its_scan_in_one_line(tmp_path):
    scan = write_scan_and_truth(str(tmp_path / "a"), lambda img: kits_nifti(
        np.asarray(img.dataobj), origin=(ORIGIN[0] + 5 * SPACING[2], ORIGIN[1], ORIGIN[2])))
    with pytest.raises(ScanError, match="not on the voxel grid of its scan"):
        segment_scan(scan, segmenter(threshold_infer), out_dir(tmp_path / "out"))


# ----------------------------------------------------------------------------- preprocessing


def write_kits_case(root, case_id, label_image=lambda img: img, image_pixdim=None):
    label = blob_label(SHAPE)
    folder = os.path.join(str(root), f"case_{case_id:05d}")
    save(kits_nifti(ct_of(label, case_id), pixdim=image_pixdim), os.path.join(folder, "imaging.nii.gz"))
    save(label_image(kits_nifti(label)), os.path.join(folder, "segmentation.nii.gz"))


def test_preprocessing_writes_a_flipped_labels_training_data_byte_identical(tmp_path):
    write_kits_case(tmp_path / "a", 0)
    write_kits_case(tmp_path / "b", 0, lambda img: reoriented(img, ("S", "A", "R")))
    for name in ("a", "b"):
        assert preprocess_dataset.main(["--data_dir", str(tmp_path / name), "--results_dir",
                                        str(tmp_path / f"out_{name}"), "--num_workers", "1"]) == 0
    for suffix in ("_x.npy", "_y.npy"):
        a, b = ((tmp_path / f"out_{n}" / f"case_00000{suffix}").read_bytes() for n in "ab")
        assert a == b, suffix


@pytest.mark.parametrize("problem", ["shifted_label", "stale_pixdim"])
def test_preprocessing_refuses_a_mismatched_case_in_one_line(tmp_path, capsys, problem):
    if problem == "shifted_label":
        write_kits_case(tmp_path / "raw", 4, lambda img: kits_nifti(np.asarray(img.dataobj),
                                                                    origin=(0.0, 0.0, 0.0)))
        named = ["case_00004/segmentation.nii.gz", "case_00004/imaging.nii.gz"]
    else:  # pixdim says 5 mm slices, the affine 2.5 mm, in generated data (KiTS19's: a warning, test_preprocess.py)
        write_kits_case(tmp_path / "raw", 4, image_pixdim=(5.0, 1.5, 1.7))
        synthetic.write_marker(str(tmp_path / "raw"), seed=0, size="small", ids=[4])
        named = ["case_00004/imaging.nii.gz", "pixdim", "affine", "not KiTS19"]
    code = preprocess_dataset.main(["--data_dir", str(tmp_path / "raw"), "--results_dir", str(tmp_path / "out"),
                                    "--num_workers", "1"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and all(n in lines[0] for n in named), lines
    assert not os.path.exists(tmp_path / "out" / "case_00004_y.npy")


def test_load_pair_keeps_the_label_array_when_the_grids_are_one(tmp_path):
    """The benchmark's path: the label on its image's grid is the array read, not a copy."""
    write_kits_case(tmp_path, 7)
    case = RawCase(7, str(tmp_path / "case_00007" / "imaging.nii.gz"),
                   str(tmp_path / "case_00007" / "segmentation.nii.gz"))
    image, label, spacing = load_pair(case)
    assert np.array_equal(label[0], blob_label(SHAPE)) and spacing == nibabel.load(case.image_path).header[
        "pixdim"][1:4].tolist()


# ----------------------------------------------------------------------------- one spacing


def test_a_stale_pixdim_gives_the_affines_spacing_and_volumes(tmp_path, capsys):
    label = blob_label(SHAPE)
    stale = (5.0, 3.0, 3.4)     # 2 x 2 x 2: a volume 8 times the real one
    scan = Scan("stale", save(kits_nifti(ct_of(label), pixdim=stale), tmp_path / "in" / "stale.nii.gz"))
    sizes = voxel_sizes(nibabel.load(scan.image_path).affine)                     # nibabel's oracle
    assert not np.allclose(sizes, stale)
    raw = read_scan(scan.image_path)
    assert np.allclose(raw.file_spacing, sizes, rtol=0, atol=1e-12) and "pixdim" in raw.note
    result = segment_scan(scan, segmenter(threshold_infer), out_dir(tmp_path / "out"))
    said = [line for line in capsys.readouterr().out.splitlines() if "pixdim" in line]
    assert len(said) == 1 and scan.image_path in said[0] and "sform" in said[0]
    labels = np.asarray(nibabel.load(str(tmp_path / "out" / "stale.nii.gz")).dataobj)
    per_voxel = float(np.prod(sizes)) / 1000
    assert result.kidney_ml == pytest.approx(np.count_nonzero(labels == 1) * per_voxel, rel=1e-12)
    # the output keeps the scan's header; read back (a skipped scan's summary), the same spacing
    assert np.allclose(read_labels_file(str(tmp_path / "out" / "stale.nii.gz"))[1], sizes, rtol=0, atol=1e-12)
    assert list(check_header(scan.image_path, limit=2**40).shape) == list(SHAPE)


def test_the_api_and_the_cli_read_one_spacing_from_such_a_file(tmp_path):
    from runtime.predict.api import raw_from_array

    path = save(kits_nifti(ct_of(blob_label(SHAPE)), pixdim=(5.0, 3.0, 3.4)), tmp_path / "stale.nii.gz")
    nifti = nibabel.load(path)
    api = raw_from_array(np.asarray(nifti.dataobj), nifti.affine)
    assert np.allclose(read_scan(path).spacing, api.spacing, rtol=0, atol=1e-12)


def test_an_agreeing_pixdim_is_read_as_before_bit_for_bit(tmp_path):
    """pixdim in float32 and the affine's voxel sizes agree: the very pixdim list, no note (the
    benchmark's reading, which compares the list with [1.6, 1.2, 1.2] as it is)."""
    path = save(kits_nifti(ct_of(blob_label(SHAPE)), spacing=(1.6, 1.2, 1.2)), tmp_path / "scan.nii.gz")
    raw = read_scan(path)
    assert raw.spacing == nibabel.load(path).header["pixdim"][1:4].tolist() and raw.note == ""


# ----------------------------------------------------------------------------- ids >= 210


def test_labelled_cases_beyond_kits19_are_skipped_with_the_true_reason(tmp_path, capsys):
    write_kits_case(tmp_path, 3)
    write_kits_case(tmp_path, 210)            # a KiTS21/23 download: labels beyond KiTS19's cases
    write_kits_case(tmp_path, 211)
    os.remove(tmp_path / "case_00211" / "segmentation.nii.gz")
    labelled, beyond = find_cases(str(tmp_path))
    assert [c.case_id for c in labelled] == [3] and [c.label_path is not None for c in beyond] == [True, False]
    assert preprocess_dataset.main(["--data_dir", str(tmp_path), "--results_dir", str(tmp_path / "out"),
                                    "--num_workers", "1"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if str(FIRST_UNLABELLED_ID) in line]
    assert len(said) == 1 and "no labels" not in said[0], said
    assert "skipping 2 cases" in said[0] and "1 of them with a segmentation.nii.gz" in said[0]
    assert sorted(f for f in os.listdir(tmp_path / "out") if f.endswith(".npy")) == [
        "case_00003_x.npy", "case_00003_y.npy"]


def no_orientation(image):
    """``image``'s array and pixdim in a file that states no orientation (sform and qform codes 0)."""
    bare = nibabel.Nifti1Image(np.asarray(image.dataobj), None)
    bare.header.set_zooms(image.header.get_zooms())
    assert int(bare.header["sform_code"]) == 0 and int(bare.header["qform_code"]) == 0
    return bare


def test_a_file_that_states_no_orientation_is_compared_by_shape_and_voxel_size(tmp_path):
    """No pair of affines to compare: same shape and voxel sizes is the scan's grid (preprocessing
    writes the same bytes); another voxel size is refused naming both files."""
    write_kits_case(tmp_path / "a", 0)
    write_kits_case(tmp_path / "b", 0, no_orientation)                 # a bare label
    write_kits_case(tmp_path / "c", 0)                                  # a bare image
    image_path = str(tmp_path / "c" / "case_00000" / "imaging.nii.gz")
    save(no_orientation(nibabel.load(image_path)), image_path)
    for name in "abc":
        assert preprocess_dataset.main(["--data_dir", str(tmp_path / name), "--results_dir",
                                        str(tmp_path / f"out_{name}"), "--num_workers", "1"]) == 0
    y = [(tmp_path / f"out_{n}" / "case_00000_y.npy").read_bytes() for n in "abc"]
    assert y[0] == y[1] == y[2]
    label = blob_label(SHAPE)
    scan = save(kits_nifti(ct_of(label)), tmp_path / "scan.nii.gz")
    other = no_orientation(kits_nifti(label, spacing=(2.5, 1.5, 1.5)))
    path = save(other, tmp_path / "bare.nii.gz")
    raw = read_scan(scan)
    assert np.array_equal(read_label(save(no_orientation(kits_nifti(label)), tmp_path / "ok.nii.gz"),
                                     raw.file_shape, raw.orientation, scan), label)
    with pytest.raises(ScanError) as info:
        read_label(path, raw.file_shape, raw.orientation, scan)
    assert "\n" not in str(info.value) and path in str(info.value) and scan in str(info.value)


@pytest.mark.parametrize("orient", ["LPS", "RAS", "SRA"])
def test_a_label_rewritten_by_simpleitk_in_another_orientation_is_the_original_on_the_scans_grid(tmp_path, orient):
    """SimpleITK's own geometry as the oracle: the label reoriented by ITK (``DICOMOrient``) and
    written by ITK; ITK's nearest-neighbour resampling of it onto the scan's grid, and ours."""
    sitk = pytest.importorskip("SimpleITK")
    label = blob_label(SHAPE)
    scan = save(kits_nifti(ct_of(label)), tmp_path / "scan.nii.gz")
    source = save(kits_nifti(label), tmp_path / "label.nii.gz")
    moved = str(tmp_path / "moved.nii.gz")
    sitk.WriteImage(sitk.DICOMOrient(sitk.ReadImage(source), orient), moved)
    stored = np.asarray(nibabel.load(moved).dataobj)
    assert stored.shape != label.shape or not np.array_equal(stored, label)        # not stored as the scan's
    on_grid = sitk.Resample(sitk.ReadImage(moved), sitk.ReadImage(scan), sitk.Transform(), sitk.sitkNearestNeighbor)
    itk_labels = sitk.GetArrayFromImage(on_grid).T                                 # (k, j, i) -> (i, j, k)
    raw = read_scan(scan)
    ours = read_label(moved, raw.file_shape, raw.orientation, scan)
    assert np.array_equal(itk_labels, label) and np.array_equal(ours, itk_labels)
