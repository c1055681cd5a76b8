"""The OpenVINO backend of predict and evaluate (``--backend``), its cache, int8 calibration, and
the window batch bounded by memory.

Known answers: a pointwise network (1x1x1 convolution) through the sliding window gives the
network applied to the whole volume, with OpenVINO as with PyTorch; a tiny UNet3D converted
by OpenVINO gives PyTorch's logits up to float32 rounding; a cache entry is never used for
other weights, even when the checkpoint keeps its size and time stamp. Tests that need
OpenVINO skip with the reason when it is not installed (``make test-openvino`` installs it);
the missing-OpenVINO line and the flag checks run everywhere.
"""
import dataclasses
import json
import os
import re
import subprocess
import sys

import nibabel
import numpy as np
import pytest
import torch
from torch import nn

from checkpoints import architecture, flags_plan, write_checkpoint
from model.unet3d import Unet3D
from runtime.arguments import UsageError, parse_args, replace
from runtime.inference import memory_budget
from runtime.config import PredictOptions
from runtime.inference.backends import INSTALL_HINT, openvino_missing
from runtime.inference.backends import decide_backend as decide_backend_of
from runtime.inference.openvino.calibration import grid_origins, spread, window_at
from runtime.inference.predictor import build_predictor, options_from
from runtime.levers.cpu.isa import int8_pairs_saturate
from runtime.predict.scan import volume_probabilities

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = (4, 8, 16, 32, 32)
CPU = torch.device("cpu")
needs_openvino = pytest.mark.skipif(openvino_missing() is not None, reason=f"{openvino_missing()}")
needs_nncf = pytest.mark.skipif(openvino_missing(int8=True) is not None, reason=f"{openvino_missing(int8=True)}")


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """OpenVINO's converted networks in this test's own cache folder (subprocesses inherit it)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


def overflow_fix() -> str:
    """NNCF's overflow fix as a run on this CPU plans it (runtime.resolve.decide_calibration)."""
    return "enable" if int8_pairs_saturate() else "first_layer"


def predict_config(tmp_path, *flags, roi=(32, 32, 64)):
    return parse_args(["--exec_mode", "predict", "--input", str(tmp_path), "--output_dir", str(tmp_path / "out"),
                       "--load_ckpt_path", __file__, "--val_input_shape", *map(str, roi), "--sw_batch_size", "3",
                       "--filters", *map(str, TINY), *flags])


def decide_backend(config, device):
    """``runtime.inference.backends.decide_backend`` of the parsed flags ``config`` (their options and mode)."""
    return decide_backend_of(PredictOptions.of(config), config.mode, device)


def pointwise_model():
    """A 1x1x1 convolution: each voxel's logits depend on that voxel only."""
    model = nn.Conv3d(1, 3, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([-2.0, 0.5, 3.0]).view(3, 1, 1, 1, 1))
        model.bias.copy_(torch.tensor([0.0, 0.2, -1.0]))
    return model.eval()


def save_tiny(path, seed):
    return write_checkpoint(path, architecture(TINY), seed=seed)


def write_scan(path, seed=3, shape=(26, 30, 28)):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = np.random.default_rng(seed).integers(-100, 300, shape).astype(np.int16)
    image = nibabel.Nifti1Image(data, np.diag([2.0, 1.5, 1.3, 1.0]))
    image.header.set_zooms((2.0, 1.5, 1.3))
    nibabel.save(image, path)
    return path


# ----------------------------------------------------------------------------- without OpenVINO


def test_missing_openvino_is_one_line(tmp_path):
    """OpenVINO made unimportable: --backend openvino is one stderr line with the install
    command, exit code 1, no traceback; --backend auto runs PyTorch and says why."""
    scan = write_scan(str(tmp_path / "in" / "scan.nii.gz"))
    ckpt = str(tmp_path / "tiny.pt")
    save_tiny(ckpt, 0)
    hide = "import sys; sys.modules['openvino'] = None; sys.modules['nncf'] = None; import main; "
    common = ["--exec_mode", "predict", "--input", scan, "--load_ckpt_path", ckpt, "--val_input_shape", "128", "128", "128"]

    def run(*flags):
        code = hide + f"sys.exit(main.main({[*common, *flags]!r}))"
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)

    refused = run("--backend", "openvino", "--output_dir", str(tmp_path / "a"))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip() == f"main.py: error: --backend openvino: OpenVINO is not installed; install it with: {INSTALL_HINT}"
    auto = run("--output_dir", str(tmp_path / "b"))
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert "backend: --backend auto: PyTorch (OpenVINO is not installed" in auto.stdout
    assert os.path.exists(tmp_path / "b" / "scan.nii.gz")


