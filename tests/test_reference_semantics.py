"""``--semantics reference`` (closed runs) is the MLCommons code's sampling and gradient-accumulation
tail; ``--semantics project`` keeps this project's fixes (open runs). Both evaluate on the current
MLCommons code's epochs.

Everywhere: hand-worked answers from the reference's rules (its ``randrange(size - patch)`` never
draws the last position; a box longer than the patch is entered by ``randrange(difference)``;
evaluation at ``start`` and every ``every`` epochs after it; the last partial accumulation of an
epoch dropped). With the real code (``UNET3D_REFERENCE_CODE`` = the ``image_segmentation/pytorch``
folder of a mlcommons/training checkout; skipped without it): the set of crop positions the
project's sampler draws equals the set the reference's ``RandBalancedCrop`` draws, uniform and
foreground; its ``train`` loop evaluates on the same epochs, stops a diverged run (mean_dice below
1e-6) at the same evaluation and steps the optimizer as often.
"""
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data_loading.dataset import foreground_boxes
from data_loading.transforms import Box, draw_augmentation, foreground_patch_start, random_patch_start
from runtime.schedule import EvalSchedule
from runtime.training import loop

REAL = os.environ.get("UNET3D_REFERENCE_CODE", "")
needs_real = pytest.mark.skipif(not REAL, reason="UNET3D_REFERENCE_CODE (a mlcommons/training "
                                "image_segmentation/pytorch folder) not set")
PATCH = (8, 8, 8)


def _label():
    """(20, 20, 20) with class 1: a box longer than the patch on axis 1 touching the far end of
    axis 2, a small box, a single voxel (third largest: never a crop's box); class 2: three boxes
    of one volume (a tie: which two are kept), one as long as the patch on axis 0."""
    label = np.zeros((20, 20, 20), np.uint8)
    label[2:5, 3:14, 15:20] = 1
    label[12:14, 12:14, 2:4] = 1
    label[18, 0, 10] = 1
    label[8:16, 0:2, 6:8] = 2
    label[0:2, 16:20, 0:4] = 2     # class 2: three boxes of 32 voxels; the reference keeps the last two
    label[17:19, 17:19, 12:20] = 2
    return label


# -- hand-worked answers ------------------------------------------------------------------------

def test_reference_uniform_crop_never_draws_the_last_position():
    rng = np.random.default_rng(0)
    starts = {random_patch_start(rng, (11, 9, 8), PATCH) for _ in range(2000)}
    assert starts == {(x, 0, 0) for x in range(3)}   # randrange(3), randrange(1), 0 (patch fills the axis)
    project = {random_patch_start(rng, (11, 9, 8), PATCH, "project") for _ in range(2000)}
    assert project == {(x, y, 0) for x in range(4) for y in range(2)}


def test_reference_foreground_crop_known_positions():
    rng = np.random.default_rng(1)
    box = Box(start=(2, 3, 15), stop=(5, 14, 20), anchors=np.array([[2, 3, 15]]))
    starts = {foreground_patch_start(rng, box, (20, 20, 20), PATCH) for _ in range(3000)}
    # axis 0: 2 - randrange(5) clipped at 0; axis 1 (11 > 8): 3 + randrange(3); axis 2: shifted inside
    assert starts == {(x, y, 12) for x in (0, 1, 2) for y in (3, 4, 5)}
    project = {foreground_patch_start(rng, box, (20, 20, 20), PATCH, "project") for _ in range(3000)}
    assert (2, 6, 12) not in starts and any(s[1] == 3 for s in project)


def test_foreground_boxes_break_ties_as_the_reference():
    """np.argsort(volumes)[-2:] in component (raster) order: of three equal boxes, the last two."""
    boxes = foreground_boxes(_label())[2]
    assert sorted(b.start for b in boxes) == [(8, 0, 6), (17, 17, 12)]


