"""KiTS19 preprocessing: outputs equal the benchmark's steps bit for bit, resume, verify, errors.

The oracles here are written independently of ``data_loading/preprocessing.py``: trilinear
and nearest resampling re-derived in numpy from torch's documented CPU arithmetic, a scipy
``map_coordinates`` cross-check, padding by explicit index arithmetic, and a straight
transcription of the reference's calls whose bytes must equal the files on disk.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time

import nibabel
import numpy as np
import pytest

import preprocess_dataset
from data_loading import preprocessing as pp
from data_loading import synthetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32 = np.float32
TARGET = (1.6, 1.2, 1.2)


# ----------------------------------------------------------------------------- helpers


def write_case(raw_dir, case_id, shape, spacing, seed=0):
    """A synthetic case of a chosen (tiny) shape and spacing; returns the SyntheticCase."""
    case = synthetic.make_case(case_id, shape, spacing, synthetic.case_rng(seed, case_id))
    synthetic.save_case(case, str(raw_dir), labelled=case_id < 210)
    return case


def write_nifti(path, array, spacing=(2.0, 1.0, 1.0)):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    image = nibabel.Nifti1Image(array, np.diag([*spacing, 1.0]))
    image.header.set_zooms(spacing)
    nibabel.save(image, str(path))


def run_cli(*args, cwd=ROOT, timeout=120):
    return subprocess.run([sys.executable, os.path.join(ROOT, "preprocess_dataset.py"), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


def npy_bytes(array):
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def md5(path):
    with open(path, "rb") as handle:
        return hashlib.md5(handle.read()).hexdigest()


# ----------------------------------------------------------------------------- oracles


def linear_taps(n_in, n_out):
    """Source indices and weights of torch's CPU linear interpolation, align_corners=True.

    torch computes in float32: scale = (in - 1) / (out - 1); src = scale * i;
    i0 = min(floor(src), in - 1); l1 = clamp(src - i0, 0, 1); l0 = 1 - l1; i1 = i0 + (i0 < in-1).
    """
    scale = F32(n_in - 1) / F32(n_out - 1) if n_out > 1 else F32(0)
    src = np.arange(n_out, dtype=F32) * scale
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    l1 = np.clip(src - i0.astype(F32), F32(0), F32(1)).astype(F32)
    i1 = i0 + (i0 < n_in - 1)
    return i0, i1, (F32(1) - l1).astype(F32), l1


def trilinear_oracle(volume, out_shape, fused):
    """(D, H, W) float32 -> ``out_shape``, interpolating W, then H, then D per output voxel.

    Each 1-D step is ``t0 * w0 + t1 * w1`` in float32; vectorised builds of torch contract it
    to ``fma(t0, w0, t1 * w1)``, emulated exactly here through float64 (the product of two
    float32 numbers is exact in float64). ``fused`` selects which of the two is computed.
    """
    def combine(t0, w0, t1, w1):
        if fused:
            return (t0.astype(np.float64) * w0 + (t1 * w1).astype(np.float64)).astype(F32)
        return t0 * w0 + t1 * w1

    (d0, d1, dw0, dw1), (h0, h1, hw0, hw1), (x0, x1, xw0, xw1) = (
        linear_taps(n, m) for n, m in zip(volume.shape, out_shape))

    def along_w(v):
        return combine(v[..., x0], xw0, v[..., x1], xw1)

    def along_h(v):
        return combine(along_w(v[:, h0]), hw0[:, None], along_w(v[:, h1]), hw1[:, None])

    return combine(along_h(volume[d0]), dw0[:, None, None], along_h(volume[d1]),
                   dw1[:, None, None])


def nearest_oracle(volume, out_shape):
    """torch's legacy 'nearest': src = min(floor(i * float32(in / out)), in - 1)."""
    index = []
    for n_in, n_out in zip(volume.shape, out_shape):
        scale = F32(n_in) / F32(n_out)
        src = np.floor(np.arange(n_out, dtype=F32) * scale).astype(np.int64)
        index.append(np.minimum(src, n_in - 1))
    return volume[np.ix_(*index)]