def test_choice_of_backend(tmp_path, monkeypatch):
    """Decided once (resolve): auto is PyTorch for a GPU device or a PyTorch lever, or without
    OpenVINO, else OpenVINO, both fp32; --backend openvino refuses the same cases in one line;
    --int8 is OpenVINO's int8 or a one-line refusal, never PyTorch; torch is torch; training and
    --benchmark are PyTorch."""
    import runtime.inference.backends as backend

    monkeypatch.setattr(backend, "openvino_missing", lambda int8=False: None)
    monkeypatch.setattr(backend, "_openvino_version", lambda: "X")

    def decided(*flags, device=CPU):
        return decide_backend(predict_config(tmp_path, *flags), device)

    assert decided() == ("openvino", "--backend auto: OpenVINO X on the CPU, fp32")
    assert decided("--backend", "torch")[0] == "torch"
    amp, why = decided("--amp")
    assert amp == "torch" and "--amp is a PyTorch lever" in why
    assert decided(device=torch.device("cuda"))[0] == "torch"
    int8, why = decided("--int8")
    assert int8 == "openvino" and "int8 (NNCF" in why
    for flags, message in ((("--backend", "openvino", "--channels_last"), "--backend openvino: --channels_last is a PyTorch lever"),
                           (("--int8", "--channels_last"), "--int8: --channels_last is a PyTorch lever"),
                           (("--int8", "--backend", "torch"), "--int8 is OpenVINO's int8")):
        with pytest.raises(UsageError, match=re.escape(message)):
            decided(*flags)
    monkeypatch.setattr(backend, "openvino_missing", lambda int8=False: "OpenVINO is not installed")
    assert decided()[0] == "torch"
    with pytest.raises(UsageError, match="--int8: OpenVINO is not installed"):
        decided("--int8")
    training, why = decide_backend(parse_args(["--data_dir", str(tmp_path)]), CPU)
    assert training == "torch" and "training and --benchmark run PyTorch" in why


def test_backend_flags_are_checked(tmp_path, capsys):
    for argv, message in [
        (["--exec_mode", "train", "--backend", "openvino"], "training runs PyTorch"),
        (["--exec_mode", "evaluate", "--benchmark", "--backend", "openvino"], "does not apply to --benchmark"),
        (["--exec_mode", "evaluate", "--load_ckpt_path", __file__, "--int8"], "--int8 applies to --exec_mode predict"),
        (["--exec_mode", "evaluate", "--load_ckpt_path", __file__, "--max_memory_gb", "-1"], "--max_memory_gb must be >= 0"),
    ]:
        with pytest.raises(SystemExit) as stop:
            parse_args(["--data_dir", str(tmp_path), *argv])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    # --backend auto (the default) in training is fine: training never asks it
    assert parse_args(["--data_dir", str(tmp_path)]).backend == "auto"


def test_window_batch_bounded_by_memory(tmp_path):
    """The batch is the largest whose estimate fits; an explicit limit that cannot hold one
    window is one line; without a limit the memory available is the limit."""
    config = predict_config(tmp_path, "--sw_batch_size", "4", roi=(128, 128, 128))
    config = replace(config, filters=(32, 64, 128, 256, 320))
    filters, window = config.filters, config.val_input_shape

    def bounded(max_memory_gb, **available):
        return memory_budget.bounded_window_batch(config.sw_batch_size, max_memory_gb, filters, window, "torch",
                                                  lines.append, **available)

    estimate = [memory_budget.estimate_bytes(filters, window, "torch", b) for b in range(1, 5)]
    assert estimate == sorted(estimate) and estimate[0] < estimate[1]
    lines = []
    limit = (estimate[1] + estimate[2]) / 2 / memory_budget.GB
    got = bounded(limit)
    assert got == 2 and "lowered to 2" in lines[0]
    assert bounded(config.max_memory_gb, available=lambda: 1e15) == 4
    assert bounded(config.max_memory_gb, available=lambda: 1e9) == 1
    with pytest.raises(UsageError, match=r"--max_memory_gb 0.5: predict needs about"):
        bounded(0.5)
    # OpenVINO runs one window per request: its estimate does not grow with the batch
    assert (memory_budget.estimate_bytes(filters, window, "openvino", 1)
            == memory_budget.estimate_bytes(filters, window, "openvino", 4))


