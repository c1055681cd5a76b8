"""Two Dice numbers, reconciled: evaluate's (the benchmark's: the preprocessed volume, padding and
the benchmark's resampled labels included) and the Dice inside the scan (padding excluded), with
known answers; where the benchmark's two resampling rules put a box; the geometry record that
preprocessing writes beside its arrays (the arrays and checksums unchanged)."""
import csv
import json
import os

import numpy as np
import pytest
import torch
from torch import nn

from checkpoints import architecture, write_checkpoint
from data_loading import preprocessing as pp
from main_runs import call
from model.losses import DiceCELoss, DiceScore
from runtime.clocked.evaluation import evaluate

SMOOTH = 1e-6


class ValueToClass(nn.Module):
    """A pointwise "model": logits peak at the class whose number the voxel holds (0, 1, 2).
    The sliding window's weighted average of one value is that value, so the argmax is the
    image itself: a prediction chosen voxel by voxel."""

    def forward(self, x):
        return torch.cat([-10.0 * (x - c) ** 2 for c in range(3)], dim=1)


def dice(p, t, c):
    """The benchmark's formula, from numpy counts (an oracle independent of model/losses.py)."""
    p, t = p == c, t == c
    return (2.0 * np.count_nonzero(p & t) + SMOOTH) / (np.count_nonzero(p) + np.count_nonzero(t) + SMOOTH)


def test_a_slab_in_the_padding_lowers_the_benchmark_dice_not_the_dice_inside_the_scan():
    """Stored volume 64^3 whose scan is slices 16..47 (the rest min-shape padding). The prediction
    equals the label inside the scan and has a kidney slab in the padding: the benchmark's Dice
    (the whole volume) is below 1 by the known amount, the Dice inside the scan is exactly 1."""
    label = np.zeros((64, 64, 64), np.uint8)
    zz, yy, xx = np.ogrid[:64, :64, :64]
    label[(zz - 32) ** 2 + (yy - 30) ** 2 + (xx - 34) ** 2 < 12 ** 2] = 1
    label[(zz - 34) ** 2 + (yy - 30) ** 2 + (xx - 36) ** 2 < 5 ** 2] = 2
    label[:16] = label[48:] = 0                                 # padding: background in the stored label
    prediction = label.copy()
    prediction[4:12, 20:40, 20:40] = 1                          # what a model may draw in replicated slices
    region = (slice(16, 48), slice(0, 64), slice(0, 64))
    cases = []
    metrics = evaluate(ValueToClass(), [(torch.from_numpy(prediction.astype(np.float32))[None, None],
                                         torch.from_numpy(label)[None, None], "00007")],
                       DiceCELoss(), DiceScore(), (32, 32, 32), 0.5, 2, torch.device("cpu"), cases=cases,
                       scan_region=lambda case, shape: region)
    assert metrics["l1_dice"] == pytest.approx(dice(prediction, label, 1), abs=1e-6) and metrics["l1_dice"] < 0.9
    assert metrics["l2_dice"] == pytest.approx(1.0, abs=1e-6)
    (case,) = cases
    assert case["case"] == "00007" and case["mean_dice"] == pytest.approx(metrics["mean_dice"], abs=1e-12)
    assert case["scan_kidney_dice"] == case["scan_tumour_dice"] == case["scan_mean_dice"] == pytest.approx(1.0, abs=1e-9)


def legacy_nearest_box(start, stop, size_in, size_out):
    """Output indices j whose source floor(j * in / out) lies in [start, stop)."""
    j = np.arange(size_out)
    inside = (np.floor(j * size_in / size_out) >= start) & (np.floor(j * size_in / size_out) < stop)
    return int(j[inside][0]), int(j[inside][-1]) + 1


def align_corners_box(start, stop, size_in, size_out):
    """Output indices j where the linear interpolation of a 0/1 box [start, stop) at input
    position j * (in - 1) / (out - 1) is above one half."""
    position = np.arange(size_out) * (size_in - 1) / (size_out - 1)
    values = np.interp(position, np.arange(size_in), ((np.arange(size_in) >= start) & (np.arange(size_in) < stop)) * 1.0)
    j = np.flatnonzero(values > 0.5)
    return int(j[0]), int(j[-1]) + 1


@pytest.mark.parametrize("size_in,spacing,box", [(40, 2.0, (10, 20)), (61, 3.0, (20, 33)), (95, 0.8, (30, 61))])
def test_a_box_lands_where_the_two_resampling_rules_put_it(size_in, spacing, box):
    """A box drawn in the original grid (image 1 inside, label 1 inside) along axis 0: after the
    benchmark's resampling, the label's box is where legacy nearest (floor(j*in/out)) puts it and
    the image's (above one half) where trilinear align_corners=True does; the two differ."""
    shape = (size_in, 8, 8)
    image = np.zeros((1, *shape), np.float32)
    image[0, box[0]:box[1]] = 1.0
    label = image.astype(np.uint8)
    spacing_list = [spacing, 1.2, 1.2]
    out_image, out_label = pp.resample(image, label, spacing_list)
    size_out = pp.resampled_shape(shape, spacing_list)[0]
    assert out_label.shape[1] == size_out
    rows = np.flatnonzero(out_label[0, :, 4, 4])
    assert (rows[0], rows[-1] + 1) == legacy_nearest_box(*box, size_in, size_out)
    rows = np.flatnonzero(out_image[0, :, 4, 4] > 0.5)
    assert (rows[0], rows[-1] + 1) == align_corners_box(*box, size_in, size_out)
    assert legacy_nearest_box(*box, size_in, size_out) != align_corners_box(*box, size_in, size_out)


