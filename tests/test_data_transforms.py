"""Augmentations as pure functions: crop placement, flips, brightness, noise, and the agreement
of the numpy (worker) and torch (device cache) implementations."""
import numpy as np
import pytest
import scipy.ndimage
import torch

from data_loading.dataset import foreground_boxes
from data_loading.transforms import (Augmentation, Box, add_noise, apply_augmentation,
                                     crop_and_flip, draw_augmentation, foreground_patch_start,
                                     gather_patches, patch_indices, random_patch_start,
                                     scale_brightness)

PATCH = (16, 16, 16)


def _random_label(rng, shape, n_blobs=4):
    """Label volume with non-convex components: random walks (thin, winding) and boxes."""
    label = np.zeros(shape, np.uint8)
    for _ in range(n_blobs):
        cls = int(rng.integers(1, 3))
        if rng.random() < 0.5:                       # a winding 1-voxel path: box >> component
            point = np.array([rng.integers(s) for s in shape])
            for _ in range(int(rng.integers(10, 80))):
                label[tuple(point)] = cls
                axis = rng.integers(3)
                point[axis] = np.clip(point[axis] + rng.choice([-1, 1]), 0, shape[axis] - 1)
        else:
            lo = [int(rng.integers(0, s - 2)) for s in shape]
            hi = [min(s, a + int(rng.integers(1, 25))) for a, s in zip(lo, shape)]
            label[tuple(slice(a, b) for a, b in zip(lo, hi))] = cls
    return label


def test_random_crop_inside_volume_and_patch_sized():
    rng = np.random.default_rng(0)
    for _ in range(500):
        patch = tuple(int(p) for p in rng.integers(1, 20, 3))
        shape = tuple(p + int(rng.integers(0, 6)) for p in patch)
        start = random_patch_start(rng, shape, patch)
        assert all(0 <= s and s + p <= n for s, p, n in zip(start, patch, shape))


def test_random_crop_reaches_every_position():
    rng = np.random.default_rng(1)
    starts = {random_patch_start(rng, (18,), (16,), "project")[0] for _ in range(200)}
    assert starts == {0, 1, 2}
    # the reference's randrange(18 - 16): never the last position
    assert {random_patch_start(rng, (18,), (16,))[0] for _ in range(200)} == {0, 1}


def test_foreground_crops_fit_and_contain_the_chosen_class():
    rng = np.random.default_rng(2)
    patch = (8, 8, 8)   # small: many components are longer than the patch on some axis
    checked = 0
    for trial in range(40):
        shape = tuple(int(s) for s in rng.integers(16, 40, 3))
        label = _random_label(rng, shape)
        boxes = foreground_boxes(label)
        for _ in range(25):
            aug = draw_augmentation(rng, shape, patch, boxes, oversampling=1.0, crop="project")
            assert all(0 <= s and s + p <= n for s, p, n in zip(aug.start, patch, shape))
            crop = crop_and_flip(label[None], aug.start, patch, aug.flips, np.uint8)
            assert crop.shape == (1, *patch)
            if aug.foreground_class:
                assert (crop == aug.foreground_class).any(), (trial, aug)
                checked += 1
            else:
                assert not any(boxes.values())
    assert checked > 500


def test_foreground_placement_of_a_box_longer_than_the_patch_stays_in_the_box():
    rng = np.random.default_rng(3)
    anchors = np.array([[10, 30, 5], [40, 31, 6]])
    box = Box(start=(5, 28, 0), stop=(50, 34, 40), anchors=anchors)
    for _ in range(300):
        start = foreground_patch_start(rng, box, (60, 60, 60), (16, 16, 16), "project")
        # axis 1: box (6) shorter than the patch -> the whole box extent is inside the patch
        assert start[1] <= 28 and start[1] + 16 >= 34
        # axes 0 and 2: box longer -> patch inside the box and over one anchor
        for axis in (0, 2):
            assert box.start[axis] <= start[axis] and start[axis] + 16 <= box.stop[axis]
        assert any(all(s <= a < s + 16 for s, a in zip(start, anchor)) for anchor in anchors)


def test_foreground_placement_splits_the_difference_at_random():
    rng = np.random.default_rng(4)
    box = Box(start=(20, 20, 20), stop=(24, 24, 24), anchors=np.array([[21, 21, 21]]))
    starts = np.array([foreground_patch_start(rng, box, (64, 64, 64), PATCH, "project") for _ in range(2000)])
    # difference 12 split at random: start uniform over 20-12..20
    assert starts.min() == 8 and starts.max() == 20
    counts = np.bincount(starts[:, 0] - 8)
    assert counts.min() > 2000 / 13 * 0.6
    # the reference: 20 - randrange(12), uniform over 9..20
    starts = np.array([foreground_patch_start(rng, box, (64, 64, 64), PATCH) for _ in range(2000)])
    assert starts.min() == 9 and starts.max() == 20
    assert np.bincount(starts[:, 0] - 9).min() > 2000 / 12 * 0.6


