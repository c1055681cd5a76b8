"""Training, evaluate and predict on a dataset's own label set (issue 51, items 2-4): the label set
decided from the checkpoint and the data's description, each label's Dice named after it and
scored as nnU-Net reports it (absent from both: NaN, left out of the means), KiTS19 unchanged.
The oracles: brute-force counts of the label maps, and the rules' words for the division."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import types

import numpy as np
import pytest
import torch

from data_loading import description as ds
from data_loading.data_loader import get_data_loaders
from data_loading.dataset import DataError
from model.losses import DiceScore
from runtime import labels as L
from runtime.arguments import Config
from runtime.clocked.evaluation import evaluate
from runtime.division import data_reasons
from runtime.run_files import EVAL, check_record

KITS23 = (("background", 0), ("kidney", 1), ("tumor", 2), ("cyst", 3))
BINARY = (("background", 0), ("organ", 1))


# -- the decision ------------------------------------------------------------------------------

OWN23, OWN_BINARY = L.LabelSet(KITS23), L.LabelSet(BINARY)  # own data: nnU-Net's Dice


def test_the_label_set_is_the_datas_and_a_checkpoints_must_be_it():
    assert L.decide_label_set(None, None)[0] == L.KITS19_SET                         # KiTS19 by default
    assert L.decide_label_set(OWN23, None, "c.pt") == (OWN23, "the checkpoint c.pt's")  # predict: no data read
    label_set, why = L.decide_label_set(None, OWN23, "", "d/dataset.json")
    assert label_set == OWN23 and "d/dataset.json" in why and "nnU-Net" in why
    # the data chooses the Dice: KiTS19's labels in a described folder are scored as nnU-Net's
    named_alike = L.LabelSet(L.KITS19_LABELS)
    assert L.decide_label_set(L.KITS19_SET, named_alike, "c.pt", "d")[0].dice == L.NNUNET
    assert L.decide_label_set(named_alike, L.KITS19_SET, "c.pt", "")[0].dice == L.BENCHMARK
    with pytest.raises(L.LabelError) as info:
        L.decide_label_set(L.KITS19_SET, OWN23, "c.pt", "d/dataset.json")
    message = str(info.value)
    assert "\n" not in message and "c.pt" in message and "d/dataset.json" in message and "cyst 3" in message
    fine_tuned, why = L.decide_label_set(L.KITS19_SET, OWN23, "c.pt", "d/dataset.json", fine_tune=True)
    assert fine_tuned == OWN23 and "fine-tuned" in why
    assert L.as_labels({"background": 0, "cyst": 3, "kidney": 1, "tumor": 2}) == KITS23   # a dict, ordered by value


def test_metric_names_follow_the_data_and_kits19_keeps_the_benchmarks():
    assert L.KITS19_SET.keys == ("l1_dice", "l2_dice")
    assert L.LabelSet(L.KITS19_LABELS).keys == ("kidney_dice", "tumor_dice")        # a described folder: names
    assert OWN23.keys == ("kidney_dice", "tumor_dice", "cyst_dice")
    assert OWN_BINARY.keys == ("organ_dice",)                                        # one Dice, not two
    odd = L.LabelSet((("background", 0), ("Left Kidney", 1), ("mean", 2), ("l3", 3), ("", 4)))
    assert odd.keys == ("left_kidney_dice", "l2_dice", "l3_dice", "l4_dice")
    for keys in (OWN23.keys, odd.keys):
        check_record(EVAL, ["epoch", "mean_dice", *keys])                           # log.json takes them
    with pytest.raises(ValueError):
        check_record(EVAL, ["kidney_volume"])


def test_the_division_names_own_data():
    from runtime.division import own_data_reason

    described = ds.parse_description({"name": "KiTS23", "labels": dict(KITS23)}, "d/dataset.json")
    assert own_data_reason(described).startswith("own data: d/dataset.json describes KiTS23 (labels background 0")
    assert not any("synthetic" in r for r in data_reasons(4, 2, ""))
    assert data_reasons(168, 42) == []


# -- the Dice of own data ----------------------------------------------------------------------

def brute_force_dice(prediction: np.ndarray, truth: np.ndarray, value: int) -> float:
    """nnU-Net's per-label Dice counted voxel by voxel: 2TP / (2TP + FP + FN), NaN when the label
    is in neither."""
    tp = fp = fn = 0
    for p, t in zip(prediction.ravel().tolist(), truth.ravel().tolist()):
        tp += p == value and t == value
        fp += p == value and t != value
        fn += p != value and t == value
    return math.nan if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)


def logits_of(labels: np.ndarray, n_class: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.as_tensor(labels).long(), n_class).movedim(-1, 0)[None].float() * 5


def test_own_datas_dice_is_nnunets_and_kits19s_the_benchmarks():
    rng = np.random.default_rng(0)
    truth = rng.integers(0, 3, (6, 5, 4))            # no cyst (3) anywhere
    prediction = rng.integers(0, 3, (6, 5, 4))
    ours = DiceScore(absent_nan=True)(logits_of(prediction, 4), torch.as_tensor(truth)[None, None])
    expected = [brute_force_dice(prediction, truth, v) for v in (1, 2, 3)]
    assert math.isnan(expected[2]) and math.isnan(float(ours[2]))
    np.testing.assert_allclose(ours[:2].numpy(), expected[:2], rtol=1e-6)
    benchmark = DiceScore()(logits_of(prediction, 4), torch.as_tensor(truth)[None, None])
    assert float(benchmark[2]) == pytest.approx(1.0)                                # KiTS19's: 1.0


def test_evaluation_leaves_a_label_absent_from_both_out_of_the_means():
    """Two volumes: the cyst is in one only. nnU-Net's mean over the cases that have the label,
    and mean_dice over the labels; KiTS19's label set keeps the benchmark's numbers."""
    rng = np.random.default_rng(1)
    shape = (8, 8, 8)
    cases = []
    for n in range(2):
        truth = rng.integers(0, 3, shape)
        prediction = np.where(rng.random(shape) < 0.7, truth, rng.integers(0, 3, shape))
        if n == 0:
            truth[:2, :2, :2] = 3
            prediction[:2, :2, :3] = 3
        cases.append((prediction, truth))
    volumes = [(torch.zeros(1, 1, *shape), torch.as_tensor(t, dtype=torch.uint8)[None, None], f"{n:05d}")
               for n, (_, t) in enumerate(cases)]
    logits = {f"{n:05d}": logits_of(p, 4) for n, (p, _) in enumerate(cases)}
    order = iter(logits.values())

    def predict(batch):  # one window covers the volume: the case's fixed logits
        return next(order)

    from model.losses import DiceCELoss

    whole = lambda case, shape: tuple(slice(0, s) for s in shape)  # noqa: E731 - no padding
    metrics = evaluate(predict, volumes, DiceCELoss(), DiceScore(absent_nan=True), shape, 0.5, 1,
                       torch.device("cpu"), scan_region=whole, label_set=OWN23)
    per_case = [[brute_force_dice(p, t, v) for v in (1, 2, 3)] for p, t in cases]
    expected = [float(np.nanmean([c[i] for c in per_case])) for i in range(3)]
    assert math.isnan(per_case[1][2])
    for key, value in zip(("kidney_dice", "tumor_dice", "cyst_dice"), expected):
        assert metrics[key] == pytest.approx(value, rel=1e-6)
    assert metrics["mean_dice"] == pytest.approx(np.mean(expected), rel=1e-6)
    assert "l1_dice" not in metrics and metrics["eval_cases"] == 2


def test_the_plan_holds_the_datas_label_set_before_the_clock():
    """The plan's ``labels`` and ``dice`` (fields and Decisions, recorded once), decided in the
    first stage from the data's description (read before ``run_start``) and the checkpoint; the
    data stage decides them no more; a checkpoint of other labels is refused in one line; a
    described folder named like KiTS19 still scores nnU-Net's Dice."""
    from main_runs import TINY
    from runtime.arguments import UsageError, parse_args
    from runtime.checkpoint import Saved
    from runtime.distributed import DistInfo
    from runtime.resolve import resolve, resolve_data

    cpu = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    summary = types.SimpleNamespace(num_train=6, num_eval=2, train_bytes=0, synthetic="")
    described = ds.parse_description({"name": "KiTS23", "labels": dict(KITS23)}, "d/dataset.json")
    config = parse_args(TINY)
    plan = resolve(config, cpu)
    assert plan.network.label_set == L.KITS19_SET and plan.decision("labels").value == L.KITS19_LABELS
    assert plan.decision("dice").value == L.BENCHMARK
    plan = resolve(config, cpu, dataset=described)
    assert plan.network.label_set.labels == KITS23 and plan.network.label_set.dice == L.NNUNET
    assert "d/dataset.json" in plan.why("labels")
    data_plan = resolve_data(plan, cpu, summary)
    assert data_plan.network.label_set == OWN23 and [d.name for d in data_plan.decisions].count("labels") == 1
    named_alike = ds.parse_description({"labels": dict(L.KITS19_LABELS)}, "k/dataset.json")
    assert resolve(config, cpu, dataset=named_alike).network.label_set == L.LabelSet(L.KITS19_LABELS, L.NNUNET)

    binary = {"config": {"plan": [{"name": "labels", "value": [list(pair) for pair in BINARY]}]}}
    plan = resolve(config, cpu, None, Saved("b.pt", binary, resume=False),
                   dataset=ds.parse_description({"labels": dict(BINARY)}, "b/dataset.json"))
    assert plan.network.label_set.labels == BINARY and "b/dataset.json" in plan.why("labels")
    with pytest.raises(UsageError) as info:
        resolve(config, cpu, None, Saved("b.pt", binary, resume=False), dataset=described)
    assert "\n" not in str(info.value) and "organ 1" in str(info.value) and "cyst 3" in str(info.value)