def test_vnni_detection_and_the_isa_limit():
    assert not int8_pairs_saturate({"avx2", "avx512f", "avx512_vnni"}, {})
    assert int8_pairs_saturate({"avx2", "fma"}, {})
    assert int8_pairs_saturate({"avx2", "avx512_vnni"}, {"ONEDNN_MAX_CPU_ISA": "avx2"})
    assert not int8_pairs_saturate({"avx2", "avx_vnni"}, {"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"})


def test_calibration_windows_where_the_sliding_window_puts_them():
    """Known answers: half-window steps, the last window flush with the volume's end, one padded
    window on an axis shorter than the window; evenly spaced picks from the list of all."""
    assert grid_origins((40, 50, 16), (16, 16, 16)) == [
        (d, h, 0) for d in (0, 8, 16, 24) for h in (0, 8, 16, 24, 32, 34)]
    assert grid_origins((10, 16, 17), (16, 16, 16)) == [(0, 0, 0), (0, 0, 1)]
    assert spread(list(range(10)), 4) == [1, 3, 6, 8]
    assert spread(list(range(3)), 4) == [0, 1, 2]
    assert spread(list(range(100)), 1) == [50]


def test_calibration_set_spreads_over_the_scans_being_predicted(tmp_path, monkeypatch):
    """The set takes at most CALIBRATION_SCANS of the run's scans, evenly spaced, and
    CALIBRATION_WINDOWS windows shared evenly among them, each scan's evenly spaced over its
    half-window grid, cut from the scan as predict preprocesses it; the key names every scan by
    its bytes' sha256; no labels are read."""
    import hashlib

    import runtime.inference.openvino.calibration as calibration
    from data_loading.scans import preprocess_scan, read_scan

    monkeypatch.setattr(calibration, "CALIBRATION_SCANS", 3)
    monkeypatch.setattr(calibration, "CALIBRATION_WINDOWS", 4)
    scans = [(f"s{i}", write_scan(str(tmp_path / "in" / f"s{i}.nii.gz"), seed=i, shape=(20 + 8 * i, 40, 36)))
             for i in range(5)]
    config = predict_config(tmp_path, roi=(32, 32, 32))
    chosen = calibration.scan_calibration(config.val_input_shape, scans, overflow_fix())
    assert [scan.name for scan in chosen.scans] == ["s0", "s2", "s4"]  # spread(5 scans, 3): the middles of 3 parts
    assert [scan.sha256 for scan in chosen.scans] == [
        hashlib.sha256(open(scans[i][1], "rb").read()).hexdigest() for i in (0, 2, 4)]
    assert calibration.shares(4, 3) == [2, 1, 1] and calibration.shares(24, 8) == [3] * 8
    expected = []
    for (name, path), count in zip([scans[i] for i in (0, 2, 4)], (2, 1, 1)):
        image, _ = preprocess_scan(read_scan(path), path)
        expected += [window_at(image, o, (32, 32, 32))[None] for o in spread(grid_origins(image.shape[1:], (32,) * 3), count)]
    windows = chosen.arrays()
    assert len(windows) == 4 and all(w.shape == (1, 1, 32, 32, 32) for w in windows)
    assert all(np.array_equal(w, e) for w, e in zip(windows, expected))
    assert "3 scans (s0, s2, s4)" in chosen.describe()
    # another folder: another set and key
    other = calibration.scan_calibration(config.val_input_shape, scans[:4], overflow_fix())
    assert other.digest() != chosen.digest() and other.fields() != chosen.fields()
    assert calibration.scan_calibration(config.val_input_shape, scans, overflow_fix()).digest() == chosen.digest()
    with pytest.raises(UsageError, match="no"):
        calibration.scan_calibration(config.val_input_shape, [], overflow_fix())


