"""One dataset, one reading, one number (issue 56): own data, written as nnU-Net v2's raw layout
holds it (RAS, slices last, a spacing per case, a case with an empty label map), scored alike by
training's evaluation, evaluate and the API; the Dice chosen by the data, never by the labels'
names; the headline Dice on the scan's own voxels; nnU-Net's ignore label no class; predict's
truth found where the data keeps it; a network fine-tuned onto another label set.

Oracles: brute-force voxel counts with numpy (nnU-Net's ``2·TP / (2·TP + FP + FN)``, NaN for a
label in neither map), MONAI's ``DiceMetric`` where installed, and the API's ``score`` applied
to the network's own argmax, recomputed here from the checkpoint's weights."""
from __future__ import annotations

import csv
import json
import math
import os

import numpy as np
import pytest
import torch

import nnunet_raw as raw_sets
import preprocess_dataset
from data_loading import description as ds
from data_loading.geometry import read_record, record_path, scan_region
from main_runs import call, one_line_error
from runtime import labels as L
from runtime.predict.records import score

NET = ["--filters", "2", "4", "4", "8", "8", "--normalization", "batchnorm", "--device", "cpu"]
TRAIN = [*NET, "--input_shape", "32", "32", "32", "--batch_size", "2", "--optimizer", "adam", "--learning_rate",
         "0.01", "--seed", "5", "--num_workers", "0", "--semantics", "project", "--oversampling", "0.9"]
CASES = [raw_sets.RawCase("tiny_001"), raw_sets.RawCase("tiny_002", spacing=(2.0, 1.6, 1.5)),
         raw_sets.RawCase("tiny_003", spacing=(3.0, 1.2, 1.3)), raw_sets.RawCase("tiny_004", empty=True),
         raw_sets.RawCase("tiny_005", spacing=(2.2, 1.4, 1.4))]


def brute_dice(prediction: np.ndarray, truth: np.ndarray, value: int, keep=None) -> float:
    p, t = prediction == value, truth == value
    if keep is not None:
        p, t = p & keep, t & keep
    tp, fp, fn = np.sum(p & t), np.sum(p & ~t), np.sum(~p & t)
    return math.nan if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)


def prepared(tmp_path, labels=raw_sets.LABELS, name="data", extra=None) -> str:
    """The raw set (nnU-Net's layout) preprocessed, with tiny_003 and the empty tiny_004 to evaluate."""
    raw = raw_sets.write_raw_dataset(tmp_path / f"raw_{name}", CASES, labels=labels, extra=extra)
    split = tmp_path / f"split_{name}.txt"
    split.write_text("tiny_003\ntiny_004\n")
    out = tmp_path / name
    assert preprocess_dataset.main(["--data_dir", raw, "--results_dir", str(out), "--evaluation_cases",
                                    str(split), "--num_workers", "1"]) == 0
    return str(out)


def records(log_dir, kind="eval", name="log.json"):
    with open(os.path.join(log_dir, name)) as handle:
        return [r for r in map(json.loads, handle) if r.get("kind") == kind]


def api_scores(data: str, checkpoint: str, label_set: L.LabelSet, window=(32, 32, 32)) -> dict:
    """The evaluation recomputed outside evaluate: the checkpoint's network over each evaluation
    case's stored array with predict's windows, its argmax cut to the scan's own voxels (the
    geometry record), scored by the API's ``score``; each label's mean over the cases scoring it."""
    from model.unet3d import Unet3D
    from runtime.checkpoint import load_checkpoint, model_state_from
    from runtime.inference.sliding_window import flush_sliding_window_inference

    model = Unet3D(1, label_set.n_classes, normalization="batchnorm", filters=(2, 4, 4, 8, 8))
    model.load_state_dict(model_state_from(load_checkpoint(checkpoint)))
    model.eval()
    per_case = []
    for case in ("00003", "00004"):
        image = torch.from_numpy(np.load(os.path.join(data, f"case_{case}_x.npy")))[None]
        truth = np.load(os.path.join(data, f"case_{case}_y.npy"))[0]
        region = scan_region(read_record(record_path(data, f"case_{case}")), truth.shape)
        with torch.no_grad():
            logits = flush_sliding_window_inference(model, image, window, 0.5, 1)
        prediction = logits[0].argmax(0).numpy()
        per_case.append(score(prediction[region], truth[region], label_set).per_label)
    values = [value for _, value in label_set.foreground]
    means = {key: float(np.nanmean([c[v] for c in per_case])) if not all(math.isnan(c[v]) for c in per_case)
             else math.nan for key, v in zip(label_set.keys, values)}
    return {**means, "mean_dice": float(np.nanmean([m for m in means.values()]))}


