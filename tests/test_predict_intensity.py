"""Predict refuses a volume that does not look like CT in Hounsfield units, in one line naming it.

Known answers: a synthetic KiTS-like scan in HU (data_loading.synthetic) is segmented; the same
scan stored as HU + 1024 (a lost rescale intercept), as HU - 1024, and a constant -1000 volume
are refused, through the path the command line and the Python API share
(:func:`runtime.predict.scan.segment_volume`), and on the command line as one failed row of the
summary whose reason names the file, the other scans still segmented.
"""
import json

import numpy as np
import pytest
import torch

from data_loading import synthetic
from data_loading.scan_checks import MAX_DENSE_FRACTION, MIN_TISSUE_FRACTION, intensity_fractions
from data_loading.scans import ScanError
from runtime.predict.api import raw_from_array
from runtime.predict.scan import ScanInference, StageTimer, segment_volume
from main_runs import run_main
from test_predict import pointwise_model, tiny_checkpoint, window_config, write_nifti  # noqa: F401

SPACING = synthetic.TARGET_SPACING


def synthetic_scan(case_id=3, shape=(40, 48, 48)):
    """A small KiTS-like CT in HU (int16), at the target spacing."""
    return synthetic.make_case(case_id, shape, SPACING, synthetic.case_rng(0, case_id)).image


def segment(image):
    config = window_config("--val_input_shape", "128", "128", "128")  # one window: the check is the point
    infer = ScanInference(pointwise_model(), config, torch.device("cpu"))
    return segment_volume(raw_from_array(image, synthetic.kits_affine(SPACING)), infer, StageTimer(), path="scan.nii.gz")


def test_the_thresholds_sit_between_ct_and_its_broken_variants():
    """The measured fractions of docs/predict.md: a synthetic scan in HU has a third or more of
    air and of soft tissue and about 1 % denser than 500 HU; as HU + 1024 no air and half of it
    dense; as HU - 1024 or a constant -1000 volume no soft tissue."""
    image = synthetic_scan().astype(np.float32)
    air, tissue, dense = intensity_fractions(image)
    assert air > 0.3 and tissue > 0.3 and dense < 0.05
    air, tissue, dense = intensity_fractions(image + 1024)
    assert air == 0 and dense > 2 * MAX_DENSE_FRACTION
    assert intensity_fractions(image - 1024)[1] == 0 < MIN_TISSUE_FRACTION
    assert intensity_fractions(np.full_like(image, -1000))[1] == 0


@pytest.mark.parametrize("variant, reason", [
    ("hu_plus_1024", r"above 500 HU .*\(HU \+ 1024\)"),
    ("hu_minus_1024", r"0\.0% of the voxels within -150\.\.250 HU"),
    ("constant_air", r"0\.0% of the voxels within -150\.\.250 HU"),
])
def test_a_scan_not_in_hu_is_refused_in_one_line(variant, reason):
    image = synthetic_scan().astype(np.int32)
    broken = {"hu_plus_1024": image + 1024, "hu_minus_1024": image - 1024,
              "constant_air": np.full_like(image, -1000)}[variant]
    with pytest.raises(ScanError, match=reason) as refused:
        segment(broken)
    message = str(refused.value)
    assert message.startswith("scan.nii.gz: the intensities do not look like CT in Hounsfield units")
    assert "\n" not in message


def test_ct_is_segmented_even_cropped_to_the_body():
    """The scan in HU is segmented; so is a crop inside its body (no voxel below -500 HU: air is
    not required)."""
    image = synthetic_scan()
    assert segment(image).labels.shape == image.shape
    inside = image[:, 18:30, 14:34]
    assert intensity_fractions(inside.astype(np.float32))[0] == 0
    assert segment(inside).labels.shape == inside.shape


def test_the_command_line_names_the_refused_scan(tmp_path, tiny_checkpoint, capsys):  # noqa: F811
    """A scan stored as HU + 1024: one failed row of the summary whose reason names it, one
    stderr line, no segmentation written, exit status 1 (a folder's other scans still run:
    tests/test_predict.py::test_good_and_bad_scans_in_one_folder)."""
    folder, out = tmp_path / "in", tmp_path / "out"
    image = synthetic_scan(shape=(20, 24, 22))
    write_nifti(str(folder / "shifted.nii.gz"), (image.astype(np.int32) + 1024).astype(np.int16), SPACING)
    code, _, err = run_main(capsys, "--exec_mode", "predict", "--input", str(folder), "--output_dir", str(out),
                            "--load_ckpt_path", tiny_checkpoint, "--val_input_shape", "64", "64", "64",
                            "--backend", "torch")
    assert code == 1
    rows = {row["case"]: row for row in map(json.loads, open(out / "summary.jsonl"))}
    assert list(rows) == ["shifted"] and rows["shifted"]["status"] == "failed"
    assert "shifted.nii.gz: the intensities do not look like CT in Hounsfield units" in rows["shifted"]["error"]
    assert "HU + 1024" in rows["shifted"]["error"] and "shifted.nii.gz" in err
    assert not (out / "shifted.nii.gz").exists()
