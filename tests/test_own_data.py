"""Own data (issue 51, the preprocessing part): a dataset description, KiTS23's layout and label 3,
nnU-Net's flat layout, a median target spacing, an evaluation split, the fingerprint, a non-zero
exit when nothing is preprocessed, and the data loader's refusal of labels other than KiTS19's.

Oracles: nibabel reads the raw files back (label counts, foreground intensities, spacings: brute
force with numpy), the reference's calls transcribed in test_preprocess (the bytes of every
preprocessed file), and the MLPerf-free arithmetic of the resampled shape."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics

import nibabel
import numpy as np
import pytest

import preprocess_dataset
from data_loading import description as ds
from data_loading import synthetic
from data_loading.data_loader import get_data_loaders
from runtime.arguments import Config
from test_preprocess import npy_bytes, reference_transcription

SHAPE = (12, 14, 16)
KITS23_IDS = (300, 411, 587)   # beyond KiTS19's 210, up to KiTS23's last


def write_kits23(raw, ids=KITS23_IDS, layout="case_folders", cyst=True, spacings=None):
    """Tiny KiTS23-like cases (a cyst, label 3, in each when ``cyst``) and their description."""
    for n, case_id in enumerate(ids):
        spacing = (spacings or {}).get(case_id, (2.0 + 0.25 * n, 1.5, 1.4))
        case = synthetic.make_case(case_id, SHAPE, spacing, synthetic.case_rng(3, case_id), cyst=cyst)
        synthetic.save_case(case, str(raw), labelled=True, layout=layout)
    os.makedirs(raw, exist_ok=True)
    synthetic.write_description(str(raw), layout)
    return raw


def preprocess(*args):
    return preprocess_dataset.main([*map(str, args), "--num_workers", "1"])


def raw_pair(raw, case_id, layout="case_folders"):
    name = f"case_{case_id:05d}"
    if layout == "imagesTr":
        return raw / "imagesTr" / f"{name}_0000.nii.gz", raw / "labelsTr" / f"{name}.nii.gz"
    return raw / name / "imaging.nii.gz", raw / name / "segmentation.nii.gz"


def test_a_kits23_set_preprocesses_with_its_description_and_fingerprint(tmp_path, capsys):
    """Ids beyond 210 and label 3: every case preprocessed (the reference's calls, byte for byte),
    the description saved with the outputs, the fingerprint's label counts and foreground
    intensities those of the raw files read by nibabel."""
    raw, out = write_kits23(tmp_path / "raw"), tmp_path / "out"
    assert preprocess("--data_dir", raw, "--results_dir", out) == 0
    printed = capsys.readouterr().out
    assert "3 cases preprocessed" in printed and "cyst (3)" in printed
    for case_id in KITS23_IDS:
        name = f"case_{case_id:05d}"
        ref_x, ref_y = reference_transcription(raw / name)
        assert (out / f"{name}_x.npy").read_bytes() == npy_bytes(ref_x)
        assert (out / f"{name}_y.npy").read_bytes() == npy_bytes(ref_y)
    saved = json.loads((out / ds.DESCRIPTION_FILE).read_text())
    assert saved["labels"] == synthetic.KITS23_LABELS and saved["written_by"] == ds.WRITTEN_BY
    fingerprint = json.loads((out / ds.FINGERPRINT_FILE).read_text())
    labels = [np.asarray(nibabel.load(str(raw_pair(raw, i)[1])).dataobj) for i in KITS23_IDS]
    images = [nibabel.load(str(raw_pair(raw, i)[0])).get_fdata() for i in KITS23_IDS]
    for name, value in synthetic.KITS23_LABELS.items():
        assert fingerprint["labels"][name]["voxels"] == sum(int((y == value).sum()) for y in labels)
        assert fingerprint["labels"][name]["cases"] == 3 and fingerprint["labels"][name]["voxels"] > 0
    foreground = np.concatenate([x[y > 0] for x, y in zip(images, labels)])
    intensity = fingerprint["foreground_intensity_properties_per_channel"]["0"]
    assert intensity["voxels"] == foreground.size
    assert intensity["mean"] == pytest.approx(foreground.mean(), rel=1e-9)
    assert intensity["std"] == pytest.approx(foreground.std(), rel=1e-9)
    assert (intensity["min"], intensity["max"]) == (foreground.min(), foreground.max())
    per_case = [np.percentile(x[y > 0], 99.5) for x, y in zip(images, labels)]
    assert intensity["percentile_99_5"] == pytest.approx(statistics.median(per_case))
    assert fingerprint["spacings"] == [nibabel.load(str(raw_pair(raw, i)[0])).header["pixdim"][1:4].tolist()
                                       for i in KITS23_IDS]


def test_nnunets_flat_layout_gives_the_same_files(tmp_path):
    """imagesTr/labelsTr with nnU-Net's own dataset.json (no "layout" key): the same cases as in
    case folders, the same bytes."""
    folders = write_kits23(tmp_path / "folders")
    flat = write_kits23(tmp_path / "flat", layout="imagesTr")
    nnunet = {"channel_names": {"0": "CT"}, "labels": synthetic.KITS23_LABELS, "numTraining": 3,
              "file_ending": ".nii.gz"}
    (flat / ds.DESCRIPTION_FILE).write_text(json.dumps(nnunet))
    for raw in (folders, flat):
        assert preprocess("--data_dir", raw, "--results_dir", tmp_path / f"out-{raw.name}") == 0
    arrays = sorted(n for n in os.listdir(tmp_path / "out-folders") if n.endswith(".npy"))
    assert len(arrays) == 6
    for name in arrays:
        assert (tmp_path / "out-flat" / name).read_bytes() == (tmp_path / "out-folders" / name).read_bytes()


def test_median_target_spacing_is_the_datas(tmp_path):
    spacings = {300: (2.0, 1.5, 1.4), 411: (3.0, 1.0, 0.9), 587: (2.5, 0.8, 1.1)}
    raw, out = write_kits23(tmp_path / "raw", spacings=spacings), tmp_path / "out"
    assert preprocess("--data_dir", raw, "--results_dir", out, "--target_spacing", "median") == 0
    headers = [nibabel.load(str(raw_pair(raw, i)[0])).header["pixdim"][1:4].tolist() for i in KITS23_IDS]
    median = [statistics.median(axis) for axis in zip(*headers)]
    for case_id, spacing in zip(KITS23_IDS, headers):
        record = json.loads((out / f"case_{case_id:05d}_geometry.json").read_text())
        assert record["target_spacing"] == median
        assert record["resampled_shape"] == ([*SHAPE] if spacing == median else
                                             [int(s / t * n) for s, t, n in zip(spacing, median, SHAPE)])
    saved = json.loads((out / ds.DESCRIPTION_FILE).read_text())
    assert saved["target_spacing"] == median and saved["target_spacing_from"] == "median"


def test_nothing_to_preprocess_is_a_one_line_error(tmp_path, capsys):
    """KiTS23's folders without a description: every id is beyond KiTS19's, nothing to do:
    exit 1, one line saying why, no results folder made."""
    raw = write_kits23(tmp_path / "raw")
    os.remove(raw / ds.DESCRIPTION_FILE)
    code = preprocess("--data_dir", raw, "--results_dir", tmp_path / "out")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and len(err) == 1 and "nothing to preprocess" in err[0] and "description" in err[0], err
    assert not (tmp_path / "out").exists()


def kits21_like(tmp_path):
    """KiTS19's three labels in KiTS21's id range (a description naming them)."""
    raw = write_kits23(tmp_path / "raw", cyst=False)
    (raw / ds.DESCRIPTION_FILE).write_text(json.dumps({"labels": {"background": 0, "kidney": 1, "tumor": 2}}))
    return raw


def test_an_evaluation_split_given_on_the_command_line_is_the_loaders(tmp_path):
    raw, out = kits21_like(tmp_path), tmp_path / "out"
    (tmp_path / "split.txt").write_text("# held out\ncase_00411\n")
    assert preprocess("--data_dir", raw, "--results_dir", out, "--evaluation_cases", tmp_path / "split.txt") == 0
    assert json.loads((out / ds.DESCRIPTION_FILE).read_text())["evaluation_cases"] == ["00411"]
    cfg = dataclasses.replace(Config(), data_dir=str(out), input_shape=(32, 32, 32), val_input_shape=(32, 32, 32),
                              seed=1, num_workers=0, prefetch=0, batch_size=1, cache="memory")
    train, val = get_data_loaders(cfg, 1, 0)
    assert [c.case_id for c in val.cases] == ["00411"] and train.num_cases == 2


@pytest.mark.parametrize("lines, named", [("case_00299\n", "case 00299 is not"), ("300\n411\n587\n", "none is left"),
                                          ("kidney\n", "names no case id")])
def test_a_bad_split_is_one_line(tmp_path, capsys, lines, named):
    raw = kits21_like(tmp_path)
    (tmp_path / "split.txt").write_text(lines)
    code = preprocess("--data_dir", raw, "--results_dir", tmp_path / "out", "--evaluation_cases", tmp_path / "split.txt")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and len(err) == 1 and "split.txt" in err[0] and named in err[0], err


def write_preprocessed(folder, labels):
    """Two preprocessed cases (ids 0 and 3: KiTS19's split has 3) and a description of ``labels``."""
    os.makedirs(folder, exist_ok=True)
    for case in (0, 3):
        y = np.zeros((1, 32, 32, 32), np.uint8)
        y[0, 4:12, 4:12, 4:12] = 1
        np.save(folder / f"case_{case:05d}_x.npy", np.zeros((1, 32, 32, 32), np.float32))
        np.save(folder / f"case_{case:05d}_y.npy", y)
    record = dataclasses.replace(ds.KITS19, labels=tuple(labels.items())).record([1.6, 1.2, 1.2], "kits19")
    (folder / ds.DESCRIPTION_FILE).write_text(json.dumps(record))


@pytest.mark.parametrize("labels", [synthetic.KITS23_LABELS, {"background": 0, "organ": 1}])
def test_the_loader_takes_the_descriptions_label_set(tmp_path, labels):
    """Four labels, or a binary set: loaded with the description's label count (the run's label
    set, runtime.labels), no longer refused; tests/test_labels.py trains and scores them."""
    write_preprocessed(tmp_path, labels)
    cfg = dataclasses.replace(Config(), exec_mode="evaluate", data_dir=str(tmp_path), seed=1, num_workers=0,
                              prefetch=0, batch_size=1, cache="memory", val_input_shape=(32, 32, 32))
    train, val = get_data_loaders(cfg, 1, 0)   # ids 0 and 3: KiTS19's evaluation cases
    assert val.n_class == train.n_class == len(labels)


BAD_DESCRIPTIONS = {
    "gap": ({"labels": {"background": 0, "kidney": 2}}, "without gaps"),
    "regions": ({"labels": {"background": 0, "kidney": [1, 2]}}, "region labels"),
    "channels": ({"labels": {"background": 0, "kidney": 1}, "channel_names": {"0": "CT", "1": "PET"}}, "one channel"),
    "spacing": ({"labels": {"background": 0, "kidney": 1}, "target_spacing": [1, 2]}, "target_spacing"),
    "layout": ({"labels": {"background": 0, "kidney": 1}, "layout": "nested"}, "layout"),
    "not_json": ("{labels", "not valid JSON"),
}


@pytest.mark.parametrize("kind", sorted(BAD_DESCRIPTIONS))
def test_a_bad_description_is_one_line_naming_it(tmp_path, capsys, kind):
    content, named = BAD_DESCRIPTIONS[kind]
    raw = write_kits23(tmp_path / "raw", ids=(300,))
    (raw / ds.DESCRIPTION_FILE).write_text(content if isinstance(content, str) else json.dumps(content))
    code = preprocess("--data_dir", raw, "--results_dir", tmp_path / "out")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and len(err) == 1 and "dataset.json" in err[0] and named in err[0], err
    assert not (tmp_path / "out").exists()


def test_label_values_beyond_the_description_are_named(tmp_path, capsys):
    """Label 3 in a set described with KiTS19's three labels: the case and the allowed values named."""
    raw = kits21_like(tmp_path)
    case = synthetic.make_case(411, SHAPE, (2.0, 1.5, 1.5), synthetic.case_rng(0, 411), cyst=True)
    synthetic.save_case(case, str(raw), labelled=True)
    code = preprocess("--data_dir", raw, "--results_dir", tmp_path / "out")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and err == ["preprocess_dataset.py: error: case_00411: label values outside {0, 1, 2}: 3"]


def test_a_described_run_refuses_a_folder_of_other_cases(tmp_path, capsys):
    """Never mix: a folder preprocessed with another description (or KiTS19's cases, or the other
    way round) is refused in one line before any case is written."""
    raw, out = write_kits23(tmp_path / "raw", ids=(300,)), tmp_path / "out"
    assert preprocess("--data_dir", raw, "--results_dir", out) == 0
    before = {n: (out / n).stat().st_mtime_ns for n in os.listdir(out)}
    capsys.readouterr()
    assert preprocess("--data_dir", raw, "--results_dir", out, "--target_spacing", "2,2,2") == 1
    assert "preprocessed with another description" in capsys.readouterr().err
    assert {n: (out / n).stat().st_mtime_ns for n in os.listdir(out)} == before


def test_the_generator_makes_kits23_like_sets(tmp_path):
    ids = synthetic.generate(str(tmp_path), cases=1, seed=2, size="small", start_id=500, labels="kits23")
    label = np.asarray(nibabel.load(str(tmp_path / "case_00500" / "segmentation.nii.gz")).dataobj)
    assert ids == [500] and set(np.unique(label)) == {0, 1, 2, 3}
    assert ds.load_description(str(tmp_path / ds.DESCRIPTION_FILE)).label_values == (0, 1, 2, 3)