def test_training_evaluate_and_the_api_give_one_number(tmp_path, capsys):
    """The same weights on the same data: training's last evaluation, evaluate and the API agree to
    1e-6; nnU-Net's Dice whatever the names (the empty case is no 1.0); the network built once."""
    data = prepared(tmp_path)
    run = tmp_path / "run"
    code, out, err = call(["--data_dir", data, "--log_dir", str(run), "--save_ckpt_path", str(run / "c.pt"), *TRAIN,
                           "--epochs", "2", "--start_eval_at", "2", "--evaluate_every", "2"], capsys)
    assert code in (0, 3), err[-2000:]
    assert "built again" not in out                          # the description read before run_start
    (trained,) = records(run)
    assert "organ_dice" in trained and "lesion_dice" in trained and "l1_dice" not in trained
    code, out, err = call(["--exec_mode", "evaluate", "--data_dir", data, "--load_ckpt_path", str(run / "c.pt"),
                           "--log_dir", str(tmp_path / "eval"), "--device", "cpu"], capsys)
    assert code == 0, err[-2000:]
    assert "window 32x32x32 from the checkpoint's training patch" in out and "differs from this only by the grid" in out
    (evaluated,) = records(tmp_path / "eval")
    api = api_scores(data, str(run / "c.pt"), L.LabelSet(L.as_labels(raw_sets.LABELS)))
    for key in ("organ_dice", "lesion_dice", "mean_dice"):
        both = [trained[key], evaluated[key], api[key]]
        assert all(math.isnan(v) for v in both) or max(both) - min(both) <= 1e-6, (key, both)
    with open(tmp_path / "eval" / "eval_cases.csv") as handle:
        rows = {row["case"]: row for row in csv.DictReader(handle)}
    empty = rows["00004"]
    truth = np.load(os.path.join(data, "case_00004_y.npy"))
    assert not truth.any() and empty["organ_dice"] in ("nan", "0.000000")   # never the benchmark's 1.0


def test_the_same_data_named_two_ways_gives_the_same_numbers(tmp_path, capsys):
    """organ/lesion and kidney/tumor (KiTS19's names, in a described folder): one definition,
    nnU-Net's, and the same numbers for the same seed; only the keys follow the names."""
    numbers = []
    for name, labels in (("a", {"background": 0, "organ": 1, "lesion": 2}),
                         ("b", {"background": 0, "kidney": 1, "tumor": 2})):
        data = prepared(tmp_path, labels, name)
        run = tmp_path / f"run_{name}"
        code, out, err = call(["--data_dir", data, "--log_dir", str(run), *TRAIN, "--epochs", "1",
                               "--start_eval_at", "1", "--evaluate_every", "1"], capsys)
        assert code in (0, 3), err[-2000:]
        (record,) = records(run)
        numbers.append([record[key] for key in L.LabelSet(L.as_labels(labels)).keys] + [record["mean_dice"]])
        assert "l1_dice" not in record
    assert np.allclose(numbers[0], numbers[1], equal_nan=True), numbers


def test_the_api_scores_every_label():
    """A truth with labels 1-3 and a prediction that misses label 3: 2/3, as MONAI and nnU-Net say;
    a binary map has one Dice; the ignore label's voxels are not scored."""
    truth = np.zeros((6, 6, 6), np.uint8)
    truth[:2], truth[2:4], truth[4:] = 1, 2, 3
    prediction = np.where(truth == 3, 0, truth)
    dice = score(prediction, truth)
    assert dice.per_label == {1: 1.0, 2: 1.0, 3: 0.0} and dice.mean_dice == pytest.approx(2 / 3)
    binary = score(truth > 1, truth > 2)
    assert list(binary.per_label) == [1] and binary.mean_dice == pytest.approx(brute_dice(truth > 1, truth > 2, 1))
    monai = pytest.importorskip("monai.metrics")
    onehot = lambda a: torch.nn.functional.one_hot(torch.as_tensor(a).long(), 4).movedim(-1, 0)[None]  # noqa: E731
    oracle = monai.DiceMetric(include_background=False, reduction="none")(onehot(prediction), onehot(truth))
    assert dice.mean_dice == pytest.approx(float(oracle.nanmean()))
    ignored = truth.copy()
    ignored[:, :3] = 9                                           # half the voxels: nnU-Net's ignore label
    keep = ignored != 9
    masked = score(prediction, ignored, (1, 2, 3), ignore=9)
    assert masked.per_label == {v: pytest.approx(brute_dice(prediction, ignored, v, keep)) for v in (1, 2, 3)}