def test_validation_windows_are_where_fp32_sees_organs():
    from runtime.inference.openvino.calibration import validation_windows

    background, organ = np.zeros((4, 4, 4), np.int64), np.ones((4, 4, 4), np.int64)
    assert validation_windows([background, organ, background, organ]) == [1, 3]
    assert validation_windows([background, background]) == [0, 1]  # none: all of them


def test_calibration_windows_are_windows_predict_runs_the_network_on():
    """Oracle: predict's own sliding window (flush_sliding_window_inference, overlap 0.5: its
    strides are half a window). On a volume shorter than the window on two axes, every
    calibration window is one the network is given there (the short axes padded with the edge's
    values, half before), none holds the constant -2.2 the benchmark's evaluation pads with."""
    from runtime.inference.openvino.calibration import calibration_windows
    from runtime.inference.sliding_window import flush_sliding_window_inference

    image = np.random.default_rng(0).normal(size=(1, 40, 50, 21)).astype(np.float32)
    roi = (64, 16, 32)
    seen = []

    def network(batch):
        seen.extend(window.numpy().copy() for window in batch)
        return torch.zeros(batch.shape[0], 3, *batch.shape[2:])

    flush_sliding_window_inference(network, torch.from_numpy(image)[None], roi, 0.5)
    windows = calibration_windows(image, roi, 100)
    assert len(windows) == len(seen) == 6 and all(w.shape == (1, 1, *roi) for w in windows)
    for window in windows:
        assert any(np.array_equal(window[0], s) for s in seen)
        assert not np.any(window == -2.2)
    first = windows[0][0, 0]  # origin 0: 12 slices before the volume's 40, 5 columns before its 21
    assert np.array_equal(first[:12], np.broadcast_to(first[12], (12, 16, 32)))
    assert np.array_equal(windows[0][0, 0, 12:52, :, 5:26], image[0, :, :16, :])
    with pytest.raises(ValueError, match="is not"):
        window_at(image, (0, 0, 0), roi)


# ----------------------------------------------------------------------------- with OpenVINO


@needs_openvino
def test_openvino_and_torch_agree_on_a_pointwise_oracle_through_the_window(tmp_path):
    """The pointwise network converted by OpenVINO, through the project's sliding window and
    predictor: the network on the whole volume, exactly up to float32 rounding, as PyTorch's."""
    from runtime.inference.openvino.compiled import OpenVINOWindows, compile_for_cpu, convert

    model = pointwise_model()
    config = predict_config(tmp_path)
    windows = OpenVINOWindows(compile_for_cpu(convert(model, config.val_input_shape)), config.val_input_shape)
    image = np.random.default_rng(1).normal(size=(1, 37, 66, 50)).astype(np.float32)
    plan = flags_plan(config)
    options = options_from(plan.precision, plan.inference)
    ov = volume_probabilities(build_predictor(windows, CPU, options), image, plan.inference, CPU)
    pt = volume_probabilities(build_predictor(model, CPU, options), image, plan.inference, CPU)
    with torch.no_grad():
        whole = torch.softmax(model(torch.from_numpy(image)[None])[0], 0)
    assert ov.shape == whole.shape == (3, 37, 66, 50)
    assert torch.allclose(ov, whole, atol=2e-6, rtol=0) and torch.allclose(pt, whole, atol=2e-6, rtol=0)


@needs_openvino
def test_openvino_unet_gives_torchs_logits(tmp_path):
    """A tiny UNet3D, traced at 64³ and reshaped to 32x32x64 windows: PyTorch's logits up to
    float32 rounding, window by window, in any input layout (a flipped view, as TTA passes)."""
    from runtime.inference.openvino.compiled import OpenVINOWindows, compile_for_cpu, convert

    torch.manual_seed(0)
    model = Unet3D(filters=TINY).eval()
    windows = OpenVINOWindows(compile_for_cpu(convert(model, (32, 32, 64))), (32, 32, 64))
    batch = torch.randn(3, 1, 32, 32, 64)
    with torch.no_grad():
        for x in (batch, batch.flip(4)):
            expected, got = model(x), windows(x)
            assert got.shape == expected.shape and got.is_contiguous()
            assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    with pytest.raises(ValueError, match=r"compiled for \(32, 32, 64\)"):
        windows(torch.zeros(1, 1, 32, 32, 32))


