"""``--int8``: a scan's result can be reproduced from that scan alone (calibrated on each scan
alone by default, or once on the scans ``--int8_calibration`` names, which the record keeps; the
result line says which), and OpenVINO's converted networks go to a cache folder, never beside the
checkpoint or an input.

OpenVINO itself is not needed here: a stand-in for its int8 window predictor records the
calibration set it is given and, like int8, gives labels that depend on that set (its
threshold moves with the set's digest). tests/test_openvino.py runs the real one.
"""
import dataclasses
import os
from types import SimpleNamespace

import nibabel
import numpy as np
import pytest
import torch

from runtime.arguments import parse_args
from test_predict_provenance import SMALL, labels_of, predict, record, scan_folder, trained_on


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return trained_on(tmp_path_factory.mktemp("ckpt") / "a.pt", (128,) * 3, filters=SMALL, normalization="batchnorm")


@pytest.fixture
def int8_stand_in(monkeypatch):
    """OpenVINO "installed"; its int8 window predictor replaced: logits whose labels depend on
    the calibration set. Returns the calibration sets it was built with (their scans' names)."""
    from runtime.inference import backends

    monkeypatch.setattr(backends, "openvino_missing", lambda int8=False: None)
    monkeypatch.setattr(backends, "_openvino_version", lambda: "stand-in")
    built = []

    def convert(model, network, precision, inference, say=print, calibration=None, checkpoint=""):
        assert inference.backend == "openvino" and calibration is not None
        built.append([scan.name for scan in calibration.scans])
        shift = int(calibration.digest()[:8], 16) / 16 ** 8  # in [0, 1): the set moves the labels

        def logits(batch):
            out = torch.zeros(batch.shape[0], 3, *batch.shape[2:])
            out[:, 1] = batch[:, 0] - shift
            return out

        return logits

    monkeypatch.setitem(backends.BACKENDS, "openvino", dataclasses.replace(backends.BACKENDS["openvino"], convert=convert))
    return built


def test_each_scan_is_calibrated_on_alone_and_reproduced_from_itself(tmp_path, capsys, checkpoint, int8_stand_in):
    folder = scan_folder(tmp_path / "in", ("s0", "s1"))
    code, stdout, stderr = predict(capsys, folder, tmp_path / "folder", checkpoint, "--int8")
    assert code == 0, stderr
    assert "int8 (NNCF post-training quantisation, calibrated on each scan alone)" in stdout
    assert int8_stand_in == [["s0"], ["s1"]]
    lines = [line for line in stdout.splitlines() if line.startswith(("s0:", "s1:"))]
    assert len(lines) == 2 and all(line.endswith("int8 calibrated on this scan alone") for line in lines), lines
    made = {name: record(tmp_path / "folder", name) for name in ("s0", "s1")}
    assert all(r["int8_calibration_set"] == "this scan" and r["int8"] for r in made.values())
    assert made["s0"]["int8_calibration"] != made["s1"]["int8_calibration"]
    # s0 alone, as a single file: the same calibration, the same labels
    code, _, stderr = predict(capsys, os.path.join(folder, "s0.nii.gz"), tmp_path / "alone", checkpoint, "--int8")
    assert code == 0, stderr
    assert record(tmp_path / "alone", "s0")["int8_calibration"] == made["s0"]["int8_calibration"]
    assert np.array_equal(labels_of(tmp_path / "alone" / "s0.nii.gz"), labels_of(tmp_path / "folder" / "s0.nii.gz"))
    # the Python entry point on the file: the same calibration
    from runtime.predict.api import PredictOptions, Segmenter

    segmenter = Segmenter.from_checkpoint(checkpoint, PredictOptions(device="cpu", int8=True, verbose=False))
    labels = segmenter.segment_file(os.path.join(folder, "s0.nii.gz")).labels
    assert segmenter.calibration.digest() == made["s0"]["int8_calibration"]
    assert np.array_equal(labels, labels_of(tmp_path / "folder" / "s0.nii.gz"))
    # again: reused, nothing calibrated
    del int8_stand_in[:]
    code, stdout, _ = predict(capsys, folder, tmp_path / "folder", checkpoint, "--int8")
    assert code == 0 and "0 segmented, 2 skipped" in stdout and int8_stand_in == []


def test_a_named_calibration_set_is_used_once_and_recorded(tmp_path, capsys, checkpoint, int8_stand_in):
    folder = scan_folder(tmp_path / "in", ("s0", "s1"))
    chosen = scan_folder(tmp_path / "calibration", ("c0", "c1"))
    code, stdout, stderr = predict(capsys, folder, tmp_path / "out", checkpoint, "--int8", "--int8_calibration", chosen)
    assert code == 0, stderr
    assert f"calibrated once on --int8_calibration {chosen}" in stdout
    assert int8_stand_in == [["c0", "c1"]]
    made = [record(tmp_path / "out", name) for name in ("s0", "s1")]
    assert made[0]["int8_calibration"] == made[1]["int8_calibration"]
    assert all(r["int8_calibration_set"] == os.path.abspath(chosen) for r in made)
    assert f"int8 calibrated on {os.path.abspath(chosen)} ({made[0]['int8_calibration'][:12]})" in stdout
    # the per-scan default into the same folder is another calibration: segmented again
    code, stdout, _ = predict(capsys, folder, tmp_path / "out", checkpoint, "--int8")
    assert code == 0 and "2 segmented" in stdout and "made with int8_calibration" in stdout


