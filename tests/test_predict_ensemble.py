"""Predict's saved probabilities, ensembles of checkpoints, and the Python entry point.

- ``--save_probabilities``: ``<case>.npz`` (key ``probabilities``, float16, (3, *the file's own
  array shape)) beside the segmentation, whose argmax is the segmentation (except where float16
  rounding ties two classes), for a scan in another orientation and at another spacing.
- Ensembles: a checkpoint with itself gives exactly the single checkpoint's outputs; two
  checkpoints give the mean of their probabilities, computed here with torch from each one's
  own run (with and without TTA); another network or another training window is one line
  naming both checkpoints; evaluate and train take one checkpoint; the record lists every
  checkpoint's digest, so an ensemble's output is never reused for a single checkpoint's.
- :class:`runtime.predict.api.Segmenter`: arrays in the KiTS19 layout and in RAS (reoriented by
  nibabel) give the same labels once mapped back, equal to the command line's outputs; the
  command line segments through it.

The network is a stand-in whose logits depend on the loaded checkpoint's weights and on the
voxel's position (so that TTA's flips matter); the real network runs in one test on a 1-window
scan (an ensemble of a checkpoint with itself).
"""
import dataclasses
import json
import os

import nibabel
import numpy as np
import pytest
import torch

from checkpoints import architecture, write_checkpoint
from main_runs import predict_runner, run_main
from test_predict import write_nifti

SMALL = (2, 4, 4, 8, 8)


def checkpoint(path, seed=0, patch=(64, 64, 64), filters=SMALL, **changes):
    config = dataclasses.replace(architecture(filters), input_shape=tuple(patch), **changes)
    write_checkpoint(str(path), config, seed=seed)
    return str(path)


class StandIn(torch.nn.Module):
    """Logits from the intensity and the position along the first two window axes, with
    coefficients from the checkpoint's weights (a 128³ pass of even a tiny U-Net takes seconds)."""

    def __init__(self, model):
        super().__init__()
        params = [float(p.detach().double().sum()) for p in model.parameters()]
        self.a, self.b, self.c = 1 + abs(params[0]), params[1] * 3, 0.5 + abs(params[2])

    def forward(self, x):
        d = torch.linspace(-1, 1, x.shape[2])[None, :, None, None]
        h = torch.linspace(-1, 1, x.shape[3])[None, None, :, None]
        out = torch.zeros(x.shape[0], 3, *x.shape[2:])
        out[:, 1] = self.a * x[:, 0] + self.b * d
        out[:, 2] = self.c * x[:, 0] - 1 + h
        return out


@pytest.fixture
def stand_in(monkeypatch):
    """The windows from :class:`StandIn` through the real window predictor (its TTA included):
    every backend of the registry converts the network to it."""
    from runtime.inference.backends import BACKENDS

    for name, backend in list(BACKENDS.items()):
        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(backend, convert=lambda model, *args: StandIn(model)))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    patch = (128, 128, 128)  # one window per scan
    return checkpoint(root / "a.pt", seed=0, patch=patch), checkpoint(root / "b.pt", seed=1, patch=patch)


def ras_scan(folder, name="scan", shape=(26, 22, 18), spacing=(0.9, 0.8, 2.5), seed=0):
    """A scan with its slices last (R-A-S), not at the target spacing: moved and resampled."""
    os.makedirs(str(folder), exist_ok=True)
    image = np.random.default_rng(seed).integers(-150, 300, shape).astype(np.int16)
    image[8:16, 6:14, 4:12] += 200
    path = os.path.join(str(folder), f"{name}.nii.gz")
    nibabel.save(nibabel.Nifti1Image(image, np.diag([*spacing, 1.0])), path)
    return path


predict = predict_runner("--device", "cpu")


def saved(out, case="scan") -> np.ndarray:
    with np.load(os.path.join(str(out), f"{case}.npz")) as data:
        assert list(data.keys()) == ["probabilities"]
        return data["probabilities"]