@needs_openvino
def test_cache_is_rebuilt_when_the_checkpoint_changes(tmp_path):
    """The first run converts, the second reads the cache; new weights in the same file (same
    size, same time stamp) convert again and give the new weights' logits, never the old
    ones; the old entry is removed; a damaged entry is rebuilt."""
    from runtime.inference.openvino.cache import cache_folder, default_cache_dir
    from runtime.inference.openvino.compiled import OpenVINOWindows, cached_openvino_model

    ckpt = str(tmp_path / "tiny.pt")
    # the cache folder a run plans (runtime.resolve.decide_cache_dir): the user's
    config = replace(predict_config(tmp_path), load_ckpt_path=ckpt, cache_dir=default_cache_dir())
    plan = flags_plan(config)
    x = torch.randn(1, 1, 32, 32, 64)

    def run(model):
        lines = []
        windows = OpenVINOWindows(cached_openvino_model(model, plan.network, plan.inference, ckpt, say=lines.append),
                                  (32, 32, 64))
        with torch.no_grad():
            assert (windows(x) - model(x)).abs().max() <= 1e-4 * model(x).abs().max()
        return lines[-1]

    first = save_tiny(ckpt, 0)
    stamp = os.stat(ckpt)
    assert "converting" in run(first)
    assert "using the converted network" in run(first)
    second = save_tiny(ckpt, 1)
    os.utime(ckpt, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert os.stat(ckpt).st_size == stamp.st_size and os.stat(ckpt).st_mtime_ns == stamp.st_mtime_ns
    assert "converting" in run(second)
    folder = cache_folder(ckpt, config.cache_dir)  # the user's cache folder, never beside the checkpoint
    assert folder.startswith(str(tmp_path / "xdg")) and not os.path.exists(ckpt + ".openvino")
    entries = [e for e in os.listdir(folder) if not e.startswith(".")]
    assert len(entries) == 1
    with open(os.path.join(folder, entries[0], "key.json")) as handle:
        assert json.load(handle)["window"] == [32, 32, 64]
    with open(os.path.join(folder, entries[0], "model.xml"), "w") as handle:
        handle.write("<damaged")
    assert "converting" in run(second)


@needs_openvino
def test_cache_in_a_read_only_folder_is_one_line(tmp_path):
    from runtime.inference.openvino.compiled import cached_openvino_model

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    folder = tmp_path / "ro"
    folder.mkdir()
    ckpt = str(folder / "tiny.pt")
    model = save_tiny(ckpt, 0)
    folder.chmod(0o555)
    lines = []
    try:
        plan = flags_plan(replace(predict_config(tmp_path), load_ckpt_path=ckpt, cache_dir=str(folder)))
        cached_openvino_model(model, plan.network, plan.inference, ckpt, say=lines.append)
    finally:
        folder.chmod(0o755)
    assert any("used for this run only" in line for line in lines)


@needs_nncf
def test_int8_quantises_on_the_calibration_windows(tmp_path):
    """NNCF quantises the tiny UNet3D on two windows: the compiled model has int8 (FakeQuantize)
    layers, the norms read float inputs, each half of a decoder's input has a quantiser of its
    own (no quantised concatenation), its logits stay near the float ones, one line says how many
    convolutions are int8, and the calibration set is in the key."""
    from runtime.inference.openvino.cache import cache_fields
    from runtime.inference.openvino.calibration import scan_calibration
    from runtime.inference.openvino.compiled import OpenVINOWindows, compile_for_cpu, compile_openvino_model

    scans = [(f"s{i}", write_scan(str(tmp_path / "in" / f"s{i}.nii.gz"), seed=i, shape=(40, 40, 70))) for i in range(2)]
    config = predict_config(tmp_path)
    calibration = dataclasses.replace(scan_calibration(config.val_input_shape, scans, overflow_fix()), window_count=2)
    torch.manual_seed(0)
    model = Unet3D(filters=TINY).eval()
    lines = []
    quantised = compile_openvino_model(model, config.val_input_shape, calibration, say=lines.append)
    ops = quantised.get_ops()
    source = lambda op: op.input(0).get_source_output().get_node().get_type_name()  # noqa: E731
    assert any(op.get_type_name() == "FakeQuantize" for op in ops)
    norms = [op for op in ops if op.get_type_name() == "MVN"]
    assert len(norms) == 2 * 11  # input block, 4 down, bottleneck, 5 up: two norms each
    assert all(source(op) != "FakeQuantize" for op in norms)
    assert not [op for op in ops if op.get_type_name() == "FakeQuantize" and source(op) == "Concat"]
    convolutions = [op for op in ops if op.get_type_name() in ("Convolution", "ConvolutionBackpropData")]
    assert len(convolutions) == 28 + 5  # each decoder's first convolution in two halves
    assert "accuracy control on" in lines[0]
    assert re.match(r"openvino: int8 on \d+ of 33 convolutions, \d+ kept in fp32; foreground agreement", lines[-1])
    assert all("accuracy control: int8 labels agree" in line for line in lines[1:-1])
    windows = OpenVINOWindows(compile_for_cpu(quantised), (32, 32, 64))
    x = torch.from_numpy(calibration.arrays()[0])
    with torch.no_grad():
        expected = model(x)
    error = float((windows(x) - expected).norm() / expected.norm())
    assert error < 0.1, error
    network = flags_plan(config).network.architecture
    fields = cache_fields(model, network, config.val_input_shape, calibration)
    assert fields["precision"] == "int8" and [s["name"] for s in fields["calibration"]["scans"]] == ["s0", "s1"]
    other = scan_calibration(config.val_input_shape, scans[:1], overflow_fix())
    assert cache_fields(model, network, config.val_input_shape, other) != fields


@needs_openvino
def test_predict_cli_openvino_segments_like_torch(tmp_path):
    """``main.py --exec_mode predict``: the OpenVINO backend's labels equal PyTorch's up to
    float32 rounding; the second run reads the cache."""
    scan = write_scan(str(tmp_path / "in" / "scan.nii.gz"))
    ckpt = str(tmp_path / "tiny.pt")
    save_tiny(ckpt, 0)
    labels, outs = {}, {}
    for name, backend in (("torch", "torch"), ("ov", "openvino"), ("ov2", "auto")):
        outs[name] = subprocess.run(
            [sys.executable, "main.py", "--exec_mode", "predict", "--input", scan, "--output_dir", str(tmp_path / name),
             "--load_ckpt_path", ckpt, "--val_input_shape", "128", "128", "128", "--backend", backend],
            cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert outs[name].returncode == 0, outs[name].stderr[-2000:]
        labels[name] = np.asarray(nibabel.load(str(tmp_path / name / "scan.nii.gz")).dataobj)
    assert "converting" in outs["ov"].stdout and "using the converted network" in outs["ov2"].stdout
    assert "backend: --backend auto: OpenVINO" in outs["ov2"].stdout
    assert np.mean(labels["torch"] == labels["ov"]) > 0.999 and np.array_equal(labels["ov"], labels["ov2"])


@needs_nncf
def test_predict_int8_needs_only_a_checkpoint_and_the_scans(tmp_path, cache_home):
    """``predict --int8`` with a checkpoint and a folder of scans, no --data_dir: it calibrates
    on each scan alone, segments them in the scans' shape, records each scan's calibration,
    reuses its outputs on a second run; a scan given alone gets the same calibration and the same
    labels as in the folder (its result is reproduced from that scan alone); the converted
    networks are in the cache folder, none beside the checkpoint or the scans."""
    ckpt = str(tmp_path / "tiny.pt")
    save_tiny(ckpt, 0)
    folder = tmp_path / "in"
    for i in range(2):
        write_scan(str(folder / f"s{i}.nii.gz"), seed=i)

    def predict(source, out):
        return subprocess.run([sys.executable, "main.py", "--exec_mode", "predict", "--input", str(source),
                               "--output_dir", str(out), "--load_ckpt_path", ckpt, "--val_input_shape", "64", "64", "64",
                               "--int8"], cwd=ROOT, capture_output=True, text=True, timeout=900)

    first = predict(folder, tmp_path / "out")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "int8 (NNCF post-training quantisation, calibrated on each scan alone)" in first.stdout
    assert "1 scan (s0)" in first.stdout and "1 scan (s1)" in first.stdout
    assert "s0: segmented" in first.stdout and "int8 calibrated on this scan alone" in first.stdout
    labels = np.asarray(nibabel.load(str(tmp_path / "out" / "s0.nii.gz")).dataobj)
    assert labels.shape == (26, 30, 28) and labels.dtype == np.uint8
    records = {}
    for name in ("s0", "s1"):
        with open(tmp_path / "out" / f"{name}.provenance.json") as handle:
            records[name] = json.load(handle)
    assert records["s0"]["int8"] is True and re.fullmatch(r"[0-9a-f]{64}", records["s0"]["int8_calibration"])
    assert records["s0"]["int8_calibration_set"] == "this scan"
    assert records["s0"]["int8_calibration"] != records["s1"]["int8_calibration"]
    again = predict(folder, tmp_path / "out")
    assert again.returncode == 0 and "0 segmented, 2 skipped" in again.stdout
    alone = predict(folder / "s0.nii.gz", tmp_path / "alone")
    assert alone.returncode == 0 and "using the converted network" in alone.stdout, alone.stderr[-2000:]
    with open(tmp_path / "alone" / "s0.provenance.json") as handle:
        assert json.load(handle)["int8_calibration"] == records["s0"]["int8_calibration"]
    assert np.array_equal(np.asarray(nibabel.load(str(tmp_path / "alone" / "s0.nii.gz")).dataobj), labels)
    assert os.listdir(cache_home / "unet3d-kits19" / "openvino")
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".openvino")] and not os.path.exists(folder / "s0.openvino")