@pytest.mark.parametrize("flags, named", [
    (["--int8_calibration", "{scans}"], "--int8_calibration names the scans --int8 calibrates on"),
    (["--int8", "--int8_calibration", "{missing}"], "does not exist"),
])
def test_int8_calibration_flag_checks(tmp_path, capsys, checkpoint, flags, named):
    folder = scan_folder(tmp_path / "in")
    flags = [f.format(scans=folder, missing=str(tmp_path / "nowhere")) for f in flags]
    code, _, stderr = predict(capsys, folder, tmp_path / "out", checkpoint, *flags)
    assert code == 2 and stderr.count("\n") == 1 and named in stderr, stderr


def test_openvino_cache_goes_to_the_cache_folder_never_beside_the_checkpoint(tmp_path, monkeypatch):
    from runtime.inference.openvino.cache import cache_folder
    from runtime.resolve import decide_cache_dir

    def with_cache_dir(config):  # the cache folder a run of these flags is planned with
        return SimpleNamespace(cache_dir=decide_cache_dir(config.cache_dir, config.mode.chooses_backend).value)

    checkpoint = str(tmp_path / "models" / "a.pt")
    os.makedirs(tmp_path / "models")
    open(checkpoint, "wb").close()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    argv = ["--exec_mode", "predict", "--input", str(tmp_path), "--output_dir", str(tmp_path / "o"),
            "--load_ckpt_path", checkpoint]
    resolved = with_cache_dir(parse_args(argv))
    assert resolved.cache_dir == str(tmp_path / "xdg" / "unet3d-kits19")
    folder = cache_folder(checkpoint, resolved.cache_dir)
    assert folder.startswith(str(tmp_path / "xdg" / "unet3d-kits19" / "openvino") + os.sep)
    assert not folder.startswith(str(tmp_path / "models")) and os.path.basename(folder).startswith("a.pt-")
    assert cache_folder(str(tmp_path / "other" / "a.pt"), resolved.cache_dir) != folder  # one per checkpoint file
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert with_cache_dir(parse_args(argv)).cache_dir == str(tmp_path / "home" / ".cache" / "unet3d-kits19")
    given = with_cache_dir(parse_args(argv + ["--cache_dir", "rel"]))
    assert given.cache_dir == os.path.abspath("rel")


def test_the_calibration_policy_is_the_plans_decision(tmp_path, checkpoint, int8_stand_in):
    """The Segmenter's policy follows resolve()'s decision "calibration": none without --int8,
    each scan's own (made when the scan comes, "this scan" in the record), or the named set,
    read once when the policy is made (the stand-in is built on it at once)."""
    from runtime.distributed import DistInfo
    from runtime.predict.calibration import FixedCalibration, NoCalibration, PerScanCalibration, calibration_policy
    from runtime.resolve import resolve
    from runtime.checkpoint import saved_for

    folder = scan_folder(tmp_path / "in", ("s0", "s1"))
    chosen = scan_folder(tmp_path / "calibration", ("c0", "c1"))
    dist = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))

    def policy(*flags):
        config = parse_args(["--exec_mode", "predict", "--input", folder, "--output_dir", str(tmp_path / "o"),
                             "--load_ckpt_path", checkpoint, *flags])
        return calibration_policy(resolve(config, dist, None, saved_for(config)))

    assert isinstance(policy(), NoCalibration) and policy().set_for("s0", os.path.join(folder, "s0.nii.gz")) is None
    each = policy("--int8")
    assert isinstance(each, PerScanCalibration) and each.per_scan and each.source == "this scan"
    assert int8_stand_in == []  # nothing calibrated before a scan comes
    s0 = os.path.join(folder, "s0.nii.gz")
    assert [scan.name for scan in each.set_for("s0", s0).scans] == ["s0"]
    named = policy("--int8", "--int8_calibration", chosen)
    assert isinstance(named, FixedCalibration) and not named.per_scan and named.source == os.path.abspath(chosen)
    assert named.set_for("s0", s0) is named.set_for(None, None)
    assert [scan.name for scan in named.set_for(None, None).scans] == ["c0", "c1"]


def test_an_int8_segmenter_is_whole_and_never_segments_with_another_scans_calibration(tmp_path, checkpoint,
                                                                                        int8_stand_in):
    """Each scan alone: a file is segmented on its own set; an array, which is no scan, is refused
    in one line before any work, also after a file (never with that file's set). A named set:
    built when the segmenter is made, used for arrays and files alike."""
    from runtime.arguments import UsageError
    from runtime.predict.api import PredictOptions, Segmenter

    folder = scan_folder(tmp_path / "in", ("s0", "s1"))
    image = nibabel.load(os.path.join(folder, "s1.nii.gz"))
    segmenter = Segmenter.from_checkpoint(checkpoint, PredictOptions(device="cpu", int8=True, verbose=False))
    assert int8_stand_in == []
    segmenter.segment_file(os.path.join(folder, "s0.nii.gz"))
    assert int8_stand_in == [["s0"]]
    with pytest.raises(UsageError, match="calibrates on each scan alone") as refused:
        segmenter.segment_array(np.asarray(image.dataobj), image.affine, spacing=(1.0, 1.0, 1.0))
    assert "\n" not in str(refused.value) and int8_stand_in == [["s0"]]

    named = Segmenter.from_checkpoint(checkpoint, PredictOptions(device="cpu", int8=True, verbose=False,
                                                                 int8_calibration=folder))
    assert int8_stand_in == [["s0"], ["s0", "s1"]]  # built whole when made
    labels, _ = named.segment_array(np.asarray(image.dataobj), image.affine, spacing=(1.0, 1.0, 1.0))
    named.segment_file(os.path.join(folder, "s0.nii.gz"))
    assert labels.shape == image.shape and int8_stand_in == [["s0"], ["s0", "s1"]]
    assert [scan.name for scan in named.calibration.scans] == ["s0", "s1"]
