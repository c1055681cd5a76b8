"""``--include_background`` in the benchmark's evaluation (issue 42): the background counts in the
Dice loss, and the benchmark's Dice stays kidney and tumour, the metric's last two scores, as the
MLCommons reference's ``evaluate`` reads them (``scores[-2]``, ``scores[-1]``). Before, the
evaluation stopped with a traceback (it summed three scores into two). The whole train-and-evaluate
run: tests/test_end_to_end.py.

With the real code (``UNET3D_REFERENCE_CODE`` = the ``image_segmentation/pytorch`` folder of a
mlcommons/training checkout; skipped without it): the reference's own ``evaluate``, loss and
score give the project's numbers on the same network and volumes.
"""
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from model.losses import DiceCELoss, DiceScore
from runtime.clocked.evaluation import evaluate

REAL = os.environ.get("UNET3D_REFERENCE_CODE", "")
needs_real = pytest.mark.skipif(not REAL, reason="UNET3D_REFERENCE_CODE (a mlcommons/training "
                                "image_segmentation/pytorch folder) not set")
ROI = (32, 32, 32)
CPU = torch.device("cpu")


def network() -> torch.nn.Module:
    """Logits that depend on the voxel's value, so that each class is predicted somewhere (a
    random tiny U-Net predicts one class everywhere): both evaluations only call it."""
    layer = torch.nn.Conv3d(1, 3, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([-1.0, 0.4, 1.0]).view(3, 1, 1, 1, 1))
        layer.bias.copy_(torch.tensor([0.0, 0.2, -0.6]))
    return layer.eval()


def volumes():
    rng = np.random.default_rng(5)
    shapes = ((40, 36, 44), (48, 32, 40))
    return [(torch.from_numpy(rng.normal(size=(1, 1, *s)).astype(np.float32)),
             torch.from_numpy(rng.integers(0, 3, (1, 1, *s)).astype(np.uint8)), str(i)) for i, s in enumerate(shapes)]


def ours(include_background: bool, cases=None) -> dict:
    return evaluate(network(), volumes(), DiceCELoss(include_background=include_background),
                    DiceScore(include_background=include_background), ROI, 0.5, 2, CPU, cases=cases)


def test_the_dice_is_kidney_and_tumour_and_only_the_loss_counts_the_background():
    with_cases, without_cases = [], []
    with_background, without = ours(True, with_cases), ours(False, without_cases)
    for key in ("l1_dice", "l2_dice", "mean_dice", "eval_cases"):
        assert with_background[key] == without[key], key
    assert with_background["eval_loss"] != without["eval_loss"]
    keys = ("case", "kidney_dice", "tumour_dice", "mean_dice")
    assert [[c[k] for k in keys] for c in with_cases] == [[c[k] for k in keys] for c in without_cases]


@needs_real
def test_the_references_evaluate_gives_the_same_numbers_with_include_background():
    from oracles.mlcommons_reference import _import_reference

    inference, losses = _import_reference(REAL, ("runtime.inference", "model.losses"))
    flags = SimpleNamespace(load_ckpt_path="", verbose=False, amp=False, val_input_shape=list(ROI), overlap=0.5,
                            local_rank=0)
    loader = [(image, label) for image, label, _ in volumes()]
    theirs = inference.evaluate(flags, network(), loader,
                                losses.DiceCELoss(to_onehot_y=True, use_softmax=True, layout="NCDHW",
                                                  include_background=True),
                                losses.DiceScore(to_onehot_y=True, use_argmax=True, layout="NCDHW",
                                                 include_background=True), CPU)
    mine = ours(True)
    # the reference rounds to 4 decimals
    for key, their_key in (("l1_dice", "L1 dice"), ("l2_dice", "L2 dice"), ("mean_dice", "mean_dice"),
                           ("eval_loss", "eval_loss")):
        assert mine[key] == pytest.approx(float(theirs[their_key]), abs=6e-5), key