def scipy_trilinear(volume, out_shape):
    from scipy.ndimage import map_coordinates

    axes = [np.arange(m) * ((n - 1) / (m - 1)) for n, m in zip(volume.shape, out_shape)]
    grid = np.meshgrid(*axes, indexing="ij")
    return map_coordinates(volume.astype(np.float64), grid, order=1, mode="nearest")


def edge_pad_oracle(volume, minimum=128):
    """Edge padding by index arithmetic: every output voxel reads the clamped input voxel."""
    index = []
    for n in volume.shape:
        total = max(0, minimum - n)
        index.append(np.clip(np.arange(n + total) - total // 2, 0, n - 1))
    return volume[np.ix_(*index)]


def expected_arrays(case):
    """The spec's steps applied to the generator's in-memory arrays: (1, D, H, W) x, y."""
    spacing = [float(F32(s)) for s in case.spacing]  # what the float32 header holds
    shape = case.image.shape
    image = case.image.astype(F32)
    label = case.label
    if spacing != list(TARGET):
        out_shape = [int(s / t * n) for s, t, n in zip(spacing, TARGET, shape)]
        fused = trilinear_oracle(image, out_shape, fused=True)
        plain = trilinear_oracle(image, out_shape, fused=False)
        image = (fused, plain)
        label = nearest_oracle(label, out_shape)
    else:
        image = (image, image)
    clipped = [np.minimum(np.maximum(v, F32(-79)), F32(304)) for v in image]
    normalised = [(v - F32(101.0)) / F32(76.9) for v in clipped]
    return ([edge_pad_oracle(v)[None] for v in normalised], edge_pad_oracle(label)[None])


def reference_transcription(raw_case_dir):
    """The reference's calls, written out plainly, from the NIfTI files on disk."""
    import torch
    from torch.nn.functional import interpolate

    image = nibabel.load(os.path.join(raw_case_dir, "imaging.nii.gz"))
    spacing = image.header["pixdim"][1:4].tolist()
    image = np.expand_dims(image.get_fdata().astype(np.float32), 0)
    label = nibabel.load(os.path.join(raw_case_dir, "segmentation.nii.gz"))
    label = np.expand_dims(label.get_fdata().astype(np.uint8), 0)
    if spacing != [1.6, 1.2, 1.2]:
        size = (np.array(spacing) / np.array([1.6, 1.2, 1.2]) * np.array(image.shape[1:]))
        size = size.astype(int).tolist()
        image = interpolate(torch.from_numpy(image[None]), size=size, mode="trilinear",
                            align_corners=True).numpy()[0]
        label = interpolate(torch.from_numpy(label[None]), size=size, mode="nearest").numpy()[0]
    image = (np.clip(image, -79, 304) - 101.0) / 76.9
    pads = [(0, 0)] + [(max(0, 128 - s) // 2, max(0, 128 - s) - max(0, 128 - s) // 2)
                       for s in image.shape[1:]]
    return np.pad(image, pads, mode="edge"), np.pad(label, pads, mode="edge")


# ----------------------------------------------------------------------------- bit-exactness

# (shape, spacing): header exactly float32 target spacing (the resample still runs, to the
# same shape, because float32(1.6) != 1.6); anisotropic down- and up-sampling; axes below 128
# (padded) and above 128 before and after resampling.
ORACLE_CASES = {
    "target_spacing_pad_and_above": ((20, 24, 140), TARGET),
    "anisotropic_all_padded": ((30, 40, 50), (3.0, 0.9, 2.2)),
    "resampled_above_128": ((50, 61, 66), (4.5, 2.7, 1.0)),
}


@pytest.mark.parametrize("name", sorted(ORACLE_CASES))
def test_outputs_equal_the_spec_steps_bit_for_bit(tmp_path, name):
    shape, spacing = ORACLE_CASES[name]
    raw, out = tmp_path / "raw", tmp_path / "out"
    case = write_case(raw, 7, shape, spacing)
    (stats,) = pp.preprocess_cases(pp.find_cases(str(raw))[0], str(out), 1, lambda s: None)

    x = np.load(out / "case_00007_x.npy")
    y = np.load(out / "case_00007_y.npy")
    (x_fused, x_plain), y_expected = expected_arrays(case)
    assert x.dtype == np.float32 and y.dtype == np.uint8
    assert x.shape == x_fused.shape == y.shape == y_expected.shape
    assert stats.shape == x.shape and min(x.shape[1:]) >= 128
    assert np.array_equal(y, y_expected)
    # torch's kernel is one of the two float32 evaluation orders, bit for bit
    assert np.array_equal(x, x_fused) or np.array_equal(x, x_plain)
    # and an unrelated float64 trilinear agrees to float32 rounding. float32 source
    # coordinates are off by ~1e-7 relative: across an air-bone edge (1700 HU) that moves a
    # value by up to ~0.01 HU, 1.3e-4 after normalisation.
    out_shape = [int(float(F32(s)) / t * n) for s, t, n in zip(spacing, TARGET, shape)]
    scipy_x = (np.clip(scipy_trilinear(case.image, out_shape), -79, 304) - 101.0) / 76.9
    np.testing.assert_allclose(x[0], edge_pad_oracle(scipy_x), rtol=0, atol=2e-4)
    # the files are byte-identical to the reference's calls on the same NIfTI files
    ref_x, ref_y = reference_transcription(raw / "case_00007")
    assert (out / "case_00007_x.npy").read_bytes() == npy_bytes(ref_x)
    assert (out / "case_00007_y.npy").read_bytes() == npy_bytes(ref_y)


def test_spacing_equal_as_python_floats_skips_the_resample():
    image = np.arange(24, dtype=F32).reshape(1, 2, 3, 4)
    label = np.ones((1, 2, 3, 4), np.uint8)
    out_image, out_label = pp.resample(image, label, [1.6, 1.2, 1.2])
    assert out_image is image and out_label is label
    # a float32 header value is a different list: resampled, here to the same shape
    spacing = [float(F32(v)) for v in (1.6, 1.2, 1.2)]
    out_image, _ = pp.resample(image, label, spacing)
    assert out_image is not image and np.array_equal(out_image, image)


def test_padding_splits_the_difference_floor_before():
    image = np.arange(2 * 3 * 130, dtype=F32).reshape(1, 2, 3, 130)
    padded, _ = pp.pad_to_min_shape(image, image.astype(np.uint8))
    assert padded.shape == (1, 128, 128, 130)
    assert np.array_equal(padded[0, :63, 0, :], np.broadcast_to(image[0, 0, 0], (63, 130)))
    assert np.array_equal(padded[0, 63:65, 62:65], image[0])  # 126 // 2 = 63, 125 // 2 = 62
    assert np.array_equal(padded[0], edge_pad_oracle(image[0]))


@pytest.mark.parametrize("dtype, slope", [("int16", None), ("uint8", None), ("int32", None),
                                          ("uint16", None), ("float32", None), ("float64", None),
                                          ("int64", None), ("int16", (0.5, -1024.0))])
def test_read_voxels_casts_like_get_fdata_bit_for_bit(tmp_path, dtype, slope):
    rng = np.random.default_rng(5)
    if np.dtype(dtype).kind == "f":
        data = rng.normal(0, 1e4, (5, 6, 7)).astype(dtype)
        data[0, 0, :3] = [np.nan, np.inf, 2 ** 24 + 1]
    else:
        info = np.iinfo(dtype)
        data = rng.integers(info.min, info.max, (5, 6, 7), dtype=dtype, endpoint=True)
    image = nibabel.Nifti1Image(data, np.eye(4), dtype=data.dtype)
    if slope:
        image.header.set_slope_inter(*slope)
    nibabel.save(image, str(tmp_path / "v.nii.gz"))
    loaded = nibabel.load(str(tmp_path / "v.nii.gz"))
    ours = pp.read_voxels(loaded, "v.nii.gz").astype(np.float32)
    reference = nibabel.load(str(tmp_path / "v.nii.gz")).get_fdata().astype(np.float32)
    assert ours.tobytes(order="A") == reference.tobytes(order="A")
    assert ours.flags.f_contiguous == reference.flags.f_contiguous
    if slope is None and dtype != "int64":
        assert pp.read_voxels(loaded, "v.nii.gz").dtype == np.dtype(dtype)  # no float64 copy


# ----------------------------------------------------------------------------- runs


def test_skips_unlabelled_ids_once_and_accepts_the_data_folder(tmp_path, capsys):
    raw = tmp_path / "kits19" / "data"
    write_case(raw, 3, (12, 14, 16), (2.0, 1.5, 1.5))
    write_case(raw, 210, (12, 14, 16), (2.0, 1.5, 1.5))
    write_case(raw, 211, (12, 14, 16), (2.0, 1.5, 1.5))
    out = tmp_path / "out"
    code = preprocess_dataset.main(["--data_dir", str(tmp_path / "kits19"),
                                    "--results_dir", str(out), "--num_workers", "1"])
    printed = capsys.readouterr().out
    assert code == 0
    assert [line for line in printed.splitlines() if "210" in line] == [
        "skipping 2 cases with id >= 210 (KiTS19 has no labels for them)"]
    assert "case_00003: shape (1, 128, 128, 128), mean" in printed and "median over 1" in printed
    assert sorted(os.listdir(out)) == ["case_00003_geometry.json", "case_00003_x.npy", "case_00003_y.npy"]


def test_two_workers_write_the_same_bytes_as_one(tmp_path, capsys):
    raw = tmp_path / "raw"
    for case_id, spacing in ((0, TARGET), (1, (2.5, 1.5, 0.9)), (2, (1.0, 2.0, 2.0))):
        write_case(raw, case_id, (16, 18, 20), spacing)
    for workers in ("1", "2"):
        code = preprocess_dataset.main(["--data_dir", str(raw), "--results_dir",
                                        str(tmp_path / workers), "--num_workers", workers])
        assert code == 0
    names = sorted(os.listdir(tmp_path / "1"))   # 6 arrays and 3 geometry records
    assert len(names) == 9 and names == sorted(os.listdir(tmp_path / "2"))
    for name in names:
        assert md5(tmp_path / "1" / name) == md5(tmp_path / "2" / name), name


def test_resume_redoes_only_incomplete_cases(tmp_path, capsys):
    raw, out = tmp_path / "raw", tmp_path / "out"
    for case_id in range(3):
        write_case(raw, case_id, (14, 12, 10), (2.0, 1.4, 1.4))
    args = ["--data_dir", str(raw), "--results_dir", str(out), "--num_workers", "1"]
    assert preprocess_dataset.main(args) == 0
    first = {n: md5(out / n) for n in os.listdir(out)}
    kept_inode = os.stat(out / "case_00000_x.npy").st_ino

    # an interruption: one output missing, one cut short, a temporary file left behind
    os.remove(out / "case_00001_y.npy")
    data = (out / "case_00002_x.npy").read_bytes()
    (out / "case_00002_x.npy").write_bytes(data[: len(data) // 2])
    (out / ".case_00001_y.npy.4242.tmp").write_bytes(data[:100])
    capsys.readouterr()

    assert preprocess_dataset.main(args) == 0
    printed = capsys.readouterr().out
    assert "1 of 3 cases already complete" in printed and "2 cases preprocessed" in printed
    assert {n: md5(out / n) for n in os.listdir(out)} == first  # also: no temporary left
    assert os.stat(out / "case_00000_x.npy").st_ino == kept_inode

    assert preprocess_dataset.main(args + ["--force"]) == 0
    assert os.stat(out / "case_00000_x.npy").st_ino != kept_inode


def test_resume_after_the_process_is_killed_midway(tmp_path, capsys):
    raw, out = tmp_path / "raw", tmp_path / "out"
    for case_id in range(5):
        write_case(raw, case_id, (24, 20, 22), (2.2, 1.5, 1.5))
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "preprocess_dataset.py"),
                             "--data_dir", str(raw), "--results_dir", str(out),
                             "--num_workers", "1"], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (out / "case_00000_y.npy").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "no case finished within 60 s"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    done_before = [pp.is_complete(str(out), f"case_{i:05d}") for i in range(5)]
    assert done_before[0] and not all(done_before), "killed too late to test a resume"
    assert all(n.endswith((".npy", ".tmp", "_geometry.json")) for n in os.listdir(out))

    assert preprocess_dataset.main(["--data_dir", str(raw), "--results_dir", str(out),
                                    "--num_workers", "1"]) == 0
    assert f"{sum(done_before)} of 5 cases already complete" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == sorted([f"case_{i:05d}_{k}.npy" for i in range(5) for k in "xy"]
                                             + [f"case_{i:05d}_geometry.json" for i in range(5)])
    for i in range(5):
        assert pp.is_complete(str(out), f"case_{i:05d}")
        fresh_x, fresh_y = reference_transcription(raw / f"case_{i:05d}")
        assert (out / f"case_{i:05d}_x.npy").read_bytes() == npy_bytes(fresh_x)
        assert (out / f"case_{i:05d}_y.npy").read_bytes() == npy_bytes(fresh_y)


# ----------------------------------------------------------------------------- verify


@pytest.fixture(scope="module")
def good_set(tmp_path_factory):
    """Two preprocessed cases and a checksum file of their md5 sums."""
    base = tmp_path_factory.mktemp("verify")
    raw, out = base / "raw", base / "out"
    for case_id in (0, 1):
        write_case(raw, case_id, (10, 12, 14), (2.0, 1.3, 1.3))
    pp.preprocess_cases(pp.find_cases(str(raw))[0], str(out), 1, lambda s: None)
    sums = {n: md5(out / n) for n in sorted(os.listdir(out)) if n.endswith(".npy")}   # the arrays only
    (base / "checksum.json").write_text(json.dumps(sums))
    return out, base / "checksum.json"


def copy_set(good_set, tmp_path):
    out, checksum = good_set
    copy = tmp_path / "out"
    copy.mkdir()
    for name in os.listdir(out):
        (copy / name).write_bytes((out / name).read_bytes())
    return copy, checksum


def test_verify_passes_a_good_set(good_set, tmp_path, capsys):
    out, checksum = copy_set(good_set, tmp_path)
    code = preprocess_dataset.main(["--mode", "verify", "--results_dir", str(out),
                                    "--checksum", str(checksum)])
    assert code == 0
    assert "all 4 files" in capsys.readouterr().out


def test_verify_names_one_flipped_byte(good_set, tmp_path):
    out, checksum = copy_set(good_set, tmp_path)
    data = bytearray((out / "case_00001_x.npy").read_bytes())
    data[len(data) // 2] ^= 0x01
    (out / "case_00001_x.npy").write_bytes(bytes(data))
    result = run_cli("--mode", "verify", "--results_dir", str(out), "--checksum", str(checksum))
    assert result.returncode != 0
    problem_lines = [line.split() for line in result.stdout.splitlines()[1:]]
    assert problem_lines == [["mismatch", "case_00001_x.npy"]]
    assert "Traceback" not in result.stdout + result.stderr


def test_verify_lists_every_missing_extra_and_mismatch_at_once(good_set, tmp_path, capsys):
    out, checksum = copy_set(good_set, tmp_path)
    os.remove(out / "case_00000_y.npy")
    (out / "case_00009_x.npy").write_bytes(b"not in the checksum file")
    data = bytearray((out / "case_00000_x.npy").read_bytes())
    data[-1] ^= 0xFF
    (out / "case_00000_x.npy").write_bytes(bytes(data))
    code = preprocess_dataset.main(["--mode", "verify", "--results_dir", str(out),
                                    "--checksum", str(checksum)])
    captured = capsys.readouterr()
    assert code == 1
    assert [line.split() for line in captured.out.splitlines()[1:]] == [
        ["mismatch", "case_00000_x.npy"], ["missing", "case_00000_y.npy"],
        ["extra", "case_00009_x.npy"]]
    assert "1 missing, 1 extra, 1 mismatching" in captured.err


def test_verify_after_preprocess_only_when_asked(good_set, tmp_path, capsys):
    out, checksum = good_set
    raw = os.path.join(os.path.dirname(out), "raw")
    base = ["--data_dir", raw, "--results_dir", str(out), "--num_workers", "1",
            "--checksum", str(checksum)]
    assert preprocess_dataset.main(base) == 0
    assert "verify:" not in capsys.readouterr().out
    assert preprocess_dataset.main(base + ["--verify"]) == 0
    assert "verify: all 4 files" in capsys.readouterr().out


def test_default_checksum_is_found_from_the_package_not_the_cwd(tmp_path, monkeypatch, capsys):
    assert os.path.isabs(pp.DEFAULT_CHECKSUM)
    assert len(pp.load_checksums(pp.DEFAULT_CHECKSUM)) == 420
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    assert preprocess_dataset.main(["--mode", "verify", "--results_dir", "out"]) == 1
    assert "420 missing, 0 extra, 0 mismatching" in capsys.readouterr().err


# ----------------------------------------------------------------------------- bad input


def make_bad_input(tmp_path, kind):
    """A raw folder (or flags) with one problem; returns (extra CLI args, text to be named)."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    case_dir = raw / "case_00004"
    good = np.zeros((6, 7, 8), np.int16)
    labels = np.zeros((6, 7, 8), np.uint8)
    if kind == "missing_data_dir":
        return ["--data_dir", str(tmp_path / "nowhere"), "--results_dir", str(out)], "nowhere"
    if kind == "empty_data_dir":
        raw.mkdir()
        return ["--data_dir", str(raw), "--results_dir", str(out)], str(raw)
    if kind == "unwritable_results_dir":
        write_nifti(case_dir / "imaging.nii.gz", good)
        write_nifti(case_dir / "segmentation.nii.gz", labels)
        (tmp_path / "a_file").write_text("")
        return (["--data_dir", str(raw), "--results_dir", str(tmp_path / "a_file" / "out")],
                "--results_dir")
    if kind == "missing_segmentation":
        write_nifti(case_dir / "imaging.nii.gz", good)
        return ["--data_dir", str(raw), "--results_dir", str(out)], "segmentation.nii.gz"
    if kind == "corrupt_nifti":
        write_nifti(case_dir / "imaging.nii.gz", good)
        write_nifti(case_dir / "segmentation.nii.gz", labels)
        data = (case_dir / "imaging.nii.gz").read_bytes()
        (case_dir / "imaging.nii.gz").write_bytes(data[: len(data) // 2])
        return ["--data_dir", str(raw), "--results_dir", str(out)], "case_00004/imaging.nii.gz"
    if kind == "shape_mismatch":
        write_nifti(case_dir / "imaging.nii.gz", good)
        write_nifti(case_dir / "segmentation.nii.gz", np.zeros((6, 7, 9), np.uint8))
        return ["--data_dir", str(raw), "--results_dir", str(out)], "case_00004"
    if kind == "label_values":
        # 1.5 and 258 would pass as 1 and 2 after a uint8 cast: must be caught before it
        bad = labels.astype(np.float32)
        bad[0, 0, 0], bad[1, 1, 1] = 1.5, 258
        write_nifti(case_dir / "imaging.nii.gz", good)
        write_nifti(case_dir / "segmentation.nii.gz", bad)
        return ["--data_dir", str(raw), "--results_dir", str(out)], "case_00004"
    if kind == "nan_intensities":
        image = good.astype(np.float32)
        image[2, 3, 4], image[3, 3, 3] = np.nan, np.inf
        write_nifti(case_dir / "imaging.nii.gz", image)
        write_nifti(case_dir / "segmentation.nii.gz", labels)
        return ["--data_dir", str(raw), "--results_dir", str(out)], "case_00004/imaging.nii.gz"
    if kind == "bad_num_workers":
        return ["--data_dir", str(raw), "--results_dir", str(out), "--num_workers", "0"], \
            "--num_workers"
    if kind == "missing_checksum":
        out.mkdir()
        return (["--mode", "verify", "--results_dir", str(out), "--checksum",
                 str(tmp_path / "sums.json")], "sums.json")
    raise AssertionError(kind)


BAD_INPUTS = ["missing_data_dir", "empty_data_dir", "unwritable_results_dir",
              "missing_segmentation", "corrupt_nifti", "shape_mismatch",
              "label_values", "nan_intensities", "bad_num_workers", "missing_checksum"]


@pytest.mark.parametrize("kind", BAD_INPUTS)
def test_bad_input_is_one_line_and_a_nonzero_exit(tmp_path, kind):
    args, named = make_bad_input(tmp_path, kind)
    if "--num_workers" not in args:
        args += ["--num_workers", "1"]
    result = run_cli(*args)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert named in lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    if kind == "label_values":
        assert "1.5, 258" in lines[0]
    if kind in ("corrupt_nifti", "shape_mismatch", "label_values"):
        assert not os.path.exists(tmp_path / "out" / "case_00004_x.npy")


@pytest.mark.parametrize("content", [b"", b"\x00" * 400, b"\x1f\x8b" + b"\x00" * 60])
def test_unreadable_nifti_names_the_file(tmp_path, content):
    case_dir = tmp_path / "raw" / "case_00004"
    write_nifti(case_dir / "imaging.nii.gz", np.zeros((4, 5, 6), np.int16))
    (case_dir / "segmentation.nii.gz").write_bytes(content)
    (case,) = pp.find_cases(str(tmp_path / "raw"))[0]
    with pytest.raises(pp.PreprocessError, match="case_00004/segmentation.nii.gz: unreadable"):
        pp.load_pair(case)


def test_an_error_in_a_worker_process_is_one_line_too(tmp_path, capsys):
    raw = tmp_path / "raw"
    write_case(raw, 0, (8, 9, 10), (2.0, 1.0, 1.0))
    write_case(raw, 1, (8, 9, 10), (2.0, 1.0, 1.0))
    bad = np.zeros((8, 9, 10), np.float32)
    bad[0, 0, 0] = 3
    write_nifti(raw / "case_00001" / "segmentation.nii.gz", bad)
    code = preprocess_dataset.main(["--data_dir", str(raw), "--results_dir",
                                    str(tmp_path / "out"), "--num_workers", "2"])
    captured = capsys.readouterr()
    assert code != 0 and "Traceback" not in captured.out + captured.err
    assert captured.err.splitlines() == [
        "preprocess_dataset.py: error: case_00001: label values outside {0, 1, 2}: 3"]

def test_label_values_are_the_models_classes():
    """Preprocessing keeps its own label set (it starts without torch); it must be the model's."""
    from model.unet3d import N_CLASSES

    assert pp.LABEL_VALUES == tuple(range(N_CLASSES))


# ----------------------------------------------------------------------------- synthetic marker


def test_the_synthetic_marker_survives_preprocessing_and_changes_no_array(tmp_path, capsys):
    """A generated folder's synthetic.json is copied into the preprocessed folder (the raw
    folder only read), so that a run on it knows it is not KiTS19; the .npy bytes are the same
    as without the marker and as the reference's calls (reference_transcription)."""
    marked = tmp_path / "marked" / "data"  # the KiTS19 repository's layout: the marker beside the cases
    synthetic.generate(str(marked), cases=2, seed=4, size="small")
    plain = tmp_path / "plain"
    for case in ("case_00000", "case_00001"):
        (plain / case).mkdir(parents=True)
        for name in ("imaging.nii.gz", "segmentation.nii.gz"):
            (plain / case / name).write_bytes((marked / case / name).read_bytes())
    raw_before = {p.name: p.stat().st_mtime_ns for p in marked.iterdir()}
    marker = (marked / synthetic.MARKER_NAME).read_bytes()
    outs = {}
    for name, raw in (("marked", tmp_path / "marked"), ("plain", plain)):
        outs[name] = tmp_path / f"out-{name}"
        assert preprocess_dataset.main(["--data_dir", str(raw), "--results_dir", str(outs[name]),
                                        "--num_workers", "1"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("is synthetic (data_loading.synthetic)") == 1
    assert (outs["marked"] / synthetic.MARKER_NAME).read_bytes() == marker
    assert not (outs["plain"] / synthetic.MARKER_NAME).exists()
    assert {p.name: p.stat().st_mtime_ns for p in marked.iterdir()} == raw_before  # raw folder untouched
    arrays = sorted(n for n in os.listdir(outs["plain"]) if n.endswith(".npy"))
    assert len(arrays) == 4 and arrays == sorted(n for n in os.listdir(outs["marked"]) if n.endswith(".npy"))
    for name in arrays:
        assert (outs["marked"] / name).read_bytes() == (outs["plain"] / name).read_bytes(), name
    for case in ("case_00000", "case_00001"):
        fresh_x, fresh_y = reference_transcription(marked / case)
        assert (outs["marked"] / f"{case}_x.npy").read_bytes() == npy_bytes(fresh_x)
        assert (outs["marked"] / f"{case}_y.npy").read_bytes() == npy_bytes(fresh_y)


# ----------------------------------------------------------------------------- a header at odds with itself


def write_stale_pixdim_case(raw_dir, case_id, pixdim=(3.2, 1.5, 0.9), spacing=(1.6, 1.5, 1.8), shape=(14, 18, 16)):
    """A case whose image's ``pixdim[1:4]`` says ``pixdim`` while its affine (sform and qform,
    KiTS19's form) says ``spacing``: the two spacings of one file disagree; the label agrees."""
    rng = np.random.default_rng(case_id)
    label = (rng.random(shape) < 0.2).astype(np.uint8) + (rng.random(shape) < 0.1)
    ct = (rng.normal(60, 90, shape) + 120 * label).astype(np.int16)
    folder = raw_dir / f"case_{case_id:05d}"
    folder.mkdir(parents=True)
    for name, array, zooms in (("imaging.nii.gz", ct, pixdim), ("segmentation.nii.gz", label, spacing)):
        image = nibabel.Nifti1Image(array, synthetic.kits_affine(spacing))
        image.header.set_qform(image.affine, code=1)
        image.header.set_sform(image.affine, code=1)
        image.header.set_zooms(zooms)  # over the affine's: a stale pixdim
        nibabel.save(image, str(folder / name))
    written = nibabel.load(str(folder / "imaging.nii.gz"))
    assert written.header["pixdim"][1:4].tolist() == [float(F32(p)) for p in pixdim]
    assert not np.allclose(nibabel.affines.voxel_sizes(written.affine), pixdim)  # nibabel: they disagree
    return folder


def test_a_kits19_case_whose_pixdim_disagrees_is_made_as_the_reference_makes_it_with_one_warning(tmp_path, capsys):
    """KiTS19's own cases (issue 48, item 9) are never refused: the reference reads pixdim, and the
    files must be its files (checksum.json). One warning line names the case; the outputs are the
    reference's calls on the same files, byte for byte (resampled by pixdim, not by the affine)."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    case_dir = write_stale_pixdim_case(raw, 4)
    code = preprocess_dataset.main(["--data_dir", str(raw), "--results_dir", str(out), "--num_workers", "1"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 0
    assert len(err) == 1 and err[0].startswith("warning: ") and "case_00004" in err[0] and "pixdim" in err[0], err
    ref_x, ref_y = reference_transcription(case_dir)
    # resampled by pixdim (the float32 header's): 28 x 22 x 11 voxels; by the affine it would be 14 x 22 x 24
    by_pixdim = [int(float(F32(p)) / t * n) for p, t, n in zip((3.2, 1.5, 0.9), TARGET, (14, 18, 16))]
    assert json.loads((out / "case_00004_geometry.json").read_text())["resampled_shape"] == by_pixdim == [28, 22, 11]
    assert (out / "case_00004_x.npy").read_bytes() == npy_bytes(ref_x)
    assert (out / "case_00004_y.npy").read_bytes() == npy_bytes(ref_y)


def test_other_data_whose_pixdim_disagrees_is_still_refused_in_one_line(tmp_path, capsys):
    """The same case in a folder marked as generated, not KiTS19 (data_loading.synthetic's marker):
    which spacing is the scan's has no reference answer there; refused, naming the case."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    write_stale_pixdim_case(raw, 4)
    synthetic.write_marker(str(raw), seed=0, size="small", ids=[4])
    code = preprocess_dataset.main(["--data_dir", str(raw), "--results_dir", str(out), "--num_workers", "1"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and len(err) == 1 and "case_00004" in err[0] and "not KiTS19" in err[0], err
    assert not (out / "case_00004_x.npy").exists()