# -- nnU-Net's ignore label -------------------------------------------------------------------

def test_the_ignore_label_is_no_class_in_the_loss_or_the_score():
    """The loss and the metric with an ignore label equal the brute-force ones over the voxels
    that count: Dice of softmax·mask against onehot·mask, cross-entropy's mean over kept voxels."""
    from model.losses import DiceCELoss, DiceScore

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, 6, 7, dtype=torch.float64)
    label = torch.randint(0, 3, (2, 1, 5, 6, 7))
    label[:, :, :2] = 3                                          # the ignore label, 3
    keep = (label != 3).double()
    clean = torch.where(label == 3, 0, label)
    soft = torch.softmax(logits, 1)
    onehot = torch.nn.functional.one_hot(clean[:, 0], 3).movedim(-1, 1).double()
    inter = (soft * onehot * keep)[:, 1:].sum((2, 3, 4))
    total = (onehot * keep)[:, 1:].sum((2, 3, 4)) + (soft * keep)[:, 1:].sum((2, 3, 4))
    dice = (2 * inter + 1e-6) / (total + 1e-6)
    kept = keep[:, 0].bool()
    cross_entropy = torch.nn.functional.cross_entropy(logits.movedim(1, -1)[kept], clean[:, 0][kept])
    expected = ((1 - dice).mean() + cross_entropy) / 2
    assert float(DiceCELoss(ignore_index=3)(logits, label)) == pytest.approx(float(expected), rel=1e-6)  # float32
    prediction = logits.argmax(1).numpy()
    scores = DiceScore(absent_nan=True, ignore_index=3)(logits, label)
    for value in (1, 2):
        per_sample = [brute_dice(prediction[n], clean[n, 0].numpy(), value, kept[n].numpy()) for n in range(2)]
        assert float(scores[value - 1]) == pytest.approx(float(np.nanmean(per_sample)), rel=1e-6)  # float32