def labels(out, case="scan") -> np.ndarray:
    return np.asarray(nibabel.load(os.path.join(str(out), f"{case}.nii.gz")).dataobj)


def record(out, case="scan") -> dict:
    with open(os.path.join(str(out), f"{case}.provenance.json")) as handle:
        return json.load(handle)


def file_bytes(out, case="scan", suffix=".nii.gz") -> bytes:
    with open(os.path.join(str(out), case + suffix), "rb") as handle:
        return handle.read()


# ----------------------------------------------------------------------------- probabilities


def test_saved_probabilities_are_the_segmentations(tmp_path, capsys, two, stand_in):
    ras_scan(tmp_path / "in")
    code, stdout, stderr = predict(capsys, tmp_path / "in", tmp_path / "out", two[:1], "--save_probabilities")
    assert code == 0, stderr
    probabilities, segmentation = saved(tmp_path / "out"), labels(tmp_path / "out")
    assert probabilities.dtype == np.float16 and probabilities.shape == (3, 26, 22, 18)
    np.testing.assert_allclose(probabilities.astype(np.float32).sum(0), 1, atol=3e-3)
    top = np.sort(probabilities, axis=0)
    untied = top[-1] > top[-2]  # float16 rounding may tie two classes; argmax then takes the lower
    assert untied.mean() > 0.99
    assert np.array_equal(probabilities.argmax(0)[untied], segmentation[untied])
    assert set(np.unique(segmentation)) >= {0, 1}  # not a trivial answer
    assert record(tmp_path / "out")["probabilities"] == "scan.npz"
    assert not [f for f in os.listdir(tmp_path / "out") if f.startswith(".")]  # atomic: no temporary left
    # the same segmentation as without --save_probabilities, byte for byte
    code, _, _ = predict(capsys, tmp_path / "in", tmp_path / "plain", two[:1])
    assert code == 0 and file_bytes(tmp_path / "plain") == file_bytes(tmp_path / "out")
    assert not os.path.exists(tmp_path / "plain" / "scan.npz")
    # asking for probabilities where none were saved segments again; then they are reused
    code, stdout, _ = predict(capsys, tmp_path / "in", tmp_path / "plain", two[:1], "--save_probabilities")
    assert code == 0 and "replaced an earlier output without saved probabilities" in stdout
    assert np.array_equal(saved(tmp_path / "plain"), probabilities)
    code, stdout, _ = predict(capsys, tmp_path / "in", tmp_path / "plain", two[:1], "--save_probabilities")
    assert code == 0 and "1 skipped" in stdout


# ----------------------------------------------------------------------------- ensembles


def test_an_ensemble_of_a_checkpoint_with_itself_is_that_checkpoint(tmp_path, capsys, two, stand_in):
    ras_scan(tmp_path / "in")
    a = two[0]
    assert predict(capsys, tmp_path / "in", tmp_path / "one", [a], "--save_probabilities")[0] == 0
    code, stdout, stderr = predict(capsys, tmp_path / "in", tmp_path / "self", [a, a], "--save_probabilities")
    assert code == 0, stderr
    assert file_bytes(tmp_path / "self") == file_bytes(tmp_path / "one")
    assert np.array_equal(saved(tmp_path / "self"), saved(tmp_path / "one"))
    single, ensemble = record(tmp_path / "one"), record(tmp_path / "self")
    assert ensemble["weights_sha256"] == [single["weights_sha256"]] * 2
    assert ensemble["checkpoint"] == [single["checkpoint"]] * 2
    import csv
    row = next(csv.DictReader(open(tmp_path / "self" / "summary.csv")))
    assert row["weights_sha256"] == f"{single['weights_sha256']} {single['weights_sha256']}"
    assert row["probabilities"] == "scan.npz"
    # an ensemble's output is not taken for the single checkpoint's, nor the other way round: it
    # is another model's, kept (exit 1) unless --force replaces it
    code, stdout, stderr = predict(capsys, tmp_path / "in", tmp_path / "self", [a])
    assert code == 1 and "1 kept" in stdout and "made by another model" in stderr
    code, stdout, _ = predict(capsys, tmp_path / "in", tmp_path / "self", [a], "--force")
    assert code == 0 and "replaced an earlier output of another model" in stdout


