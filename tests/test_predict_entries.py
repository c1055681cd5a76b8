"""Predict's folder as a researcher hands it over, and a summary that means what it says.

- Every entry of ``--input`` accounted for: NIfTI, NRRD and MHA files, a KiTS19 case folder, a
  DICOM series folder and a patient folder holding two series and a localiser, side by side with
  a broken link, a folder named ``x.nii.gz``, a text file and a pipe: each scan segmented (each
  series on its own, named after its number and description), each other entry named in the
  summary with its reason; nothing stops the batch.
- Dice: a label absent from both the ground truth and the prediction is NaN and left out of the
  mean, the count of scans behind each mean beside it (oracle: MONAI's ``compute_dice`` with
  ``ignore_empty``, which agrees wherever the ground truth holds the label).
- A summary whose ``summary.jsonl`` alone could not be written says so, not "not written".
"""
import csv
import errno
import math
import os

import nibabel
import numpy as np
import pytest

from runtime.predict.records import CaseResult, score, summary_rows
from test_predict import blob_label, write_case, write_nifti
from test_predict_provenance import SPACING, cheap_network, predict, rows, trained_on  # noqa: F401


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return trained_on(tmp_path_factory.mktemp("ckpt") / "a.pt", (128,) * 3, filters=(2, 4, 4, 8, 8),
                      normalization="batchnorm")


# ----------------------------------------------------------------------------- Dice


def monai_dice(labels, truth):
    """MONAI's per-class Dice of two label maps (background excluded), NaN for an empty truth."""
    import torch
    from monai.metrics import compute_dice
    from monai.networks.utils import one_hot

    def hot(x):
        return one_hot(torch.as_tensor(x.astype(np.int64))[None, None], num_classes=3)

    return compute_dice(hot(labels), hot(truth), include_background=False, ignore_empty=True)[0].tolist()


def test_a_label_absent_from_both_is_nan_and_left_out_of_the_mean():
    """Random label maps, labels removed from both, from one, or from neither: each per-label
    Dice is MONAI's where the truth holds the label (within the benchmark's 1e-6 smoothing), NaN
    where neither holds it, 0 where only the prediction does; the mean row averages the scans a
    column is defined for and the count row says how many."""
    rng = np.random.default_rng(0)
    results = []
    for i, (drop_truth, drop_labels) in enumerate([((), ()), ((2,), (2,)), ((1, 2), (1, 2)), ((2,), ()), ((), (1,))]):
        truth, labels = rng.integers(0, 3, (2, 6, 7, 5)).astype(np.uint8)
        for c in drop_truth:
            truth[truth == c] = 0
        for c in drop_labels:
            labels[labels == c] = 0
        dice = score(labels, truth)
        theirs = monai_dice(labels, truth)
        for c, ours in zip((1, 2), (dice.l1_dice, dice.l2_dice)):
            if (truth == c).any():
                assert ours == pytest.approx(theirs[c - 1], abs=1e-6), (i, c)
            elif (labels == c).any():
                assert ours == pytest.approx(0.0, abs=1e-6), (i, c)
            else:
                assert math.isnan(ours), (i, c)
        result = CaseResult(f"s{i}", "segmented", "x")
        result.score(labels, truth)
        results.append(result)
    assert math.isnan(results[2].mean_dice) and math.isnan(results[2].kits_kidney_dice)  # an empty scan
    assert results[1].mean_dice == results[1].l1_dice  # the tumour absent from both: the kidney alone
    count, mean = summary_rows(results)[-2:]
    assert count["case"] == "count" and mean["case"] == "mean"
    for key in ("l1_dice", "l2_dice", "mean_dice", "kits_kidney_dice"):
        defined = [getattr(r, key) for r in results if not math.isnan(getattr(r, key))]
        assert count[key] == len(defined) and mean[key] == pytest.approx(np.mean(defined)), key
    assert (count["l1_dice"], count["l2_dice"], count["mean_dice"]) == (4, 3, 4)


