"""Loss and metric against MONAI (independent oracle) and known answers."""
import numpy as np
import pytest
import torch

from model.losses import DiceCELoss, DiceScore

SHAPES = [(2, 3, 5, 7, 3), (1, 3, 9, 4, 11), (3, 3, 2, 6, 5)]


def _random(shape, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape, generator=g, dtype=torch.float64).float() * 3
    label = torch.randint(0, 3, (shape[0], 1, *shape[2:]), generator=g)
    return logits, label


@pytest.mark.parametrize("shape", SHAPES)
def test_loss_matches_monai(shape):
    monai_losses = pytest.importorskip("monai.losses")
    logits, label = _random(shape, sum(shape))
    ours = DiceCELoss(to_onehot_y=True, use_softmax=True, include_background=False)
    oracle = monai_losses.DiceCELoss(include_background=False, to_onehot_y=True, softmax=True,
                                     smooth_nr=1e-6, smooth_dr=1e-6, lambda_dice=0.5, lambda_ce=0.5)
    torch.testing.assert_close(ours(logits, label), oracle(logits, label), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_loss_channels_last_memory_format(shape):
    """Logits in the channels-last 3-D memory format (what --channels_last produces) give the
    same loss as contiguous ones."""
    logits, label = _random(shape, 7)
    strided = logits.contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(DiceCELoss()(logits, label), DiceCELoss()(strided, label))


@pytest.mark.parametrize("shape", SHAPES)
def test_score_matches_monai(shape):
    monai_metrics = pytest.importorskip("monai.metrics")
    logits, label = _random(shape, 3 * sum(shape))
    ours = DiceScore(to_onehot_y=True, use_argmax=True, include_background=False)
    pred = torch.nn.functional.one_hot(logits.argmax(1), 3).movedim(-1, 1)
    target = torch.nn.functional.one_hot(label[:, 0], 3).movedim(-1, 1)
    oracle = monai_metrics.DiceMetric(include_background=False, reduction="mean_batch", ignore_empty=False)
    oracle(pred, target)
    torch.testing.assert_close(ours(logits, label), oracle.aggregate().float(), rtol=1e-5, atol=1e-5)


def test_score_empty_class_is_one_and_false_positive_is_zero():
    label = torch.zeros(1, 1, 4, 4, 4, dtype=torch.long)
    label[0, 0, :2] = 1  # kidney present, no tumour anywhere
    logits = torch.zeros(1, 3, 4, 4, 4)
    logits[0, 1, :2] = 5.0  # predict kidney exactly
    logits[0, 0, 2:] = 5.0
    score = DiceScore()(logits, label)
    torch.testing.assert_close(score, torch.tensor([1.0, 1.0]))
    logits[0, 2, 3, 3, 3] = 50.0  # one false-positive tumour voxel
    score = DiceScore()(logits, label)
    assert score[1] < 1e-5 and score[0] > 0.99


def test_loss_perfect_prediction_is_near_zero():
    label = torch.randint(0, 3, (2, 1, 6, 6, 6))
    logits = torch.nn.functional.one_hot(label[:, 0], 3).movedim(-1, 1).float() * 50
    assert DiceCELoss()(logits, label) < 1e-4


def test_loss_is_differentiable():
    logits, label = _random((2, 3, 4, 4, 4), 1)
    logits.requires_grad_(True)
    DiceCELoss()(logits, label).backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_foreground_agreement_counts_the_union_of_the_organs():
    """Known answer: background both ways never counts; a voxel either calls organ counts, equal
    only when both give the same label."""
    from model.losses import foreground_agreement

    labels = np.array([0, 0, 1, 2, 1, 0, 2])
    expected = np.array([0, 1, 1, 2, 2, 0, 0])
    assert foreground_agreement(labels, expected) == (2, 5)  # positions 1-4 and 6; 2 and 3 equal
    assert foreground_agreement(np.zeros(4, int), np.zeros(4, int)) == (0, 0)