def test_reference_evaluation_epochs_known_answer():
    """``next_eval_at = start``, then ``+= every`` at each evaluation: 10, 14, 18, ... (not the
    multiples of 4 from 10, 12, 16, ..., an old version's rule)."""
    schedule = EvalSchedule(10, 4, 100)
    assert [e for e in range(1, 30) if schedule.is_eval_epoch(e)] == [10, 14, 18, 22, 26]
    assert [schedule.next_eval_epoch(e) for e in (1, 10, 11, 29)] == [10, 10, 14, 30]
    assert schedule.first_eval_epoch == 10 and schedule.evaluations_through(29) == 5
    assert loop.next_eval_epoch(11, schedule, 13) == 13      # capped at the last epoch


class _Loader:
    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return self.batches

    def set_epoch(self, epoch):
        pass

    @property
    def samples_trained(self):
        return self.batches  # one sample a batch, no padding

    def step_weights(self, batch_index):
        return None

    def __iter__(self):
        return iter([(torch.zeros(1, 1, 2, 2, 2), torch.zeros(1, 1, 2, 2, 2, dtype=torch.uint8))] * self.batches)


def project_optimizer_steps(semantics: str, batches: int, ga_steps: int, epochs: int) -> tuple[int, bool]:
    """The project's ``train_epoch``: how many micro-batches end an accumulation (an optimizer
    step), and whether gradients are left over after the last epoch."""
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    steps = []

    def step(image, label, boundary):
        (weight * 2).sum().backward()
        if boundary:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps.append(1)
        return torch.zeros((), dtype=torch.float64)

    cfg = SimpleNamespace(ga_steps=ga_steps, semantics=semantics, learning_rate=0.1, init_learning_rate=0.1,
                          lr_warmup_epochs=0, lr_decay_epochs=(), lr_decay_factor=1.0, batch_size=1)
    plan = SimpleNamespace(config=cfg, precision=SimpleNamespace(channels_last=False))  # what train_epoch reads
    dist = SimpleNamespace(device=torch.device("cpu"), is_main=True, world_size=1, distributed=False)
    state = SimpleNamespace(epoch=0, step_in_epoch=0, epoch_loss_sum=0.0)
    components = SimpleNamespace(plan=plan, state=state, train_loader=_Loader(batches), dist=dist,
                                 optimizer=optimizer, step=step)
    for epoch in range(1, epochs + 1):
        loop.train_epoch(components, loop.Reporters(), epoch)
    return len(steps), weight.grad is not None


def test_reference_drops_the_last_partial_accumulation():
    assert project_optimizer_steps("reference", batches=4, ga_steps=3, epochs=2) == (2, False)
    assert project_optimizer_steps("project", batches=4, ga_steps=3, epochs=2) == (4, False)
    assert project_optimizer_steps("reference", batches=6, ga_steps=3, epochs=1) == (2, False)


# -- the real MLCommons code ------------------------------------------------------------------------

def _reference_starts(crop, label, foreground: bool, draws: int) -> set:
    random.seed(0)
    np.random.seed(0)
    image = np.zeros((1, *label.shape), np.float32)
    starts = set()
    for _ in range(draws):
        call = crop.rand_foreg_cropd if foreground else crop._rand_crop
        _, _, cords = call(image, label[None])
        starts.add((int(cords[0]), int(cords[2]), int(cords[4])))
    return starts


@needs_real
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the reference's scipy.ndimage.measurements
@pytest.mark.parametrize("crop_mode, same", [("reference", True), ("project", False)])
def test_crop_positions_are_the_references(crop_mode, same):
    from oracles.mlcommons_reference import load_reference_crop

    crop = load_reference_crop(REAL)(patch_size=list(PATCH), oversampling=1.0)
    label = _label()
    boxes = foreground_boxes(label)
    rng = np.random.default_rng(2)
    draws = 30000  # the rarest foreground position has probability 1/864: every one is drawn
    small = np.zeros((11, 10, 9), np.uint8)     # uniform crops: few positions, every one drawn
    ours_uniform = {draw_augmentation(rng, small.shape, PATCH, {}, 0.0, crop=crop_mode).start
                    for _ in range(draws)}
    ours_foreground = {draw_augmentation(rng, label.shape, PATCH, boxes, 1.0, crop=crop_mode).start
                       for _ in range(draws)}
    theirs_uniform = _reference_starts(crop, small, False, draws)
    theirs_foreground = _reference_starts(crop, label, True, draws)
    assert (ours_uniform == theirs_uniform) is same, (sorted(ours_uniform ^ theirs_uniform))
    assert (ours_foreground == theirs_foreground) is same, (sorted(ours_foreground ^ theirs_foreground))


