"""Predict's window, the record of what made each segmentation, and KiTS19's scores.

- The window: a network trained on 64³ patches predicts with 64³ windows without any flag
  (known answer: a scan preprocessed to 128³ takes 3 x 3 x 3 = 27 such windows at overlap 0.5,
  and 1 of 128³); ``--val_input_shape`` wins; a checkpoint that records no patch keeps the
  default; evaluate keeps the benchmark's 128³ and says so.
- Provenance: ``<case>.provenance.json`` beside each segmentation; an output is reused only when
  its record matches this run in every field, else segmented again; a second checkpoint into
  the first one's folder never leaves the first one's segmentation under exit code 0; a record
  never claims an output that was not completely written.
- Scores: KiTS19's "Kidney" (labels 1 and 2 as one) and "Tumour" (label 2) beside the
  benchmark's per-label Dice, on hand-built label volumes with Dice computed by hand.
"""
import csv
import dataclasses
import hashlib
import json
import os

import nibabel
import numpy as np
import pytest

import fake_data
from checkpoints import architecture, reference_format_checkpoint, unet, write_checkpoint
from data_loading.scans import find_scans
from main_runs import call, predict_runner
from runtime.predict.provenance import FIELDS, MADE_BY
from runtime.predict.records import CaseResult, summary_texts
from test_predict import ground_truth_oracle, write_case, write_nifti

SMALL = (2, 4, 4, 8, 8)
SPACING = (1.6, 1.2, 1.2)  # the target spacing: the scan is not resampled, only padded to 128


def trained_on(path, patch, seed=0, filters=SMALL, **changes):
    """A checkpoint as a training run with ``--input_shape patch`` saves it."""
    config = dataclasses.replace(architecture(filters), input_shape=tuple(patch), **changes)
    write_checkpoint(str(path), config, seed=seed)
    return str(path)


def scan_folder(root, names=("scan",), shape=(20, 24, 22)):
    for i, name in enumerate(names):
        image = np.random.default_rng(i).integers(-100, 300, shape).astype(np.int16)
        write_nifti(os.path.join(str(root), f"{name}.nii.gz"), image, SPACING)
    return str(root)


predict = predict_runner("--device", "cpu")


def rows(out) -> dict:
    return {r["case"]: r for r in map(json.loads, open(os.path.join(str(out), "summary.jsonl")))}


def record(out, case="scan") -> dict:
    with open(os.path.join(str(out), f"{case}.provenance.json")) as handle:
        return json.load(handle)


def labels_of(path) -> np.ndarray:
    return np.asarray(nibabel.load(str(path)).dataobj)


@pytest.fixture
def cheap_network(monkeypatch):
    """The windows' logits from a stand-in instead of the network (a 128³ forward pass of even a
    tiny U-Net takes seconds on a loaded 2-core machine): kidney where the preprocessed image is
    bright. Everything else runs as it does: the window from the resolved config, the sliding
    window and its count, the records, the summary."""
    install_cheap_network(monkeypatch)


def install_cheap_network(monkeypatch):
    """Put ``cheap_network``'s stand-in in place (also after ``monkeypatch.undo``): every
    backend of the registry converts the network to it."""
    import dataclasses

    import torch

    from runtime.inference.backends import BACKENDS

    def logits(batch):
        out = torch.zeros(batch.shape[0], 3, *batch.shape[2:])
        out[:, 1] = batch[:, 0]
        return out

    for name, backend in list(BACKENDS.items()):
        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(backend, convert=lambda *args, **kwargs: logits))


# ----------------------------------------------------------------------------- the window


def test_the_window_is_the_checkpoints_training_patch(tmp_path, capsys, cheap_network):
    """20 x 24 x 22 voxels at the target spacing: padded to 128³. 64³ windows at overlap 0.5
    step 32 voxels: (128 - 64) / 32 + 1 = 3 per axis, 27 in all; one 128³ window covers it."""
    patch64 = trained_on(tmp_path / "patch64.pt", (64, 64, 64), filters=SMALL)
    folder = scan_folder(tmp_path / "in")
    code, stdout, _ = predict(capsys, folder, tmp_path / "own", patch64)
    assert code == 0
    assert "window 64x64x64 from the checkpoint's training patch" in stdout
    assert rows(tmp_path / "own")["scan"]["windows"] == 27
    assert rows(tmp_path / "own")["scan"]["window_shape"] == [64, 64, 64]
    # an explicit flag wins, and the line says what the checkpoint was trained on
    code, stdout, _ = predict(capsys, folder, tmp_path / "flag", patch64, "--val_input_shape", "128", "128", "128")
    assert code == 0
    assert "window 128x128x128 from --val_input_shape (the checkpoint was trained on 64x64x64 patches)" in stdout
    assert rows(tmp_path / "flag")["scan"]["windows"] == 1