# ----------------------------------------------------------------------------- the benchmark


@needs_nncf
def test_accuracy_control_keeps_fp32_labels_on_the_validation_windows(tmp_path, monkeypatch):
    """With no agreement drop allowed, the quantised network's labels on the validation windows
    equal fp32's (checked here by running both), however many convolutions that puts back in
    fp32; the line reports the kept ones as the model holds them."""
    import runtime.inference.openvino.calibration as calibration_module
    from runtime.inference.openvino.calibration import float_convolutions, labels_of, scan_calibration, validation_windows
    from runtime.inference.openvino.compiled import compile_for_cpu, compile_openvino_model, convert
    from runtime.inference.openvino.decoder_split import split_decoder_inputs

    monkeypatch.setattr(calibration_module, "MAX_AGREEMENT_DROP", 0.0)
    monkeypatch.setattr(calibration_module, "MAX_STEPS", 1000)  # uncapped: the cap is checked below
    scan = write_scan(str(tmp_path / "in" / "s.nii.gz"), seed=1, shape=(26, 60, 60))
    shape = predict_config(tmp_path).val_input_shape
    calibration = dataclasses.replace(scan_calibration(shape, [("s", scan)], overflow_fix()), window_count=2)
    torch.manual_seed(0)
    model = Unet3D(filters=TINY).eval()
    lines = []
    quantised = compile_openvino_model(model, shape, calibration, say=lines.append)
    # the fp32 network accuracy control compares with: the converted one, decoder inputs split
    fp32 = compile_for_cpu(convert(split_decoder_inputs(model), (32, 32, 64)))
    int8 = compile_for_cpu(quantised)
    windows = calibration.arrays()
    checked = [windows[i] for i in validation_windows([labels_of(fp32(w)[0]) for w in windows])]
    for window in checked:
        assert np.array_equal(np.asarray(int8(window)[0]).argmax(1), np.asarray(fp32(window)[0]).argmax(1))
    kept, total = float_convolutions(quantised)
    assert f"int8 on {total - kept} of {total} convolutions, {kept} kept in fp32" in lines[-1]
    assert "agreement with fp32 on the validation windows 100.00%" in lines[-1] and "below" not in lines[-1]
    # one step at most: the line says whether the bar was reached, as the labels (run here) show
    monkeypatch.setattr(calibration_module, "MAX_STEPS", 1)
    lines.clear()
    capped = compile_for_cpu(compile_openvino_model(model, shape, calibration, say=lines.append))
    equal = all(np.array_equal(np.asarray(capped(w)[0]).argmax(1), np.asarray(fp32(w)[0]).argmax(1))
                for w in checked)
    assert ("below the 100.0% asked for" in lines[-1]) == (not equal), lines[-1]