def test_an_empty_scan_does_not_raise_the_mean_and_the_api_says_nan():
    """The issue's case: one scan scored 0.335, one with no kidney or tumour anywhere: the mean
    stays the first scan's (the benchmark's formula would score the empty one 1.0 and raise it)."""
    from runtime.predict.api import score as api_score

    truth = blob_label((12, 14, 13))
    labels = np.where(truth > 0, 1, 0).astype(np.uint8)
    labels[:4] = 0
    first, empty = CaseResult("a", "segmented", "a"), CaseResult("b", "segmented", "b")
    first.score(labels, truth)
    empty.score(np.zeros_like(truth), np.zeros_like(truth))
    mean = summary_rows([first, empty])[-1]
    assert mean["mean_dice"] == pytest.approx(first.mean_dice) and 0 < first.mean_dice < 0.9
    assert math.isnan(api_score(np.zeros((3, 3, 3)), np.zeros((3, 3, 3))).mean_dice)


# ----------------------------------------------------------------------------- every entry of a folder


def test_every_entry_of_a_folder_is_segmented_or_named_with_its_reason(tmp_path, capsys, checkpoint, cheap_network):
    sitk = pytest.importorskip("SimpleITK")
    from test_scan_formats import kits_volume, write_dicom_series

    root = tmp_path / "in"
    os.makedirs(root)
    image = kits_volume()
    nibabel.save(image, str(root / "nifti.nii.gz"))
    source = sitk.ReadImage(str(root / "nifti.nii.gz"))
    for key in source.GetMetaDataKeys():
        source.EraseMetaData(key)
    sitk.WriteImage(source, str(root / "nrrd.nrrd"))
    sitk.WriteImage(source, str(root / "meta.mha"))
    write_case(str(root), "case_00005", (20, 24, 22), SPACING)
    write_dicom_series(sitk, root / "series", image, "1.2.826.0.1.3680043.9.7.3.1")
    patient = root / "patient_A"
    write_dicom_series(sitk, patient, image, "1.2.826.0.1.3680043.9.7.3.2", number=2, description="ABDOMEN ART")
    write_dicom_series(sitk, patient, image, "1.2.826.0.1.3680043.9.7.3.3", number=3, description="ABDOMEN VEN",
                       names=[f"V{i}.dcm" for i in range(image.shape[0])])
    small = nibabel.Nifti1Image(np.asarray(image.dataobj)[:3], image.affine, image.header)
    write_dicom_series(sitk, patient, small, "1.2.826.0.1.3680043.9.7.3.4", number=1, description="Topogram",
                       names=[f"L{i}.dcm" for i in range(3)], image_type="ORIGINAL\\PRIMARY\\LOCALIZER")
    os.symlink(root / "gone.nii.gz", root / "broken.nii.gz")
    os.makedirs(root / "x.nii.gz")
    (root / "notes.txt").write_text("not a scan")
    os.mkfifo(root / "pipe")
    out = tmp_path / "out"
    code, stdout, stderr = predict(capsys, root, out, checkpoint)
    assert "Traceback" not in stderr
    table = rows(out)
    statuses = {case: row["status"] for case, row in table.items() if case not in ("count", "mean")}
    assert statuses == {
        "nifti": "segmented", "nrrd": "segmented", "meta": "segmented", "case_00005": "segmented",
        "series": "segmented", "patient_A_s2_ABDOMEN_ART": "segmented", "patient_A_s3_ABDOMEN_VEN": "segmented",
        "patient_A_s1_Topogram": "left out", "broken.nii.gz": "failed", "x.nii.gz/": "left out",
        "notes.txt": "left out", "pipe": "left out"}, statuses
    assert "broken symbolic link" in table["broken.nii.gz"]["error"]
    assert "localiser" in table["patient_A_s1_Topogram"]["error"]
    assert "a folder named like a scan file" in table["x.nii.gz/"]["error"]
    assert code == 1 and stderr.count("main.py: error:") == 1 and "broken symbolic link" in stderr, stderr
    assert "predict: 8 scans found: 7 segmented, 0 skipped" in stdout and "1 failed of 8 scans" in stdout, stdout
    assert "4 entries of --input left out (no scans)" in stdout and "left out: notes.txt (not a scan file" in stdout
    with open(out / "summary.csv") as handle:
        assert {r["case"] for r in csv.DictReader(handle)} == set(table)
    # the two series of one folder are two scans, each the volume written: the same labels
    art, ven = (np.asarray(nibabel.load(str(out / f"patient_A_s{n}.nii.gz")).dataobj)
                for n in ("2_ABDOMEN_ART", "3_ABDOMEN_VEN"))
    assert np.array_equal(art, ven) and np.array_equal(art, np.asarray(nibabel.load(str(out / "series.nii.gz")).dataobj))