def test_a_checkpoint_without_a_training_patch_keeps_the_default_window(tmp_path, capsys):
    """The reference's checkpoints record no config: the default 128³ window, said so."""
    checkpoint = str(tmp_path / "reference.pt")
    reference_format_checkpoint(checkpoint, unet(architecture(SMALL)))
    code, stdout, _ = predict(capsys, scan_folder(tmp_path / "in"), tmp_path / "out", checkpoint,
                              "--filters", *map(str, SMALL))
    assert code == 0
    assert "window 128x128x128 (the default: the checkpoint records no training patch)" in stdout
    assert rows(tmp_path / "out")["scan"]["windows"] == 1


def test_evaluate_keeps_the_benchmarks_window_and_says_which(tmp_path, capsys):
    """Evaluate computes the benchmark's number: 128³ whatever the checkpoint's patch, unless
    --val_input_shape is given; the line names the window either way."""
    checkpoint = trained_on(tmp_path / "c.pt", (32, 32, 32), filters=SMALL, normalization="batchnorm")
    common = ["--exec_mode", "evaluate", "--data_dir", str(tmp_path), "--load_ckpt_path", checkpoint,
              "--device", "cpu"]
    code, out, err = call([*common, "--log_dir", str(tmp_path / "default")], capsys, fake_data.FakeData(2, 1))
    assert code == 0, err
    assert "window 128x128x128 (the default, the benchmark's; the checkpoint was trained on 32x32x32 patches)" in out
    code, out, err = call([*common, "--log_dir", str(tmp_path / "flag"), "--val_input_shape", "32", "32", "32"],
                          capsys, fake_data.FakeData(2, 1))
    assert code == 0, err
    assert "window 32x32x32 from --val_input_shape" in out and "trained on" not in out


# ----------------------------------------------------------------------------- provenance


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """Two small networks of the same architecture and patch (128³: one window per scan),
    different weights."""
    folder = tmp_path_factory.mktemp("ckpts")
    return tuple(trained_on(folder / f"{name}.pt", (128,) * 3, seed=seed, filters=SMALL, normalization="batchnorm")
                 for seed, name in enumerate("ab"))


def test_the_same_checkpoint_reuses_its_outputs_and_records_what_made_them(tmp_path, capsys, two_checkpoints,
                                                                           cheap_network):
    first, _ = two_checkpoints
    folder = scan_folder(tmp_path / "in", ("one", "two"))
    out = tmp_path / "out"
    code, stdout, _ = predict(capsys, folder, out, first)
    assert code == 0 and "2 segmented, 0 skipped" in stdout
    import runtime

    made = record(out, "one")
    assert made["version"] == runtime.__version__
    assert made["input_sha256"] == hashlib.sha256(open(os.path.join(folder, "one.nii.gz"), "rb").read()).hexdigest()
    assert (made["window_shape"], made["overlap"], made["tta"], made["int8"], made["amp"]) == ([128] * 3, 0.5,
                                                                                             False, False, "off")
    assert made["backend"] in ("torch", "openvino") and made["checkpoint"] == os.path.abspath(first)
    assert len(made["weights_sha256"]) == 64
    summary = rows(out)
    assert all(summary["one"][k] == made[k] for k in FIELDS)  # the summary carries the record
    header = open(out / "summary.csv").readline().strip().split(",")
    assert set(FIELDS) <= set(header)
    os.utime(out / "one.nii.gz", (1, 1))
    code, stdout, _ = predict(capsys, folder, out, first)
    assert code == 0 and "0 segmented, 2 skipped" in stdout
    assert os.stat(out / "one.nii.gz").st_mtime == 1  # reused, not rewritten
    assert rows(out)["one"]["weights_sha256"] == made["weights_sha256"]