@pytest.mark.parametrize("tta", [False, True], ids=["softmax", "tta"])
def test_an_ensemble_averages_its_checkpoints_probabilities(tmp_path, capsys, two, stand_in, tta):
    """Oracle: each checkpoint's own run, averaged here with torch (float16 files: within
    their rounding); TTA composes: the mean over checkpoints of each one's TTA mean."""
    ras_scan(tmp_path / "in")
    flags = ["--save_probabilities"] + (["--tta"] if tta else [])
    runs = {}
    for name, checkpoints in (("a", two[:1]), ("b", two[1:]), ("ab", two)):
        code, _, stderr = predict(capsys, tmp_path / "in", tmp_path / name, checkpoints, *flags)
        assert code == 0, stderr
        runs[name] = torch.from_numpy(saved(tmp_path / name).astype(np.float32))
    mean = (runs["a"] + runs["b"]) / 2
    assert (runs["a"] - runs["b"]).abs().max() > 0.05  # two different networks
    torch.testing.assert_close(runs["ab"], mean, atol=2e-3, rtol=0)
    clear = (mean.sort(0).values[-1] - mean.sort(0).values[-2]) > 5e-3
    assert torch.equal(torch.from_numpy(labels(tmp_path / "ab").astype(np.int64))[clear], mean.argmax(0)[clear])
    assert record(tmp_path / "ab")["weights_sha256"] == [record(tmp_path / "a")["weights_sha256"],
                                                         record(tmp_path / "b")["weights_sha256"]]


def test_an_ensemble_of_different_networks_or_windows_is_one_line(tmp_path, capsys):
    ras_scan(tmp_path / "in")
    a = checkpoint(tmp_path / "a.pt")  # (64³ patches; the architecture is checked before the window)
    wider = checkpoint(tmp_path / "wider.pt", filters=(4, 4, 8, 8, 8))
    batchnorm = checkpoint(tmp_path / "bn.pt", normalization="batchnorm")
    patch32 = checkpoint(tmp_path / "p32.pt", patch=(32, 32, 32))
    for other, why in ((wider, "different networks (--filters 4 4 8 8 8 in"),
                       (batchnorm, "different networks (--normalization batchnorm in"),
                       (patch32, "different windows (32x32x32 patches in")):
        code, stdout, stderr = predict(capsys, tmp_path / "in", tmp_path / "out", [a, other])
        assert code != 0
        assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
        assert "--load_ckpt_path" in stderr and why in stderr and a in stderr and other in stderr, stderr
        assert not os.path.exists(tmp_path / "out" / "scan.nii.gz")


def test_evaluate_and_train_take_one_checkpoint(tmp_path, capsys):
    from runtime.arguments import parse_args

    a = checkpoint(tmp_path / "a.pt")
    for mode in ("evaluate", "train"):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(["--exec_mode", mode, "--data_dir", str(tmp_path), "--load_ckpt_path", a, a])
        assert exit_info.value.code == 2
        stderr = capsys.readouterr().err
        assert stderr.count("\n") == 1 and f"--load_ckpt_path takes one checkpoint for --exec_mode {mode}" in stderr
    config = parse_args(["--exec_mode", "evaluate", "--data_dir", str(tmp_path), "--load_ckpt_path", a])
    assert config.load_ckpt_path == a and config.checkpoints == (a,)
    config = parse_args(["--exec_mode", "predict", "--input", str(tmp_path), "--output_dir", str(tmp_path / "o"),
                         "--load_ckpt_path", a, a])
    assert config.load_ckpt_path == a and config.checkpoints == (a, a)


