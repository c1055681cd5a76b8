"""Dataset discovery, split and validation: every bad input is named in one line."""
import dataclasses
import pickle

import numpy as np
import pytest
import torch

from data_loading.data_loader import get_data_loaders
from data_loading.dataset import (EVALUATION_CASES_FILE, DataError, TrainingSet,
                                  case_foreground_boxes, discover_cases, read_evaluation_ids,
                                  split_cases)
from runtime.arguments import Config

EVAL_IDS = read_evaluation_ids()


def write_case(folder, case, shape=(36, 40, 34), seed=0, image=True, label=True):
    """case_XXXXX_x.npy (float32) and _y.npy (uint8 blobs of classes 1 and 2), (1, *shape)."""
    rng = np.random.default_rng(seed)
    name = f"case_{int(case):05d}"
    if image:
        np.save(folder / f"{name}_x.npy", rng.standard_normal((1, *shape)).astype(np.float32))
    if label:
        y = np.zeros((1, *shape), np.uint8)
        y[0, 4:14, 6:16, 5:17] = 1
        y[0, 7:10, 8:11, 8:12] = 2
        y[0, -8:-3, -9:-2, 2:8] = 1
        np.save(folder / f"{name}_y.npy", y)
    return name


def config(data_dir, **changes):
    base = dict(data_dir=str(data_dir), input_shape=(32, 32, 32), val_input_shape=(32, 32, 32),
                seed=1, num_workers=0, prefetch=0, batch_size=1, cache="memory")
    return dataclasses.replace(Config(), **{**base, **changes})


def one_line_error(cfg, match):
    with pytest.raises(DataError) as info:
        get_data_loaders(cfg, 1, 0)
    message = str(info.value)
    assert "\n" not in message and match in message, message
    return message


def test_evaluation_list_is_the_benchmarks_and_found_from_the_package(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                  # never read relative to the working directory
    ids = read_evaluation_ids()
    assert len(ids) == 42 and len(set(ids)) == 42 and "00003" in ids and "00001" not in ids
    assert EVALUATION_CASES_FILE.is_absolute()


def test_discovery_and_split(tmp_path):
    for case in (0, 1, 2, 3, 7):
        write_case(tmp_path, case)
    (tmp_path / "notes.txt").write_text("ignored")
    cases = discover_cases(tmp_path)
    assert [c.case_id for c in cases] == ["00000", "00001", "00002", "00003", "00007"]
    assert cases[0].shape == (36, 40, 34)
    train, evaluation = split_cases(cases, EVAL_IDS)
    assert [c.case_id for c in evaluation] == ["00000", "00003"]
    assert [c.case_id for c in train] == ["00001", "00002", "00007"]


def test_no_pairs(tmp_path):
    one_line_error(config(tmp_path), "no case_XXXXX_x.npy")


def test_image_without_label(tmp_path):
    write_case(tmp_path, 0)
    write_case(tmp_path, 1, label=False)
    message = one_line_error(config(tmp_path), "case_00001_x.npy")
    assert "no label" in message


def test_label_without_image(tmp_path):
    write_case(tmp_path, 0)
    write_case(tmp_path, 2, image=False)
    assert "no image" in one_line_error(config(tmp_path), "case_00002_y.npy")


def test_shape_mismatch(tmp_path):
    write_case(tmp_path, 0)
    write_case(tmp_path, 1)
    np.save(tmp_path / "case_00001_y.npy", np.zeros((1, 36, 40, 33), np.uint8))
    message = one_line_error(config(tmp_path), "case 00001")
    assert "case_00001_x.npy" in message and "case_00001_y.npy" in message


def test_volume_smaller_than_patch(tmp_path):
    write_case(tmp_path, 0)
    write_case(tmp_path, 1)
    write_case(tmp_path, 2, shape=(36, 31, 40))
    message = one_line_error(config(tmp_path), "case_00002_x.npy")
    assert "--input_shape" in message and "axis 1" in message


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_file(tmp_path, damage):
    write_case(tmp_path, 0)
    write_case(tmp_path, 1)
    path = tmp_path / "case_00001_x.npy"
    data = path.read_bytes()
    path.write_bytes(b"not a numpy file" if damage == "garbage" else data[:len(data) // 2])
    one_line_error(config(tmp_path), "case_00001_x.npy")


def test_label_values_out_of_range(tmp_path):
    write_case(tmp_path, 0)
    write_case(tmp_path, 1)
    np.save(tmp_path / "case_00001_y.npy", np.full((1, 36, 40, 34), 7, np.uint8))
    one_line_error(config(tmp_path), "case_00001_y.npy")


def test_missing_split_sides(tmp_path):
    write_case(tmp_path, 1)
    write_case(tmp_path, 2)
    one_line_error(config(tmp_path), "no evaluation case")
    get_data_loaders(config(tmp_path, benchmark=True), 1, 0)   # benchmarks need no evaluation
    for case in (1, 2):
        for suffix in "xy":
            (tmp_path / f"case_0000{case}_{suffix}.npy").unlink()
    write_case(tmp_path, 0)
    one_line_error(config(tmp_path), "no training cases")


def test_too_few_cases_for_one_batch(tmp_path):
    """One training case at batch 2: the reference's drop (--last_batch drop) has no batch to
    train, one line; the rules' padded last batch (the default) trains that case once per epoch."""
    write_case(tmp_path, 0)
    write_case(tmp_path, 1)
    one_line_error(config(tmp_path, batch_size=2, last_batch="drop"), "no full batch")
    train, _ = get_data_loaders(config(tmp_path, batch_size=2), 1, 0)
    assert len(train) == 1


def test_boxes_computed_once_and_caches_agree(tmp_path):
    for case in (0, 1, 2):
        write_case(tmp_path, case, seed=case)
    cases = discover_cases(tmp_path)
    boxes = [case_foreground_boxes(c) for c in cases]
    assert [b.start for b in boxes[0][1]] == [(4, 6, 5), (28, 31, 2)]
    assert [b.start for b in boxes[0][2]] == [(7, 8, 8)]
    memory = TrainingSet(cases, boxes, (32, 32, 32), 0.5, "reference", seed=4, cache="memory")
    none = TrainingSet(cases, boxes, (32, 32, 32), 0.5, "reference", seed=4, cache="none")
    for key in [(1, 0, 0), (1, 1, 2), (3, 7, 1)]:
        for a, b in zip(memory[key], none[key]):
            assert torch.equal(a, b)
    # a worker receives paths and boxes, not the volumes
    assert len(pickle.dumps(memory)) < 20_000