def test_a_cohort_is_kept_another_model_replaces_nothing_without_force(tmp_path, capsys, two_checkpoints,
                                                                       cheap_network):
    """A cohort predicted a subset at a time into one folder: the summary holds every scan's row
    (the newest per scan, each with the weights that made it). A second checkpoint into that
    folder replaces nothing (status "kept", exit 1, named); with --force its outputs and records
    replace the first one's, and the lines name them."""
    first, second = two_checkpoints
    folder = scan_folder(tmp_path / "in", ("a", "b", "c"))
    subset = tmp_path / "subset"
    os.makedirs(subset)
    for name in ("a", "b"):
        os.link(os.path.join(folder, f"{name}.nii.gz"), subset / f"{name}.nii.gz")
    shared = tmp_path / "shared"
    assert predict(capsys, subset, shared, first)[0] == 0
    by_first = record(shared, "a")["weights_sha256"]
    earlier = {case: (shared / f"{case}.nii.gz").read_bytes() for case in ("a", "b")}
    code, stdout, stderr = predict(capsys, folder, shared, second)  # a, b: the first model's; c: new
    assert code == 1 and "1 segmented, 0 skipped" in stdout and "2 kept" in stdout, stdout
    assert "kept (the output of another model; --force replaces it): a, b" in stdout
    assert stderr.count("made by another model") == 2 and by_first[:12] in stderr, stderr
    table = rows(shared)
    assert sorted(table) == ["a", "b", "c"]  # no ground truth: no mean
    assert [table[c]["weights_sha256"] == by_first for c in "abc"] == [True, True, False]
    assert [table[c]["status"] for c in "abc"] == ["kept", "kept", "segmented"]
    for case in ("a", "b"):
        assert (shared / f"{case}.nii.gz").read_bytes() == earlier[case]
        assert record(shared, case)["weights_sha256"] == by_first
    # one scan again with the first model: its row the newest, every other row kept
    only_a = tmp_path / "only_a"
    os.makedirs(only_a)
    os.link(os.path.join(folder, "a.nii.gz"), only_a / "a.nii.gz")
    code, stdout, _ = predict(capsys, only_a, shared, first)
    assert code == 0 and "0 segmented, 1 skipped" in stdout
    assert {c: rows(shared)[c]["status"] for c in "abc"} == {"a": "skipped", "b": "kept", "c": "segmented"}
    # --force: the second model's outputs replace the first's, named
    code, stdout, _ = predict(capsys, folder, shared, second, "--force")
    assert code == 0 and "3 segmented, 0 skipped" in stdout, stdout
    assert "replaced the outputs of another model (--force): a, b" in stdout
    assert "replaced an earlier output of another model (weights " + by_first[:12] in stdout
    for case in "abc":
        assert record(shared, case)["weights_sha256"] == rows(shared)[case]["weights_sha256"] != by_first
        assert rows(shared)[case]["status"] == "segmented"


def other_value(value):
    """A value of the same kind that differs from ``value``."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, float):
        return value + 0.25
    if isinstance(value, list):
        return [s * 2 for s in value]
    return value + "-other"


def test_a_record_that_differs_in_any_one_field_is_segmented_again(tmp_path, capsys, two_checkpoints, cheap_network):
    """The stored record is edited in one field at a time (as if another run had made the
    output): each time the scan is segmented again and its record is this run's again."""
    first, _ = two_checkpoints
    folder = scan_folder(tmp_path / "in")
    out = tmp_path / "out"
    assert predict(capsys, folder, out, first)[0] == 0
    made = record(out)
    for field in MADE_BY:
        (out / "scan.provenance.json").write_text(json.dumps(dict(made, **{field: other_value(made[field])})))
        # other weights: another model, whose output only --force replaces
        force = ["--force"] if field == "weights_sha256" else []
        code, stdout, _ = predict(capsys, folder, out, first, *force)
        assert code == 0 and "1 segmented, 0 skipped" in stdout, field
        assert (f"made with {field} " if not force else "of another model") in stdout, field
        assert record(out) == made, field