def test_foreground_placement_near_the_border_shifts_inside():
    rng = np.random.default_rng(5)
    box = Box(start=(0, 0, 58), stop=(3, 3, 64), anchors=np.array([[0, 0, 60]]))
    for _ in range(100):
        start = foreground_patch_start(rng, box, (64, 64, 64), PATCH)
        assert start[0] == 0 and start[1] == 0 and start[2] == 48


@pytest.mark.parametrize("oversampling", [0.0, 0.4, 0.9])
def test_foreground_fraction_matches_oversampling(oversampling):
    rng = np.random.default_rng(6)
    label = np.zeros((40, 40, 40), np.uint8)
    label[5:10, 5:10, 5:10] = 1
    label[30:33, 30:33, 30:33] = 2
    boxes = foreground_boxes(label)
    n = 4000
    augs = [draw_augmentation(rng, label.shape, PATCH, boxes, oversampling) for _ in range(n)]
    classes = np.array([a.foreground_class for a in augs])
    tolerance = 4 * np.sqrt(oversampling * (1 - oversampling) / n) + 1e-9
    assert abs((classes > 0).mean() - oversampling) <= tolerance
    if oversampling > 0:   # both classes present: chosen evenly
        assert abs((classes == 2).sum() / (classes > 0).sum() - 0.5) < 0.06


def test_no_foreground_falls_back_to_uniform_crop():
    rng = np.random.default_rng(7)
    boxes = foreground_boxes(np.zeros((20, 20, 20), np.uint8))
    assert boxes == {1: (), 2: ()}
    for _ in range(50):
        aug = draw_augmentation(rng, (20, 20, 20), PATCH, boxes, oversampling=1.0)
        assert aug.foreground_class == 0


def test_flips_move_image_and_label_together():
    rng = np.random.default_rng(8)
    shape = (1, 21, 19, 23)
    image = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    label = (image.astype(np.int64) % 3).astype(np.uint8)
    seen = set()
    for _ in range(60):
        aug = draw_augmentation(rng, shape[1:], PATCH, {1: (), 2: ()}, 0.0)
        aug = Augmentation(aug.start, aug.flips, None, None, 0, 0)
        out_image, out_label = apply_augmentation(image, label, aug, PATCH)
        assert out_image.shape == out_label.shape == (1, *PATCH)
        assert out_image.dtype == np.float32 and out_label.dtype == np.uint8
        np.testing.assert_array_equal(out_image.astype(np.int64) % 3, out_label)
        crop = image[(slice(None),) + tuple(slice(s, s + p) for s, p in zip(aug.start, PATCH))]
        flipped = np.flip(crop, [1 + a for a, f in enumerate(aug.flips) if f]) if any(aug.flips) else crop
        np.testing.assert_array_equal(out_image, flipped)
        seen.add(aug.flips)
    assert len(seen) >= 6                  # the flips vary per axis


def test_flip_brightness_and_noise_rates_and_ranges():
    rng = np.random.default_rng(9)
    n = 6000
    augs = [draw_augmentation(rng, (20, 20, 20), PATCH, {}, 0.0) for _ in range(n)]
    flips = np.array([a.flips for a in augs])
    assert np.all(np.abs(flips.mean(axis=0) - 1 / 3) < 0.03)
    factors = np.array([a.brightness for a in augs if a.brightness is not None])
    stds = np.array([a.noise_std for a in augs if a.noise_std is not None])
    assert abs(len(factors) / n - 0.1) < 0.02 and abs(len(stds) / n - 0.1) < 0.02
    assert factors.min() >= 1.7 and factors.max() <= 2.3          # reference: 1 + U(0.7, 1.3)
    assert stds.min() >= 0 and stds.max() <= 0.1
    rng = np.random.default_rng(9)
    centred = [draw_augmentation(rng, (20, 20, 20), PATCH, {}, 0.0, "centered") for _ in range(n)]
    factors_c = np.array([a.brightness for a in centred if a.brightness is not None])
    np.testing.assert_allclose(factors_c, factors - 1.0)          # same draws, factor f
    with pytest.raises(ValueError, match="brightness"):
        draw_augmentation(rng, (20, 20, 20), PATCH, {}, 0.0, "bright")