def test_a_third_of_each_scan_ignored_trains_and_is_never_a_class(tmp_path, capsys):
    """A description with nnU-Net's ``ignore`` (the largest value): a third of each scan marked
    with it preprocesses, trains (the network has one output per class, not one for ignore) and
    scores no ``ignore_dice``."""
    labels = {"background": 0, "organ": 1, "lesion": 2, "ignore": 3}
    extra = {}
    for index, case in enumerate(CASES):
        _, label = raw_sets.anatomy(case, index)
        label = label.copy()
        label[: label.shape[0] // 3] = 3
        extra[case.name] = label
    data = prepared(tmp_path, labels, "ignored", extra)
    described = ds.folder_description(data)
    assert described.ignore == 3 and [v for _, v in described.labels] == [0, 1, 2]
    run = tmp_path / "run"
    code, out, err = call(["--data_dir", data, "--log_dir", str(run), "--save_ckpt_path", str(run / "c.pt"), *TRAIN,
                           "--epochs", "2", "--start_eval_at", "2", "--evaluate_every", "2"], capsys)
    assert code in (0, 3), err[-2000:]
    (record,) = records(run)
    assert "ignore_dice" not in record and "l3_dice" not in record and math.isfinite(record["eval_loss"])
    assert all(math.isfinite(r["loss"]) for r in records(run, "train"))
    from runtime.checkpoint import load_checkpoint, model_state_from

    assert model_state_from(load_checkpoint(str(run / "c.pt")))["output.conv.weight"].shape[0] == 3
    assert "ignore_dice" not in (run / "log.json").read_text()


# -- predict's truth ----------------------------------------------------------------------------

def test_predict_finds_the_truth_in_labels_tr_or_truth(tmp_path, capsys):
    """A scan of imagesTr is scored against labelsTr's ``<case>.nii.gz``; ``--truth DIR`` names
    another folder; the summary has the network's labels' columns only."""
    from checkpoints import architecture, write_checkpoint
    from runtime.plan import saved_values

    raw = raw_sets.write_raw_dataset(tmp_path / "raw", CASES[:1])
    config = architecture((2, 4, 4, 8, 8), normalization="batchnorm")
    checkpoint = tmp_path / "c.pt"
    write_checkpoint(checkpoint, config)
    saved = torch.load(checkpoint, weights_only=True)
    saved["config"]["plan"] = [{"name": "labels", "value": [["background", 0], ["organ", 1], ["lesion", 2]]},
                               {"name": "dice", "value": "nnunet"}]
    saved["config"]["input_shape"] = [32, 32, 32]
    torch.save(saved, checkpoint)
    code, out, err = call(["--exec_mode", "predict", "--input", os.path.join(raw, "imagesTr"), "--output_dir",
                           str(tmp_path / "p"), "--load_ckpt_path", str(checkpoint), "--device", "cpu"], capsys)
    assert code == 0, err[-2000:]
    header = (tmp_path / "p" / "summary.csv").read_text().splitlines()[0].split(",")
    assert {"organ_dice", "lesion_dice", "organ_ml", "lesion_ml"} <= set(header)
    assert not {"kidney_ml", "tumour_ml", "l1_dice", "kits_kidney_dice"} & set(header)
    row = json.loads((tmp_path / "p" / "summary.jsonl").read_text().splitlines()[0])
    assert row["organ_dice"] is not None and "dice organ" in out
    elsewhere = tmp_path / "truths"
    elsewhere.mkdir()
    os.replace(os.path.join(raw, "labelsTr", "tiny_001.nii.gz"), elsewhere / "tiny_001.nii.gz")
    code, out, err = call(["--exec_mode", "predict", "--input", os.path.join(raw, "imagesTr"), "--output_dir",
                           str(tmp_path / "q"), "--load_ckpt_path", str(checkpoint), "--device", "cpu",
                           "--truth", str(elsewhere)], capsys)
    assert code == 0, err[-2000:]
    assert json.loads((tmp_path / "q" / "summary.jsonl").read_text().splitlines()[0])["organ_dice"] is not None
    assert _summary_without_truth(tmp_path, raw, checkpoint, capsys) is None


def _summary_without_truth(tmp_path, raw, checkpoint, capsys):
    code, out, err = call(["--exec_mode", "predict", "--input", os.path.join(raw, "imagesTr"), "--output_dir",
                           str(tmp_path / "r"), "--load_ckpt_path", str(checkpoint), "--device", "cpu"], capsys)
    assert code == 0, err[-2000:]
    return json.loads((tmp_path / "r" / "summary.jsonl").read_text().splitlines()[0]).get("organ_dice")


# -- fine-tuning --------------------------------------------------------------------------------

def test_pretrained_weights_fine_tune_onto_another_label_set(tmp_path, capsys):
    """A KiTS19 network (3 outputs) fine-tuned onto a binary set: every layer but the output starts
    from its weights, the output layer anew with 2 outputs; the run says so and is open; without
    the flag the other label set is refused in one line."""
    from checkpoints import architecture, write_checkpoint
    from runtime.build import build_components
    from runtime.checkpoint import Saved, load_checkpoint
    from runtime.distributed import DistInfo
    from runtime.arguments import parse_args
    from runtime.resolve import resolve

    kits = tmp_path / "kits.pt"
    source = write_checkpoint(kits, architecture((2, 4, 4, 8, 8), normalization="batchnorm"))
    described = ds.parse_description({"labels": {"background": 0, "organ": 1}}, "b/dataset.json")
    config = parse_args(["--data_dir", str(tmp_path), *TRAIN, "--pretrained_weights", str(kits)])
    cpu = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    saved = Saved(str(kits), load_checkpoint(str(kits)), resume=False, pretrained=True)
    plan = resolve(config, cpu, None, saved, dataset=described)
    assert plan.training.pretrained == "every layer but the output" and plan.division == "open"
    assert "output layer starts anew" in plan.why("pretrained_weights")
    model = build_components(plan, cpu, None, saved).model
    theirs, ours = source.state_dict(), model.state_dict()
    assert ours["output.conv.weight"].shape[0] == 2
    for key, value in theirs.items():
        if not key.startswith("output."):
            assert torch.equal(ours[key], value), key
    data = prepared(tmp_path, {"background": 0, "organ": 1, "lesion": 2}, "own")
    code, out, err = call(["--data_dir", data, "--log_dir", str(tmp_path / "l"), *TRAIN, "--epochs", "1",
                           "--start_eval_at", "1", "--evaluate_every", "1", "--load_ckpt_path", str(kits)], capsys)
    one_line_error(code, err, str(kits), "--pretrained_weights")