def test_what_this_run_changes_is_what_its_record_says(tmp_path, capsys, two_checkpoints, monkeypatch,
                                                        cheap_network):
    """Real changes of the run, one after the other in one folder, each segmented again and
    recorded: a flag, the project's version, the input scan, and --force (the same record
    again); an output with no record beside it is refused, never replaced."""
    import runtime.predict.provenance as provenance

    first, _ = two_checkpoints
    folder = scan_folder(tmp_path / "in")
    out = tmp_path / "out"

    def again(*flags):
        code, stdout, _ = predict(capsys, folder, out, first, *flags)
        assert code == 0 and "1 segmented, 0 skipped" in stdout, stdout
        return record(out), stdout

    assert predict(capsys, folder, out, first)[0] == 0
    made = record(out)
    assert again("--val_input_shape", "64", "64", "64")[0]["window_shape"] == [64, 64, 64]
    assert again("--overlap", "0.25")[0]["overlap"] == 0.25
    monkeypatch.setattr(provenance, "__version__", "99.0.0")
    assert again()[0]["version"] == "99.0.0"
    monkeypatch.setattr(provenance, "__version__", made["version"])
    image = np.random.default_rng(9).integers(-100, 300, (20, 24, 22)).astype(np.int16)
    write_nifti(os.path.join(folder, "scan.nii.gz"), image, SPACING)
    changed_input = again()[0]
    assert changed_input["input_sha256"] not in ("", made["input_sha256"])
    assert dict(changed_input, input_sha256=None) == dict(made, input_sha256=None)
    os.remove(out / "scan.provenance.json")  # an output no record vouches for is never replaced
    kept = (out / "scan.nii.gz").read_bytes()
    for flags in ([], ["--force"]):
        code, _, stderr = predict(capsys, folder, out, first, *flags)
        assert code == 1 and "scan.nii.gz exists and no record" in stderr and stderr.count("\n") == 1, stderr
        assert (out / "scan.nii.gz").read_bytes() == kept
    os.remove(out / "scan.nii.gz")
    assert again()[0] == changed_input
    assert again("--force")[0] == changed_input


def test_a_failed_replacement_leaves_neither_the_old_output_nor_a_record(tmp_path, capsys, two_checkpoints,
                                                                          monkeypatch, cheap_network):
    """A run made otherwise (another overlap) fails to write its segmentation: exit code 1, the
    first run's segmentation and record are gone (never shown as the second one's), no temporary
    file left."""
    import runtime.predict.scan as scan_module

    first, second = two_checkpoints
    folder = scan_folder(tmp_path / "in")
    out = tmp_path / "out"
    assert predict(capsys, folder, out, first)[0] == 0

    def no_space(path, labels, reference):
        raise OSError(28, os.strerror(28), path)

    monkeypatch.setattr(scan_module, "write_segmentation", no_space)
    code, _, stderr = predict(capsys, folder, out, first, "--overlap", "0.25")
    assert code == 1 and "scan.nii.gz" in stderr
    assert sorted(os.listdir(out)) == ["summary.csv", "summary.jsonl"]
    assert rows(out)["scan"]["status"] == "failed"


def test_the_record_takes_its_place_only_after_the_segmentation(tmp_path, capsys, two_checkpoints, monkeypatch,
                                                                 cheap_network):
    """While the segmentation is written, no record names it (the earlier one is gone, the new
    one still under its temporary name)."""
    import data_loading.scans
    import runtime.predict.scan as scan_module

    first, _ = two_checkpoints
    out = tmp_path / "out"
    seen = []
    original = data_loading.scans.write_segmentation

    def look_then_write(path, labels, reference):
        seen.append(os.path.exists(out / "scan.provenance.json"))
        original(path, labels, reference)

    monkeypatch.setattr(scan_module, "write_segmentation", look_then_write)
    folder = scan_folder(tmp_path / "in")
    assert predict(capsys, folder, out, first)[0] == 0
    assert predict(capsys, folder, out, first, "--force")[0] == 0
    assert seen == [False, False] and os.path.exists(out / "scan.provenance.json")


