"""A dataset's integrity (issue 56, item 5), as nnU-Net's ``verify_dataset_integrity`` checks it:
in ``imagesTr`` every image has its label and every label its image, the count is ``numTraining``,
every file follows ``file_ending`` and the one channel ``_0000``; otherwise one line, exit 1,
listing what is wrong, before anything is written. KiTS's case folders keep skipping the cases
without a label (its test cases), with a line.

The oracle is the set of files each test writes itself (tests/nnunet_raw.py, then one change):
what is wrong, and how many, is known from the change.
"""
from __future__ import annotations

import json
import os

import nibabel
import pytest

import preprocess_dataset
from data_loading import description as ds
from data_loading import synthetic
from nnunet_raw import RawCase, write_raw_dataset

SMALL = (6, 8, 10)


def raw_set(root, count=3, **kwargs):
    return write_raw_dataset(root, [RawCase(f"case_{i:03d}", shape=SMALL) for i in range(1, count + 1)], **kwargs)


def run(raw, out):
    return preprocess_dataset.main(["--data_dir", str(raw), "--results_dir", str(out), "--num_workers", "1"])


def refused(capsys, code, out):
    """The one error line of a refused run (exit 1, nothing written)."""
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and len(err) == 1 and err[0].startswith("preprocess_dataset.py: error: "), err
    assert "Traceback" not in err[0] and not os.path.exists(out)
    return err[0]


def test_a_complete_set_passes_and_hidden_files_are_not_cases(tmp_path):
    raw = raw_set(tmp_path / "raw")
    for folder in ("imagesTr", "labelsTr"):
        (tmp_path / "raw" / folder / ".DS_Store").write_bytes(b"\0")
    assert run(raw, tmp_path / "out") == 0
    assert sorted(n for n in os.listdir(tmp_path / "out") if n.endswith("_y.npy")) == [
        f"case_{i:05d}_y.npy" for i in (1, 2, 3)]


def test_a_missing_label_is_refused_naming_the_case(tmp_path, capsys):
    raw = raw_set(tmp_path / "raw")
    os.remove(os.path.join(raw, "labelsTr", "case_002.nii.gz"))
    line = refused(capsys, run(raw, tmp_path / "out"), tmp_path / "out")
    assert "1 image(s) without their label in labelsTr (case_002)" in line, line


def test_a_label_without_its_image_is_refused(tmp_path, capsys):
    raw = raw_set(tmp_path / "raw", description={"numTraining": 2})
    os.remove(os.path.join(raw, "imagesTr", "case_003_0000.nii.gz"))
    line = refused(capsys, run(raw, tmp_path / "out"), tmp_path / "out")
    assert "1 label(s) without their image in imagesTr (case_003)" in line and "numTraining" not in line, line


def test_a_label_stored_with_another_ending_is_refused(tmp_path, capsys):
    """``.nii`` where file_ending says ``.nii.gz``: a file of the wrong name, and its image then
    has no label; both said in the one line."""
    raw = raw_set(tmp_path / "raw")
    gz = os.path.join(raw, "labelsTr", "case_001.nii.gz")
    nibabel.save(nibabel.load(gz), gz[:-3])
    os.remove(gz)
    line = refused(capsys, run(raw, tmp_path / "out"), tmp_path / "out")
    assert "1 file(s) in labelsTr not named <case>.nii.gz (case_001.nii)" in line, line
    assert "1 image(s) without their label in labelsTr (case_001)" in line, line


def test_an_image_without_the_channel_suffix_is_refused(tmp_path, capsys):
    raw = raw_set(tmp_path / "raw")
    images = os.path.join(raw, "imagesTr")
    os.rename(os.path.join(images, "case_002_0000.nii.gz"), os.path.join(images, "case_002.nii.gz"))
    line = refused(capsys, run(raw, tmp_path / "out"), tmp_path / "out")
    assert "1 file(s) in imagesTr not named <case>_0000.nii.gz (case_002.nii.gz)" in line, line
    assert "1 label(s) without their image in imagesTr (case_002)" in line, line


def test_a_count_other_than_num_training_is_refused(tmp_path, capsys):
    raw = raw_set(tmp_path / "raw", description={"numTraining": 4})
    line = refused(capsys, run(raw, tmp_path / "out"), tmp_path / "out")
    assert "3 case(s) in imagesTr where numTraining says 4" in line, line


def test_many_problems_are_counted_and_the_first_names_shown(tmp_path, capsys):
    raw = raw_set(tmp_path / "raw", count=6)
    for i in range(1, 6):
        os.remove(os.path.join(raw, "labelsTr", f"case_{i:03d}.nii.gz"))
    (tmp_path / "raw" / "imagesTr" / "notes.txt").write_text("scanner B")
    line = refused(capsys, run(raw, tmp_path / "out"), tmp_path / "out")
    assert "5 image(s) without their label in labelsTr (case_001, case_002, case_003, ...)" in line, line
    assert "(notes.txt)" in line and "6 case(s)" not in line, line   # numTraining 6 holds: 6 images


@pytest.mark.parametrize("value", ["three", -1, 2.5, True])
def test_a_num_training_that_is_no_count_is_one_line_naming_the_description(tmp_path, capsys, value):
    raw = raw_set(tmp_path / "raw", count=1, description={"numTraining": value})
    line = refused(capsys, run(raw, tmp_path / "out"), tmp_path / "out")
    assert ds.DESCRIPTION_FILE in line and "numTraining" in line, line


def test_case_folders_keep_skipping_the_unlabelled_test_cases_with_a_line(tmp_path, capsys):
    """KiTS's layout: cases without a segmentation (KiTS's test cases) are skipped and said, exit 0."""
    raw = tmp_path / "raw"
    for case_id, labelled in ((300, True), (301, True), (700, False)):
        case = synthetic.make_case(case_id, SMALL, (2.0, 1.5, 1.4), synthetic.case_rng(0, case_id))
        synthetic.save_case(case, str(raw), labelled=labelled)
    (raw / ds.DESCRIPTION_FILE).write_text(json.dumps({"labels": {"background": 0, "kidney": 1, "tumor": 2}}))
    assert run(raw, tmp_path / "out") == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipping")]
    assert said == ["skipping 1 cases without a label file (case_00700)"], said
    assert sorted(n for n in os.listdir(tmp_path / "out") if n.endswith("_y.npy")) == [
        "case_00300_y.npy", "case_00301_y.npy"]