# -------------------------------------------------------------------- the record and evaluate's output

@pytest.fixture(scope="module")
def preprocessed(tmp_path_factory):
    from data_loading.synthetic import generate

    root = tmp_path_factory.mktemp("dice")
    generate(str(root / "raw"), cases=4, seed=1, size="small")      # ids 0-3: 0 and 3 are evaluation cases
    assert pp.preprocess_cases(pp.find_cases(str(root / "raw"))[0], str(root / "data"), 1, lambda s: None)
    return root


def test_preprocessing_writes_a_geometry_record_beside_unchanged_arrays(preprocessed):
    from data_loading import geometry
    from data_loading.scans import read_scan, scan_geometry

    data, raw = preprocessed / "data", preprocessed / "raw"
    for case in pp.find_cases(str(raw))[0]:
        record = json.loads((data / f"{case.name}{geometry.RECORD_SUFFIX}").read_text())
        scan = read_scan(case.image_path)
        expected = scan_geometry(scan.image.shape[1:], scan.spacing)
        assert record["original_shape"] == list(expected.original)
        assert record["resampled_shape"] == list(expected.resampled)
        assert [tuple(p) for p in record["padding"]] == list(expected.padding)
        stored = np.load(data / f"{case.name}_x.npy", mmap_mode="r")
        assert record["padded_shape"] == list(stored.shape[1:])
        image, label, spacing = pp.load_pair(case)                  # the arrays: as without the record
        x, y = pp.preprocess_arrays(image, label, spacing)
        assert np.array_equal(stored, x) and np.array_equal(np.load(data / f"{case.name}_y.npy"), y)
    sums = {n: pp.md5_file(str(data / n)) for n in os.listdir(data) if n.endswith(".npy")}
    assert pp.verify(str(data), sums) == []                         # the records are no "extra" files


def test_a_missing_record_is_written_from_the_header_on_the_next_run(preprocessed, tmp_path, capsys):
    import shutil

    import preprocess_dataset
    from data_loading import geometry

    data = tmp_path / "data"
    shutil.copytree(preprocessed / "data", data)
    record = data / f"case_00001{geometry.RECORD_SUFFIX}"
    before = record.read_bytes()
    record.unlink()
    assert preprocess_dataset.main(["--data_dir", str(preprocessed / "raw"), "--results_dir", str(data),
                                    "--num_workers", "1"]) == 0
    assert "missing case_XXXXX_geometry.json" in capsys.readouterr().out
    assert record.read_bytes() == before


def test_evaluate_says_what_it_scored_and_writes_each_case(preprocessed, tmp_path, capsys):
    write_checkpoint(tmp_path / "w.pt", architecture((2, 4, 4, 8, 8)))
    argv = ["--exec_mode", "evaluate", "--data_dir", str(preprocessed / "data"), "--load_ckpt_path",
            str(tmp_path / "w.pt"), "--filters", "2", "4", "4", "8", "8"]
    code, out, _ = call(argv + ["--log_dir", str(tmp_path / "with")], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("mean_dice ") and "scored: the benchmark's Dice" in out
    inside = next(line for line in lines if line.startswith("inside the scans"))
    assert "NOT the benchmark's number" in inside and "over 2 cases" in inside
    rows = list(csv.DictReader(open(tmp_path / "with" / "eval_cases.csv")))
    assert [r["case"] for r in rows] == ["00000", "00003"]
    mean = np.mean([float(r["mean_dice"]) for r in rows])
    assert f"mean_dice {mean:.4f}" == lines[0]
    scan_mean = np.mean([float(r["scan_mean_dice"]) for r in rows])
    assert f"mean_dice {scan_mean:.4f}" in inside
    # without the records: the benchmark's numbers to the last digit, and no number inside the scans
    data = tmp_path / "bare"
    data.mkdir()
    for name in os.listdir(preprocessed / "data"):
        if name.endswith(".npy"):
            os.symlink(preprocessed / "data" / name, data / name)
    bare = [a if a != str(preprocessed / "data") else str(data) for a in argv]
    code, out_bare, _ = call(bare + ["--log_dir", str(tmp_path / "without")], capsys)
    assert code == 0 and out_bare.splitlines()[:2] == lines[:2]
    assert "inside the scans: unknown" in out_bare
    logged = [json.loads(l) for l in open(tmp_path / "with" / "log.json")][-1]
    assert f"mean_dice {logged['mean_dice']:.4f}" == lines[0]


def test_the_documented_example_runs_and_shows_the_three_causes(capsys):
    """scripts/dice_definitions.py (docs/reliability.md): the stored label is perfect only by the
    benchmark's definition; a slab in the padding costs the benchmark's Dice only."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "dice_definitions", os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "dice_definitions.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([]) == 0
    table = [line.split("|")[2:5] for line in capsys.readouterr().out.splitlines() if line.startswith("| the")]
    values = [[float(cell.split()[0]) for cell in row] for row in table]
    stored, image_way, with_slab = values
    assert stored[0] == stored[1] == 1.0 and stored[2] < 1.0                 # label resampling + grid
    assert image_way[0] < 1.0 and image_way[2] > image_way[0]                # predict's grid reads higher
    assert with_slab[0] < image_way[0] and with_slab[1:] == image_way[1:]    # padding: evaluate only