def test_several_checkpoints_for_evaluate_is_one_line_naming_the_flag(tmp_path, capsys):
    a = checkpoint(tmp_path / "a.pt")
    code, _, stderr = run_main(capsys, "--exec_mode", "evaluate", "--data_dir", str(tmp_path),
                               "--load_ckpt_path", a, a)
    assert code == 2 and stderr.count("\n") == 1
    assert "--load_ckpt_path takes one checkpoint for --exec_mode evaluate" in stderr


def test_the_real_network_ensembled_with_itself(tmp_path, capsys):
    """The tiny U-Net itself (one 128³ window): the ensemble of a checkpoint with itself writes
    the single checkpoint's segmentation byte for byte, and its probabilities."""
    a = checkpoint(tmp_path / "a.pt", patch=(128, 128, 128))
    write_nifti(str(tmp_path / "in" / "scan.nii.gz"),
                np.random.default_rng(0).integers(-100, 300, (20, 24, 22)).astype(np.int16), (1.6, 1.2, 1.2))
    assert predict(capsys, tmp_path / "in", tmp_path / "one", [a], "--save_probabilities")[0] == 0
    assert predict(capsys, tmp_path / "in", tmp_path / "two", [a, a], "--save_probabilities")[0] == 0
    assert file_bytes(tmp_path / "two") == file_bytes(tmp_path / "one")
    assert np.array_equal(saved(tmp_path / "two"), saved(tmp_path / "one"))


# ----------------------------------------------------------------------------- the Python entry point


def test_segmenter_arrays_in_any_layout_give_the_command_lines_labels(tmp_path, capsys, two, stand_in):
    """Known answers from the command line's outputs; nibabel's own reorientation as the oracle
    of the RAS -> KiTS19 mapping."""
    from runtime.predict.api import PredictOptions, Segmenter

    path = ras_scan(tmp_path / "in")
    code, _, stderr = predict(capsys, tmp_path / "in", tmp_path / "out", two, "--save_probabilities")
    assert code == 0, stderr
    cli_labels, cli_probabilities = labels(tmp_path / "out"), saved(tmp_path / "out")

    segmenter = Segmenter.from_checkpoint(two, PredictOptions(device="cpu", verbose=False))
    assert segmenter.plan.inference.window == (128, 128, 128)  # the checkpoints' window, as the CLI's
    ras = nibabel.load(path)
    array = np.asarray(ras.dataobj)
    got, probabilities = segmenter.segment_array(array, ras.affine, probabilities=True)
    assert got.shape == array.shape and got.dtype == np.uint8
    assert np.array_equal(got, cli_labels)
    assert np.array_equal(probabilities.astype(np.float16), cli_probabilities)

    kits = ras.as_reoriented(nibabel.orientations.axcodes2ornt(("I", "P", "L")))  # the KiTS19 layout
    kits_labels, none = segmenter.segment_array(np.asarray(kits.dataobj), kits.affine)
    assert none is None
    to_ras = nibabel.orientations.ornt_transform(nibabel.io_orientation(kits.affine), nibabel.io_orientation(ras.affine))
    back = nibabel.Nifti1Image(kits_labels, kits.affine).as_reoriented(to_ras)
    assert np.allclose(back.affine, ras.affine)
    assert np.array_equal(np.asarray(back.dataobj), cli_labels)

    result = segmenter.segment_file(path)
    assert np.array_equal(result.labels, cli_labels) and np.allclose(result.affine, ras.affine)
    assert result.probabilities is None and result.windows == 2  # one window per checkpoint


