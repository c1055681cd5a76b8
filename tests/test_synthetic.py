"""Synthetic KiTS19 generator: layout, header conventions, contents, determinism."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import nibabel
import numpy as np
import pytest

from data_loading import synthetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET32 = [float(np.float32(v)) for v in (1.6, 1.2, 1.2)]


def load(folder, name):
    image = nibabel.load(os.path.join(folder, name))
    return image, np.asanyarray(image.dataobj)


@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
    raw = tmp_path_factory.mktemp("synthetic")
    synthetic.generate(str(raw), cases=4, seed=3, size="small")
    return raw


def test_kits19_layout_and_header_conventions(small_set):
    assert sorted(os.listdir(small_set)) == [f"case_{i:05d}" for i in range(4)] + [synthetic.MARKER_NAME]
    for case_id in range(4):
        folder = small_set / f"case_{case_id:05d}"
        image, pixels = load(folder, "imaging.nii.gz")
        seg, labels = load(folder, "segmentation.nii.gz")
        assert pixels.dtype == np.int16 and labels.dtype == np.uint8
        assert pixels.shape == labels.shape and pixels.shape[1] == pixels.shape[2]
        spacing = image.header["pixdim"][1:4].tolist()
        assert spacing == seg.header["pixdim"][1:4].tolist()
        # axis 0 is the slice axis: the affine maps it to z with the slice thickness
        assert np.allclose(np.abs(image.affine[:3, :3]).sum(axis=0), spacing)
        assert np.abs(image.affine[2, 0]) == pytest.approx(spacing[0])
        if case_id % 4 == 0:
            assert spacing == TARGET32  # float32 header of exactly the target spacing
        else:
            assert spacing[0] != spacing[1] and spacing[1] == spacing[2]  # anisotropic
        # small preset: 60-150 voxels per axis, about 112-150 after resampling
        assert all(60 <= n <= 150 for n in pixels.shape)
        resampled = [int(s / t * n) for s, t, n in zip(spacing, (1.6, 1.2, 1.2), pixels.shape)]
        assert all(100 <= n <= 152 for n in resampled), resampled


def test_contents_look_like_ct_with_kidneys_and_tumours(small_set):
    for case_id in range(4):
        _, pixels = load(small_set / f"case_{case_id:05d}", "imaging.nii.gz")
        _, labels = load(small_set / f"case_{case_id:05d}", "segmentation.nii.gz")
        assert set(np.unique(labels)) == {0, 1, 2}
        kidney, tumour = pixels[labels == 1], pixels[labels == 2]
        tissue = pixels[(labels == 0) & (np.abs(pixels - synthetic.SOFT_TISSUE_HU) < 40)]
        assert pixels.min() < -900  # air
        assert abs(kidney.mean() - synthetic.KIDNEY_HU) < 3
        assert abs(tumour.mean() - synthetic.TUMOUR_HU) < 3
        # separable from kidney and from soft tissue by several noise standard deviations
        for other in (kidney, tissue):
            assert abs(tumour.mean() - other.mean()) > 5 * synthetic.NOISE_HU
        # large tumours: a sizeable share of the foreground, in voxels
        assert (labels == 2).sum() > 0.1 * (labels > 0).sum() and (labels == 2).sum() > 500
        # two kidneys: foreground on both sides of the mid-sagittal plane
        width = labels.shape[2]
        assert (labels[..., : width // 2] > 0).any() and (labels[..., width // 2:] > 0).any()


def test_same_seed_same_case_in_any_order_other_seed_differs(small_set):
    case = synthetic.make_case(2, (20, 24, 24), (2.0, 1.5, 1.5), synthetic.case_rng(3, 2))
    again = synthetic.make_case(2, (20, 24, 24), (2.0, 1.5, 1.5), synthetic.case_rng(3, 2))
    other = synthetic.make_case(2, (20, 24, 24), (2.0, 1.5, 1.5), synthetic.case_rng(4, 2))
    assert np.array_equal(case.image, again.image) and np.array_equal(case.label, again.label)
    assert not np.array_equal(case.image, other.image)
    # generating one case alone reproduces it from the whole set
    rng = synthetic.case_rng(3, 2)
    shape, spacing = synthetic.draw_geometry(rng, synthetic.PRESETS["small"], False)
    alone = synthetic.make_case(2, shape, spacing, rng)
    _, pixels = load(small_set / "case_00002", "imaging.nii.gz")
    assert np.array_equal(alone.image, pixels)


def test_presets_reach_the_benchmark_sizes():
    rng = np.random.default_rng(0)
    for _ in range(50):
        shape, spacing = synthetic.draw_geometry(rng, synthetic.PRESETS["realistic"], False)
        resampled = [s / t * n for s, t, n in zip(spacing, (1.6, 1.2, 1.2), shape)]
        assert 300 <= shape[0] <= 600 and shape[1:] == (512, 512)
        assert 165 <= resampled[0] <= 215 and all(225 <= n <= 275 for n in resampled[1:])


def test_cli_writes_unlabelled_ids_without_segmentation(tmp_path):
    result = subprocess.run([sys.executable, "-m", "data_loading.synthetic", "--output_dir",
                             str(tmp_path), "--cases", "2", "--start_id", "209", "--seed", "1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "1 without segmentation" in result.stdout
    assert sorted(os.listdir(tmp_path / "case_00209")) == ["imaging.nii.gz",
                                                          "segmentation.nii.gz"]
    assert os.listdir(tmp_path / "case_00210") == ["imaging.nii.gz"]


def test_cli_rejects_a_bad_flag_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "data_loading.synthetic", "--output_dir",
                             str(tmp_path), "--cases", "-1"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert "--cases" in result.stderr


def test_the_folder_carries_a_marker_naming_it_synthetic(tmp_path):
    """The marker (synthetic.json) says what made the folder, with which seeds and cases; cases
    added later with --start_id are added to it, not written over it."""
    synthetic.generate(str(tmp_path), cases=1, seed=5, size="small")
    synthetic.generate(str(tmp_path), cases=1, seed=6, size="small", start_id=7)
    record = json.loads((tmp_path / synthetic.MARKER_NAME).read_text())
    assert record["synthetic"] is True and record["generator"] == "data_loading.synthetic"
    assert [(g["seed"], g["case_id_range"]) for g in record["generations"]] == [(5, [0, 0]), (6, [7, 7])]
    assert synthetic.read_marker(str(tmp_path)) == record
    assert synthetic.marker_text(record) == "data_loading.synthetic, seed 5, 6"
    assert synthetic.read_marker(str(tmp_path / "case_00000")) is None  # no marker: not synthetic