def test_split_decoder_inputs_computes_the_same_function():
    """One convolution per half of the decoder's input (each with a weight tensor of its own),
    summed, equals the convolution of the concatenation (float64, so only the summation order
    differs)."""
    from runtime.inference.openvino.decoder_split import split_decoder_inputs

    def halves(network):
        return [m for m in network.modules() if getattr(m, "part_weights", None) is not None]

    torch.manual_seed(0)
    model = Unet3D(filters=TINY).double().eval()
    split = split_decoder_inputs(model)
    assert len(halves(split)) == 5 and all(len(m.part_weights) == 2 for m in halves(split))
    assert not halves(model)  # a copy: the model is kept
    x = torch.randn(1, 1, 32, 32, 64, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(split(x), model(x), rtol=1e-10, atol=1e-10)
    other = nn.Sequential(nn.Conv3d(1, 2, 3))
    assert split_decoder_inputs(other) is other


@needs_openvino
def test_evaluate_with_openvino_scores_like_torch(tmp_path, capsys):
    """``evaluation_components`` swaps in the OpenVINO window predictor as ``eval_model``: the
    benchmark's evaluation of two random volumes gives PyTorch's loss and Dice up to float32
    rounding; the conversion's lines go to stderr with --verbose only (evaluate's stdout is its
    result, with the backend's line; its stderr one line on an error)."""
    import dataclasses

    from model.losses import DiceCELoss, DiceScore
    from runtime.clocked.evaluation import evaluate
    from runtime.clocked.reporters import Reporters
    from runtime.evaluate.components import evaluation_components
    from runtime.run_log import MetricsWriter

    @dataclasses.dataclass
    class Parts:
        plan: object
        dist: object
        model: object
        eval_model: object

    ckpt = str(tmp_path / "tiny.pt")
    model = save_tiny(ckpt, 2)
    config = parse_args(["--exec_mode", "evaluate", "--data_dir", str(tmp_path), "--load_ckpt_path", ckpt,
                         "--val_input_shape", "32", "32", "64", "--filters", *map(str, TINY), "--backend", "openvino"])
    out = Reporters(metrics=MetricsWriter(str(tmp_path), enabled=True))
    from runtime.inference.openvino.cache import default_cache_dir

    # the backend and the cache folder the plan decides (runtime.resolve)
    config = replace(config, backend=decide_backend(config, CPU)[0], cache_dir=default_cache_dir())
    plan = flags_plan(config)
    assert plan.inference.backend == "openvino"  # run_evaluate writes it to log.json after the scores
    parts = evaluation_components(Parts(plan, type("D", (), {"device": CPU})(), model, model), out)
    assert parts.eval_model is not model and capsys.readouterr().err == ""  # quiet without --verbose
    verbose = flags_plan(replace(config, verbose=True))
    evaluation_components(Parts(verbose, type("D", (), {"device": CPU})(), model, model), out)
    assert "openvino: " in capsys.readouterr().err
    rng = np.random.default_rng(4)
    volumes = [(torch.from_numpy(rng.normal(size=(1, 1, 40, 50, 70)).astype(np.float32)),
                torch.from_numpy(rng.integers(0, 3, (1, 1, 40, 50, 70)).astype(np.uint8)), str(i)) for i in range(2)]
    scores = [evaluate(m.eval(), volumes, DiceCELoss(to_onehot_y=True, use_softmax=True), DiceScore(to_onehot_y=True, use_argmax=True),
                       (32, 32, 64), 0.5, 2, CPU) for m in (model, parts.eval_model)]
    for key in ("eval_loss", "l1_dice", "l2_dice", "mean_dice"):
        assert scores[1][key] == pytest.approx(scores[0][key], abs=2e-3), key