def test_the_command_line_segments_through_the_segmenter(tmp_path, capsys, two, stand_in, monkeypatch):
    from runtime.predict.api import Segmenter

    calls = []
    original = Segmenter.segment_raw

    def spy(self, raw, *args, **kwargs):
        calls.append(raw.image.shape)
        return original(self, raw, *args, **kwargs)

    monkeypatch.setattr(Segmenter, "segment_raw", spy)
    ras_scan(tmp_path / "in")
    assert predict(capsys, tmp_path / "in", tmp_path / "out", two[:1])[0] == 0
    assert len(calls) == 1


def test_segmenter_bad_array_is_one_line():
    """A network built already (:meth:`Segmenter.from_network`): no checkpoint needed."""
    from data_loading.scan_io import ScanError
    from runtime.predict.api import PredictOptions, Segmenter

    segmenter = Segmenter.from_network(torch.nn.Conv3d(1, 3, 1), PredictOptions(device="cpu", verbose=False))
    with pytest.raises(ScanError, match="array: 2 dimensions"):
        segmenter.segment_array(np.zeros((4, 4)), np.eye(4))
    sheared = np.eye(4)
    sheared[0, 1] = 0.5
    with pytest.raises(ScanError, match="array"):
        segmenter.segment_array(np.zeros((8, 8, 8)), sheared)


@pytest.mark.parametrize("options, flags", [
    ({"window": (128, 128, 100)}, ["--val_input_shape", "128", "128", "100"]),
    ({"window": (128, 128)}, ["--val_input_shape", "128", "128"]),
    ({"overlap": 1.0}, ["--overlap", "1.0"]),
    ({"int8": True, "amp": True}, ["--int8", "--amp"]),
    ({"int8_calibration": "{scans}"}, ["--int8_calibration", "{scans}"]),
    ({"int8": True, "int8_calibration": "{missing}"}, ["--int8", "--int8_calibration", "{missing}"]),
])
def test_predict_options_are_checked_when_made_in_the_flags_words(tmp_path, options, flags):
    """Oracle: the command line's own check of the same value (runtime.arguments.validate) gives
    the one line PredictOptions raises, when the options are made, before any checkpoint."""
    from runtime.arguments import UsageError, build_parser, config_from_namespace, explicit_flags, validate
    from runtime.predict.api import PredictOptions

    fill = {"scans": str(tmp_path), "missing": str(tmp_path / "nowhere")}
    options = {k: v.format(**fill) if isinstance(v, str) else v for k, v in options.items()}
    checkpoint = tmp_path / "a.pt"
    checkpoint.write_bytes(b"")
    argv = ["--exec_mode", "predict", "--input", str(tmp_path), "--output_dir", str(tmp_path / "o"),
            "--load_ckpt_path", str(checkpoint), *(f.format(**fill) for f in flags)]
    parser = build_parser()
    expected = validate(config_from_namespace(parser.parse_args(argv), explicit_flags(argv, parser)))
    assert len(expected) == 1
    with pytest.raises(UsageError) as raised:
        PredictOptions(device="cpu", **options)
    assert str(raised.value) == expected[0]


@pytest.mark.parametrize("options, said", [({"device": "gpu"}, "--device must be one of auto, cpu, cuda, got 'gpu'"),
                                           ({"backend": "onnx"}, "--backend must be one of auto, torch, openvino"),
                                           ({"sw_batch_size": 0}, "--sw_batch_size must be >= 1, got 0")])
def test_predict_options_refuse_what_the_parser_refuses(options, said):
    from runtime.arguments import UsageError
    from runtime.predict.api import PredictOptions

    with pytest.raises(UsageError, match=said):
        PredictOptions(**options)


def test_a_missing_checkpoint_is_the_flags_one_line(tmp_path):
    from runtime.arguments import UsageError, checkpoint_path_problem
    from runtime.predict.api import PredictOptions, Segmenter

    with pytest.raises(UsageError) as raised:
        Segmenter.from_checkpoint(tmp_path / "none.pt", PredictOptions(device="cpu", verbose=False))
    assert str(raised.value) == checkpoint_path_problem(str(tmp_path / "none.pt"), "--load_ckpt_path")