def _reference_train(training, ga_steps: int, batches: int, epochs: int, start: int, every: int,
                     mean_dice: float = 0.5):
    """The reference's ``train`` on a one-weight model whose every evaluation scores ``mean_dice``
    (0.5: neither the target nor diverged): (epochs it evaluated, optimizer steps)."""
    evaluated, steps = [], []
    model = torch.nn.Conv3d(1, 1, 1, bias=False)

    class Loss(torch.nn.Module):
        def forward(self, output, label):
            return output.sum()

    original = training.get_optimizer

    def counting(params, flags):
        optimizer = original(params, flags)
        step = optimizer.step
        optimizer.step = lambda *a, **k: (steps.append(1), step(*a, **k))[1]
        return optimizer

    def evaluate(flags, model, loader, loss_fn, score_fn, device, epoch=0, is_distributed=False):
        evaluated.append(epoch)
        return {"mean_dice": mean_dice}

    saved = {name: getattr(training, name) for name in ("get_optimizer", "evaluate", "mllog_start", "mllog_end",
                                                         "mllog_event")}
    quiet = lambda *a, **k: None  # noqa: E731
    try:
        training.get_optimizer, training.evaluate = counting, evaluate
        training.mllog_start = training.mllog_end = training.mllog_event = quiet
        flags = SimpleNamespace(cudnn_benchmark=False, cudnn_deterministic=False, optimizer="sgd", learning_rate=0.1,
                                momentum=0.9, weight_decay=0.0, lr_decay_epochs=[], normalization="instancenorm",
                                epochs=epochs, lr_warmup_epochs=0, init_learning_rate=0.1, ga_steps=ga_steps,
                                verbose=False, amp=False, evaluate_every=every, start_eval_at=start,
                                quality_threshold=2.0, local_rank=0)
        batch = (torch.ones(1, 1, 2, 2, 2), torch.zeros(1, 1, 2, 2, 2))
        training.train(flags, model, [batch] * batches, None, Loss(), None, torch.device("cpu"), [], False)
    finally:
        for name, value in saved.items():
            setattr(training, name, value)
    return evaluated, len(steps)


@needs_real
def test_evaluation_epochs_and_accumulation_tail_are_the_references():
    from oracles.mlcommons_reference import load_reference_train_loop

    training = load_reference_train_loop(REAL)
    evaluated, steps = _reference_train(training, ga_steps=3, batches=4, epochs=30, start=10, every=4)
    assert evaluated == [e for e in range(1, 31) if EvalSchedule(10, 4, 1000).is_eval_epoch(e)]
    assert evaluated == [10, 14, 18, 22, 26, 30]  # the oracle checks the rule, not only our copy of it
    assert steps == project_optimizer_steps("reference", batches=4, ga_steps=3, epochs=30)[0]
    assert steps != project_optimizer_steps("project", batches=4, ga_steps=3, epochs=30)[0]


@needs_real
def test_a_diverged_evaluation_stops_the_run_as_the_references():
    """mean_dice below 1e-6 at an evaluation: the reference stops after it, the project aborts."""
    from oracles.mlcommons_reference import load_reference_train_loop

    training = load_reference_train_loop(REAL)
    evaluated, _ = _reference_train(training, ga_steps=1, batches=1, epochs=30, start=10, every=4, mean_dice=0.0)
    assert evaluated == [10]
    assert loop.run_status(10, 1.0, 0.0, fail_epoch=1000, quality_threshold=0.908)[0] == "aborted"
    assert loop.run_status(10, 1.0, 0.5, fail_epoch=1000, quality_threshold=0.908)[0] is None