def test_brightness_and_noise_applied():
    image = np.ones((1, 20, 20, 20), np.float32)
    label = np.zeros_like(image, dtype=np.uint8)
    aug = Augmentation((0, 0, 0), (False,) * 3, 2.0, None, 0, 0)
    out, _ = apply_augmentation(image, label, aug, PATCH)
    np.testing.assert_array_equal(out, 2.0)
    aug = Augmentation((0, 0, 0), (False,) * 3, None, 0.05, 123, 0)
    out, _ = apply_augmentation(image, label, aug, PATCH)
    assert abs(float(out.std()) - 0.05) < 0.005 and abs(float(out.mean()) - 1.0) < 0.005
    assert image.max() == 1.0                                     # the input is only read


def test_foreground_boxes_match_whole_volume_labelling():
    rng = np.random.default_rng(10)
    for _ in range(10):
        label = _random_label(rng, (30, 26, 34), n_blobs=6)
        boxes = foreground_boxes(label)
        for cls in (1, 2):
            components, _ = scipy.ndimage.label(label == cls)
            slices = [s for s in scipy.ndimage.find_objects(components) if s is not None]
            volumes = sorted((np.prod([s.stop - s.start for s in sl]) for sl in slices), reverse=True)
            assert [b.volume for b in boxes[cls]] == volumes[:2]
            for box in boxes[cls]:
                assert all(label[tuple(a)] == cls for a in box.anchors)
                assert all(np.all((box.anchors >= box.start) & (box.anchors < box.stop), axis=1))


def test_torch_batched_path_matches_numpy_on_cpu():
    rng = np.random.default_rng(11)
    shapes = [(20, 24, 18), (17, 16, 30), (25, 19, 21)]
    volumes = [rng.standard_normal((1, *s)).astype(np.float32) for s in shapes]
    labels = [rng.integers(0, 3, (1, *s)).astype(np.uint8) for s in shapes]
    flat_images = torch.from_numpy(np.concatenate([v.ravel() for v in volumes]))
    flat_labels = torch.from_numpy(np.concatenate([v.ravel() for v in labels]))
    offsets = torch.tensor(np.concatenate([[0], np.cumsum([np.prod(s) for s in shapes])[:-1]]))
    cases = [0, 2, 1, 2, 0, 1]
    augs = []
    for i, case in enumerate(cases):
        a = draw_augmentation(rng, shapes[case], PATCH, {}, 0.0)
        # force every operation to appear
        augs.append(Augmentation(a.start, a.flips, 1.9 if i % 2 else None,
                                 0.07 if i % 3 == 0 else None, 1000 + i, 0))
    idx = torch.tensor(cases)
    starts = torch.tensor([a.start for a in augs])
    flips = torch.tensor([a.flips for a in augs])
    shapes_t = torch.tensor(shapes)[idx]
    indices = patch_indices(offsets[idx], shapes_t, starts, flips, PATCH)
    images = gather_patches(flat_images, indices)
    labels_t = gather_patches(flat_labels, indices)
    scale_brightness(images, torch.tensor([a.brightness or 1.0 for a in augs], dtype=torch.float32))
    add_noise(images, [a.noise_std for a in augs], [a.noise_seed for a in augs])
    assert images.shape == (len(cases), 1, *PATCH) and labels_t.dtype == torch.uint8
    for b, (case, aug) in enumerate(zip(cases, augs)):
        ref_image, ref_label = apply_augmentation(volumes[case], labels[case], aug, PATCH)
        np.testing.assert_array_equal(images[b].numpy(), ref_image)
        np.testing.assert_array_equal(labels_t[b].numpy(), ref_label)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_batched_path_on_cuda_matches_cpu():
    rng = np.random.default_rng(12)
    shape = (24, 20, 28)
    volume = torch.from_numpy(rng.standard_normal(np.prod(shape)).astype(np.float32))
    starts = torch.tensor([[1, 2, 3], [8, 4, 12]])
    flips = torch.tensor([[True, False, True], [False, True, False]])
    offsets, shapes = torch.zeros(2, dtype=torch.int64), torch.tensor([shape, shape])
    cpu = gather_patches(volume, patch_indices(offsets, shapes, starts, flips, PATCH))
    cpu = scale_brightness(cpu, torch.tensor([1.8, 1.0]))
    gpu = gather_patches(volume.cuda(), patch_indices(offsets.cuda(), shapes.cuda(),
                                                      starts.cuda(), flips.cuda(), PATCH))
    gpu = scale_brightness(gpu, torch.tensor([1.8, 1.0], device="cuda"))
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=0)
    noisy = add_noise(gpu.clone(), [0.1, None], [5, 6])
    assert 0.07 < float((noisy - gpu)[0].std()) < 0.13 and torch.equal(noisy[1], gpu[1])