def test_a_summary_whose_json_lines_alone_failed_says_which(tmp_path, capsys, checkpoint, cheap_network, monkeypatch):
    import data_loading.atomic
    import runtime.predict.records as records

    folder = tmp_path / "in"
    write_nifti(str(folder / "a.nii.gz"), np.random.default_rng(0).integers(-100, 300, (20, 24, 22)).astype(np.int16),
                SPACING)
    original = data_loading.atomic.atomic_write

    def full_for_jsonl(path, write):
        if path.endswith("summary.jsonl"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return original(path, write)

    monkeypatch.setattr(records, "atomic_write", full_for_jsonl)
    code, stdout, stderr = predict(capsys, folder, tmp_path / "out", checkpoint)
    assert code == 1
    assert f"cannot write {tmp_path / 'out' / 'summary.jsonl'}: {os.strerror(errno.ENOSPC)}" in stderr, stderr
    assert f"summary in {tmp_path / 'out' / 'summary.csv'} (summary.jsonl not written)" in stdout, stdout
    assert "not written)" not in stdout.replace("(summary.jsonl not written)", "")


# ----------------------------------------------------------------------------- evaluate beside a training run


@pytest.mark.slow  # two evaluate runs: about 5 s of CPU
def test_evaluate_in_a_training_runs_folder_writes_files_of_its_own(tmp_path, capsys):
    """--log_dir a training run's folder: its log.json and MLPerf log stay byte for byte, no
    eval_cases.csv appears; evaluate's record and per-case Dice are in evaluate.json and
    evaluate_cases.csv. In a folder of its own, evaluate writes log.json and eval_cases.csv as before."""
    import json

    import fake_data
    from main_runs import call

    checkpoint = trained_on(tmp_path / "c.pt", (32, 32, 32), filters=(2, 4, 4, 8, 8), normalization="batchnorm")
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.json").write_text(json.dumps({"time": 1.0, "kind": "train", "epoch": 1, "loss": 0.5, "lr": 0.1,
                                              "throughput": 1.0}) + "\n")
    (run / "unet3d.log").write_text(':::MLLOG {"key": "run_start"}\n')
    before = {name: (run / name).read_bytes() for name in ("log.json", "unet3d.log")}
    common = ["--exec_mode", "evaluate", "--data_dir", str(tmp_path), "--load_ckpt_path", checkpoint,
              "--device", "cpu", "--val_input_shape", "32", "32", "32"]
    code, out, err = call([*common, "--log_dir", str(run)], capsys, fake_data.FakeData(2, 1))
    assert code == 0, err
    assert {name: (run / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(run)) == ["evaluate.json", "evaluate_cases.csv", "log.json", "unet3d.log"]
    records = [json.loads(line) for line in open(run / "evaluate.json")]
    assert [r["kind"] for r in records] == ["backend", "eval"] and records[1]["checkpoint"] == checkpoint
    assert "holds a training run" in out
    code, out, err = call([*common, "--log_dir", str(tmp_path / "alone")], capsys, fake_data.FakeData(2, 1))
    assert code == 0, err
    assert sorted(os.listdir(tmp_path / "alone")) == ["eval_cases.csv", "log.json"]


# ----------------------------------------------------------------------------- files nibabel reads


def test_a_4d_file_of_one_volume_and_a_file_stating_no_orientation_are_read_as_nibabel_reads_them(
        tmp_path, capsys, checkpoint, cheap_network):
    """(X, Y, Z, 1): segmented as the (X, Y, Z) file with the same header, a 3-D output, one
    line saying so. sform and qform codes 0: segmented as the same array with nibabel's own
    ``img.affine`` for it (its fallback from pixdim) stated as sform, one line saying so."""
    from test_orientation import kits_image

    image = kits_image()
    data = np.asarray(image.dataobj)
    plain, odd = tmp_path / "plain", tmp_path / "odd"
    os.makedirs(plain)
    os.makedirs(odd)
    nibabel.save(image, str(plain / "four_d.nii.gz"))
    nibabel.save(nibabel.Nifti1Image(data[..., None], image.affine, image.header), str(odd / "four_d.nii.gz"))
    bare = nibabel.Nifti1Image(data, None)
    bare.header.set_zooms(image.header.get_zooms())
    nibabel.save(bare, str(odd / "bare.nii.gz"))
    bare = nibabel.load(str(odd / "bare.nii.gz"))
    assert int(bare.header["sform_code"]) == 0 == int(bare.header["qform_code"])
    stated = nibabel.Nifti1Image(data, bare.affine)  # the oracle: nibabel's affine of the bare file
    stated.header.set_sform(bare.affine, code=1)
    stated.header.set_zooms(image.header.get_zooms())
    nibabel.save(stated, str(plain / "bare.nii.gz"))
    code, stdout, stderr = predict(capsys, odd, tmp_path / "out_odd", checkpoint)
    assert code == 0 and "2 segmented" in stdout, stderr
    assert f"{odd / 'four_d.nii.gz'}: shape {data.shape + (1,)} read as the 3-D volume {data.shape}" in stdout
    assert f"{odd / 'bare.nii.gz'}: sform_code and qform_code are 0" in stdout and "fallback affine" in stdout
    assert predict(capsys, plain, tmp_path / "out_plain", checkpoint)[0] == 0
    for name in ("four_d", "bare"):
        ours = nibabel.load(str(tmp_path / "out_odd" / f"{name}.nii.gz"))
        theirs = nibabel.load(str(tmp_path / "out_plain" / f"{name}.nii.gz"))
        assert ours.shape == data.shape and np.allclose(ours.affine, theirs.affine), name
        assert np.array_equal(np.asarray(ours.dataobj), np.asarray(theirs.dataobj)), name


def test_an_output_dir_inside_the_input_folder_is_left_out_as_this_runs_outputs(tmp_path):
    """predict --input SCANS --output_dir SCANS/seg, run again: the segmentations in seg/ are this
    run's outputs, never a folder of scans to name or read."""
    from data_loading.scans import find_inputs

    scans = tmp_path / "scans"
    (scans / "seg").mkdir(parents=True)
    volume = np.full((8, 8, 8), -1000.0, np.float32)
    write_nifti(scans / "patient_A.nii.gz", volume, (1.0, 1.0, 1.0))
    write_nifti(scans / "seg" / "patient_A.nii.gz", np.zeros((8, 8, 8), np.uint8), (1.0, 1.0, 1.0))
    entries = {scan.name: scan for scan in find_inputs(str(scans), str(scans / "seg"))}
    assert entries["patient_A"].is_scan and entries["seg/"].left_out == "the --output_dir of this run"
    assert "folder of 1 scan file" in {s.name: s for s in find_inputs(str(scans))}["seg/"].left_out