def test_the_input_digest_covers_every_file_of_the_scan(tmp_path):
    """One file: its sha256 (what sha256sum prints). A MetaImage header and its data file: the
    name and bytes of each, in order; a change in the data file alone changes it."""
    from data_loading.scan_io import input_digest

    nifti = write_nifti(str(tmp_path / "one.nii.gz"), np.zeros((4, 3, 2), np.int16), SPACING)
    assert input_digest(nifti) == hashlib.sha256(open(nifti, "rb").read()).hexdigest()
    header = tmp_path / "scan.mhd"
    header.write_text("ObjectType = Image\nNDims = 3\nDimSize = 2 3 4\nElementType = MET_SHORT\n"
                      "ElementSpacing = 1.2 1.2 1.6\nElementDataFile = scan.raw\n")
    (tmp_path / "scan.raw").write_bytes(bytes(48))
    expected = hashlib.sha256(b"scan.mhd\0" + header.read_bytes() + b"scan.raw\0" + bytes(48)).hexdigest()
    assert input_digest(str(header)) == expected
    (tmp_path / "scan.raw").write_bytes(bytes(47) + b"\1")
    assert input_digest(str(header)) != expected


# ----------------------------------------------------------------------------- KiTS19's scores


def test_kits_scores_on_hand_built_label_volumes():
    """Ten voxels. Label 1: prediction {0,1,2,4}, truth {0,1,2,3}: 2*3/(4+4) = 0.75. Label 2:
    prediction {5,6}, truth {4,5}: 2*1/(2+2) = 0.5. KiTS19's Kidney (1 and 2 as one):
    prediction {0,1,2,4,5,6}, truth {0,...,5}: 2*5/(6+6) = 5/6. Tumour: label 2, 0.5."""
    truth = np.array([1, 1, 1, 1, 2, 2, 0, 0, 0, 0], np.uint8).reshape(2, 5, 1)
    prediction = np.array([1, 1, 1, 0, 1, 2, 2, 0, 0, 0], np.uint8).reshape(2, 5, 1)
    result = CaseResult("case", "segmented", "image.nii.gz", (2, 5, 1), SPACING, 0.0, 0.0)
    result.score(prediction, truth)
    assert result.l1_dice == pytest.approx(0.75)
    assert result.l2_dice == pytest.approx(0.5)
    assert result.mean_dice == pytest.approx(0.625)
    assert result.kits_kidney_dice == pytest.approx(5 / 6)
    assert result.kits_tumour_dice == pytest.approx(0.5)
    other = CaseResult("other", "segmented", "other.nii.gz", (2, 5, 1), SPACING, 0.0, 0.0)
    other.score(truth, truth)  # perfect: every score 1
    table = list(csv.DictReader(summary_texts([result, other])["summary.csv"].splitlines()))
    assert [row["case"] for row in table] == ["case", "other", "count", "mean"]
    assert float(table[0]["kits_kidney_dice"]) == pytest.approx(5 / 6, rel=1e-5)
    assert float(table[3]["kits_kidney_dice"]) == pytest.approx((5 / 6 + 1) / 2, rel=1e-5)
    assert float(table[3]["l1_dice"]) == pytest.approx(0.875, rel=1e-5)
    assert table[2]["l1_dice"] == "2"  # the scans behind each mean


def test_kits_scores_of_a_segmented_scan_against_its_ground_truth(tmp_path):
    """Through the whole way (read, preprocess, window, back to the scan's grid, write): the
    summary's scores equal the Dice computed here from the written segmentation and the truth."""
    from runtime.predict.scan import segment_scan
    from segmenters import segmenter

    write_case(str(tmp_path / "raw"), "case_00003", (40, 52, 47), (2.3, 1.5, 0.95))
    scan = find_scans(str(tmp_path / "raw"))[0]
    result = segment_scan(scan, segmenter(ground_truth_oracle(scan)), str(tmp_path))
    labels = labels_of(tmp_path / "case_00003.nii.gz")
    truth = labels_of(scan.label_path)

    def dice(a, b):
        return 2 * np.count_nonzero(a & b) / (np.count_nonzero(a) + np.count_nonzero(b))

    assert np.count_nonzero(labels == 1) and np.count_nonzero(labels == 2)
    assert result.kits_kidney_dice == pytest.approx(dice(labels > 0, truth > 0), abs=1e-6)
    assert result.kits_tumour_dice == pytest.approx(dice(labels == 2, truth == 2), abs=1e-6)
    assert result.l1_dice == pytest.approx(dice(labels == 1, truth == 1), abs=1e-6)
    assert result.l2_dice == result.kits_tumour_dice