# -- the data ----------------------------------------------------------------------------------

def write_preprocessed(folder, labels, cyst_value=3, ids=(1, 2, 3)):
    """Preprocessed 32³ cases (3 is an evaluation id of KiTS19's split) with labels 1.. and a
    description of ``labels``."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(5)
    for case in ids:
        x = rng.normal(0, 0.1, (1, 32, 32, 32)).astype(np.float32)
        y = np.zeros((1, 32, 32, 32), np.uint8)
        for value in range(1, len(labels)):
            start = 4 + 6 * (value - 1)
            y[0, start:start + 5, 8:20, 8:20] = cyst_value if value == 3 else value
            x[0, start:start + 5, 8:20, 8:20] += value
        np.save(os.path.join(folder, f"case_{case:05d}_x.npy"), x)
        np.save(os.path.join(folder, f"case_{case:05d}_y.npy"), y)
        write_geometry(folder, f"case_{case:05d}", (32, 32, 32))
    record = dataclasses.replace(ds.KITS19, labels=tuple(dict(labels).items())).record([1.6, 1.2, 1.2], "kits19")
    with open(os.path.join(folder, ds.DESCRIPTION_FILE), "w") as handle:
        json.dump(record, handle)
    return str(folder)


def write_geometry(folder, name, shape) -> None:
    """The case's geometry record, as preprocessing writes it: a scan of ``shape`` at the target
    spacing, no padding (own data is scored on the scan's own voxels)."""
    from data_loading import geometry

    record = geometry.geometry_record(name, shape, [1.6, 1.2, 1.2], [1.6, 1.2, 1.2], shape, [(0, 0)] * 3)
    with open(geometry.record_path(str(folder), name), "wb") as handle:
        handle.write(geometry.record_bytes(record))


def loader_config(folder) -> Config:
    return dataclasses.replace(Config(), data_dir=str(folder), input_shape=(32, 32, 32), seed=1, num_workers=0,
                               prefetch=0, batch_size=1, cache="memory", val_input_shape=(32, 32, 32))


def test_the_loaders_take_the_descriptions_labels(tmp_path):
    """KiTS23's four labels load (the cyst's boxes among the foreground to oversample); a label
    value beyond the description's is named in one line."""
    train, val = get_data_loaders(loader_config(write_preprocessed(tmp_path / "ok", KITS23)), 1, 0)
    assert sorted(train.dataset.boxes[0]) == [1, 2, 3] and len(train.dataset.boxes[0][3]) == 1
    assert val.n_class == 4
    bad = write_preprocessed(tmp_path / "bad", KITS23)
    with open(os.path.join(bad, ds.DESCRIPTION_FILE)) as handle:
        record = json.load(handle)
    record["labels"] = dict(L.KITS19_LABELS)        # the cases hold a cyst (3) the description has not
    with open(os.path.join(bad, ds.DESCRIPTION_FILE), "w") as handle:
        json.dump(record, handle)
    with pytest.raises(DataError) as info:
        get_data_loaders(loader_config(bad), 1, 0)
    assert "\n" not in str(info.value) and "outside 0..2" in str(info.value) and "_y.npy" in str(info.value)


# -- a run on own labels -----------------------------------------------------------------------

TINY_REAL = ["--filters", "2", "4", "4", "8", "8", "--input_shape", "32", "32", "32", "--val_input_shape", "32", "32",
             "32", "--normalization", "batchnorm", "--batch_size", "2", "--num_workers", "0", "--device", "cpu",
             "--seed", "1"]
EVAL_FLAGS = ["--filters", "2", "4", "4", "8", "8", "--val_input_shape", "32", "32", "32", "--normalization",
              "batchnorm", "--device", "cpu"]


@pytest.mark.slow
def test_a_binary_set_trains_evaluates_and_reports_one_dice(tmp_path, capsys):
    """One foreground label: a network of two outputs (built once, before run_start, from the
    folder's description), one Dice named after it (not a second, always-empty one scoring 1.0),
    the label set in the checkpoint, evaluate from the checkpoint alone, and a checkpoint of
    another label set refused in one line."""
    from main_runs import call, one_line_error
    from runtime.checkpoint import Saved, load_checkpoint, model_state_from, trained_network

    data, run = write_preprocessed(tmp_path / "data", BINARY), tmp_path / "run"
    code, out, err = call(["--data_dir", data, "--log_dir", str(run), "--save_ckpt_path", str(run / "ckpt.pt"),
                           *TINY_REAL, "--epochs", "1", "--start_eval_at", "1", "--evaluate_every", "1"], capsys)
    assert code in (0, 3), err[-2000:]                       # 3: a tiny run that did not converge
    assert "built again" not in out                    # the description read before run_start: built once
    (record,) = [r for r in map(json.loads, (run / "log.json").read_text().splitlines()) if r["kind"] == "eval"]
    assert "organ_dice" in record and "l1_dice" not in record and "l2_dice" not in record
    assert record["mean_dice"] == record["organ_dice"]
    assert f"mean_dice {record['mean_dice']:.4f} (organ {record['organ_dice']:.4f})" in out
    checkpoint = load_checkpoint(str(run / "ckpt.pt"))
    assert trained_network(Saved("c.pt", checkpoint, resume=False)).label_set == OWN_BINARY
    assert model_state_from(checkpoint)["output.conv.weight"].shape[0] == 2

    code, out, err = call(["--exec_mode", "evaluate", "--data_dir", data, "--load_ckpt_path", str(run / "ckpt.pt"),
                           "--log_dir", str(tmp_path / "eval"), *EVAL_FLAGS], capsys)
    assert code == 0, err[-2000:]
    assert "organ_dice" in out and "l1_dice" not in out
    with open(tmp_path / "eval" / "eval_cases.csv") as handle:
        assert handle.readline().startswith("case,organ_dice,mean_dice,eval_loss")

    other = write_preprocessed(tmp_path / "kits23", KITS23)
    code, out, err = call(["--exec_mode", "evaluate", "--data_dir", other, "--load_ckpt_path", str(run / "ckpt.pt"),
                           "--log_dir", str(tmp_path / "eval23"), *EVAL_FLAGS], capsys)
    one_line_error(code, err, run / "ckpt.pt", "organ 1", "cyst 3")


@pytest.mark.slow
def test_four_labels_train_above_chance_evaluate_and_predict_named(tmp_path, capsys):
    """KiTS23's four labels: a tiny network trained a few epochs scores every label above chance
    (the Dice of calling the whole volume that label), evaluate and predict name the labels; a
    KiTS23-like raw case (label 3) is predicted and scored with the checkpoint alone."""
    from data_loading import synthetic
    from main_runs import call

    data, run = write_preprocessed(tmp_path / "data", KITS23, ids=(1, 2, 4, 3)), tmp_path / "run"
    wider = [*TINY_REAL[TINY_REAL.index("--input_shape"):], "--filters", "8", "8", "8", "8", "8"]
    code, out, err = call(["--data_dir", data, "--log_dir", str(run), "--save_ckpt_path", str(run / "ckpt.pt"),
                           *wider, "--optimizer", "adam", "--learning_rate", "0.01",
                           "--epochs", "30", "--start_eval_at", "30", "--evaluate_every", "30"], capsys)
    assert code in (0, 3), err[-2000:]
    (record,) = [r for r in map(json.loads, (run / "log.json").read_text().splitlines()) if r["kind"] == "eval"]
    truth = np.load(os.path.join(data, "case_00003_y.npy"))
    for key, value in zip(OWN23.keys, (1, 2, 3)):
        p = float(np.mean(truth == value))
        assert record[key] > 2 * p / (1 + p), (key, record)            # above chance, every label

    code, out, err = call(["--exec_mode", "evaluate", "--data_dir", data, "--load_ckpt_path", str(run / "ckpt.pt"),
                           "--log_dir", str(tmp_path / "eval"), "--val_input_shape", "32", "32", "32", "--device",
                           "cpu"], capsys)   # the network's flags and labels from the checkpoint
    assert code == 0 and "kidney_dice" in out and "tumor_dice" in out and "cyst_dice" in out, err[-2000:]

    raw = tmp_path / "raw"
    case = synthetic.make_case(411, (12, 14, 16), (2.0, 1.5, 1.4), synthetic.case_rng(3, 411), cyst=True)
    synthetic.save_case(case, str(raw), labelled=True)
    code, out, err = call(["--exec_mode", "predict", "--input", str(raw / "case_00411"), "--output_dir",
                           str(tmp_path / "pred"), "--load_ckpt_path", str(run / "ckpt.pt"), "--device", "cpu",
                           "--val_input_shape", "128", "128", "128"], capsys)
    assert code == 0, err[-2000:]
    header = (tmp_path / "pred" / "summary.csv").read_text().splitlines()[0].split(",")
    assert {"kidney_ml", "tumor_ml", "cyst_ml", "kidney_dice", "tumor_dice", "cyst_dice"} <= set(header)
    assert "cyst" in out and "dice kidney" in out


@pytest.mark.slow
def test_generated_kits23_cases_train_above_chance_on_every_label(tmp_path, capsys):
    """docs/own-data.md's KiTS23 commands on the generator's cases: generated (``--labels
    kits23``), preprocessed with the description beside them, trained by main.py on a small
    network (32³ patches); every label's Dice on the two evaluation cases is above chance (the
    mean over those cases of the Dice of calling the whole stored volume that label, 2p/(1+p))."""
    import preprocess_dataset
    from data_loading import synthetic
    from main_runs import call

    raw, data, run, split = tmp_path / "raw", tmp_path / "data", tmp_path / "run", tmp_path / "split.txt"
    assert synthetic.main(["--output_dir", str(raw), "--cases", "6", "--start_id", "400", "--labels", "kits23"]) == 0
    split.write_text("case_00404\ncase_00405\n")
    assert preprocess_dataset.main(["--data_dir", str(raw), "--results_dir", str(data), "--evaluation_cases",
                                    str(split), "--num_workers", "1"]) == 0
    code, out, err = call(["--data_dir", str(data), "--log_dir", str(run), "--filters", "8", "8", "8", "8", "8",
                           "--input_shape", "32", "32", "32", "--normalization", "batchnorm", "--batch_size", "2",
                           "--optimizer", "adam", "--learning_rate", "0.01", "--epochs", "120", "--start_eval_at",
                           "120", "--evaluate_every", "120", "--oversampling", "0.9", "--semantics", "project",
                           "--num_workers", "0", "--device", "cpu", "--seed", "1"], capsys)
    assert code in (0, 3), err[-2000:]
    assert "built again" not in out
    (record,) = [r for r in map(json.loads, (run / "log.json").read_text().splitlines()) if r["kind"] == "eval"]
    truths = [np.load(data / f"case_{case:05d}_y.npy") for case in (404, 405)]
    for key, value in zip(OWN23.keys, (1, 2, 3)):
        chance = np.mean([2 * p / (1 + p) for p in (float(np.mean(truth == value)) for truth in truths)])
        assert record[key] > chance, (key, chance, record)           # above chance, every label
