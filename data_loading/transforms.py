"""The benchmark's training augmentations as pure functions.

One sample's randomness is drawn once, by :func:`draw_augmentation`, from a numpy ``Generator``
that the caller seeds from (master seed, epoch, sample index); the result is a small
:class:`Augmentation` record. Two interchangeable implementations then apply it:

* numpy, on CPU arrays of shape ``(C, D, H, W)`` (the worker path): :func:`apply_augmentation`;
* torch, on batches of any device (the device-resident cache): :func:`patch_indices` +
  :func:`gather_patches` (crop and flips), :func:`scale_brightness`, :func:`add_noise`.

Given the same :class:`Augmentation`, both produce bit-identical patches on the CPU; on a GPU
only the Gaussian noise values differ (torch's CUDA generator is another stream).

Per sample, in the reference's order: biased crop, flip of each spatial axis with p=1/3, cast
(image float32, label uint8), brightness with p=0.1, Gaussian noise with p=0.1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

FLIP_PROBABILITY = 1.0 / 3.0
BRIGHTNESS_PROBABILITY = 0.1
BRIGHTNESS_RANGE = (0.7, 1.3)
NOISE_PROBABILITY = 0.1
NOISE_MAX_STD = 0.1
BRIGHTNESS_MODES = ("reference", "centered")
# The crop placement: the MLCommons code's (closed runs) or the project's fixes (open runs).
CROP_MODES = ("reference", "project")


@dataclass(frozen=True, eq=False)
class Box:
    """Bounding box of one connected component, ``[start, stop)`` per spatial axis.

    ``anchors`` is an ``(k, 3)`` int array of voxels that belong to the component (a spread-out
    subsample, ``k >= 1``). A patch smaller than the box along some axis is placed around one
    of them, so it always contains part of the component even when the component is not
    convex.
    """

    start: tuple[int, ...]
    stop: tuple[int, ...]
    anchors: np.ndarray

    @property
    def volume(self) -> int:
        return int(np.prod([b - a for a, b in zip(self.start, self.stop)]))


# The foreground of one case: class (1 kidney, 2 tumour) -> its two largest components' boxes.
ForegroundBoxes = Mapping[int, Sequence[Box]]


@dataclass(frozen=True)
class Augmentation:
    """Every random choice for one training sample.

    ``start``: patch corner per spatial axis; ``flips``: flip per spatial axis;
    ``brightness``: image factor, or None; ``noise_std``/``noise_seed``: Gaussian noise, or
    None; ``foreground_class``: the class the crop was centred on (0 = uniform crop).
    """

    start: tuple[int, ...]
    flips: tuple[bool, ...]
    brightness: float | None
    noise_std: float | None
    noise_seed: int
    foreground_class: int


# --------------------------------------------------------------------------------------------
# Crop placement (pure, integers only)

def random_patch_start(rng: np.random.Generator, shape: Sequence[int],
                       patch: Sequence[int], crop: str = "reference") -> tuple[int, ...]:
    """Uniform corner of a ``patch`` inside a volume of spatial ``shape``.

    ``crop="reference"`` draws what the MLCommons code's ``randrange(size - patch)`` draws: every
    position but the last one (0 where the patch fills the axis); ``crop="project"`` every
    position, the last one included.
    """
    if crop == "project":
        return tuple(int(rng.integers(0, size - p + 1)) for size, p in zip(shape, patch))
    return tuple(_randrange(rng, size - p) for size, p in zip(shape, patch))


def _randrange(rng: np.random.Generator, count: int) -> int:
    """The reference's ``randrange``: uniform in ``[0, count)``, 0 when ``count`` is 0."""
    return int(rng.integers(0, count)) if count > 0 else 0


def foreground_patch_start(rng: np.random.Generator, box: Box, shape: Sequence[int],
                           patch: Sequence[int], crop: str = "reference") -> tuple[int, ...]:
    """Corner of a ``patch`` placed around ``box`` inside a volume of spatial ``shape``.

    ``crop="reference"``, the MLCommons code's rule per axis: the difference between patch and
    box lengths is split by ``randrange(difference)`` (so the side before the box gets 0 to
    difference - 1 voxels); where the box is shorter the patch then is shifted back inside
    the volume, where it is longer the patch lies inside the box, anywhere but flush with its
    far end (which can miss a non-convex component entirely).

    ``crop="project"``: where the box is shorter, 0 to difference voxels before it (the whole box
    extent lies in the patch), shifted back inside the volume; where it is at least as long,
    inside the box and kept over one of the box's anchor voxels, so the patch always overlaps
    the component.
    """
    if crop == "reference":
        start = []
        for lo, hi, size, p in zip(box.start, box.stop, shape, patch):
            difference = p - (hi - lo)
            if difference >= 0:
                start.append(min(max(lo - _randrange(rng, difference), 0), size - p))
            else:
                start.append(lo + _randrange(rng, -difference))
        return tuple(start)
    long_axes = [hi - lo >= p for lo, hi, p in zip(box.start, box.stop, patch)]
    anchor = box.anchors[int(rng.integers(len(box.anchors)))] if any(long_axes) else None
    start = []
    for axis, (lo, hi, size, p) in enumerate(zip(box.start, box.stop, shape, patch)):
        if not long_axes[axis]:
            low = lo - int(rng.integers(0, p - (hi - lo) + 1))
            low = min(max(low, 0), size - p)
        else:
            a = int(anchor[axis])
            low = int(rng.integers(max(lo, a - p + 1), min(hi - p, a) + 1))
        start.append(low)
    return tuple(start)


def draw_augmentation(rng: np.random.Generator, shape: Sequence[int], patch: Sequence[int],
                      boxes: ForegroundBoxes, oversampling: float,
                      brightness: str = "reference", crop: str = "reference") -> Augmentation:
    """Draw all random choices for one sample of a volume of spatial ``shape``.

    With probability ``oversampling`` the patch is centred on the box of one of the two largest
    components of a foreground class present in the case (class and box chosen uniformly);
    otherwise, or without foreground, it is uniform. ``brightness`` chooses the factor:
    ``reference`` multiplies by ``1 + U(0.7, 1.3)`` as the MLCommons code, ``centered`` by
    ``U(0.7, 1.3)``. ``crop`` chooses the crop placement (:data:`CROP_MODES`:
    :func:`random_patch_start`, :func:`foreground_patch_start`).
    """
    if brightness not in BRIGHTNESS_MODES:
        raise ValueError(f"brightness must be one of {BRIGHTNESS_MODES}, got {brightness!r}")
    if crop not in CROP_MODES:
        raise ValueError(f"crop must be one of {CROP_MODES}, got {crop!r}")
    classes = sorted(c for c, found in boxes.items() if len(found) > 0)
    foreground_class = 0
    if rng.random() < oversampling and classes:
        foreground_class = classes[int(rng.integers(len(classes)))]
        found = boxes[foreground_class]
        box = found[int(rng.integers(len(found)))]
        start = foreground_patch_start(rng, box, shape, patch, crop)
    else:
        start = random_patch_start(rng, shape, patch, crop)
    flips = tuple(bool(f) for f in rng.random(len(patch)) < FLIP_PROBABILITY)
    factor = None
    if rng.random() < BRIGHTNESS_PROBABILITY:
        f = float(rng.uniform(*BRIGHTNESS_RANGE))
        factor = 1.0 + f if brightness == "reference" else f
    noise_std = None
    if rng.random() < NOISE_PROBABILITY:
        noise_std = float(rng.uniform(0.0, NOISE_MAX_STD))
    noise_seed = int(rng.integers(2**62))
    return Augmentation(start, flips, factor, noise_std, noise_seed, foreground_class)


# --------------------------------------------------------------------------------------------
# numpy implementation (CPU workers)

def crop_and_flip(volume: np.ndarray, start: Sequence[int], patch: Sequence[int],
                  flips: Sequence[bool], dtype, out: np.ndarray | None = None) -> np.ndarray:
    """Contiguous ``dtype`` copy of ``volume[:, patch at start]`` flipped along ``flips``.

    ``volume`` is ``(C, D, H, W)`` (a memory map is fine: only the patch is read). One copy,
    whatever the flips (they are negative-stride views until the copy), into ``out`` when
    given (shape ``(C, *patch)``).
    """
    index = [slice(None)]
    for s, p, flip in zip(start, patch, flips):
        index.append(slice(s + p - 1, s - 1 if s > 0 else None, -1) if flip else slice(s, s + p))
    view = volume[tuple(index)]
    if out is None:
        return np.array(view, dtype=dtype, copy=True)
    np.copyto(out, view, casting="unsafe")
    return out


def standard_noise(shape: Sequence[int], seed: int, device: torch.device | str = "cpu",
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 N(0, 1) noise from a torch generator on ``device`` seeded with ``seed`` (both
    implementations draw it here, so they agree on the CPU); written into ``out`` if given."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(tuple(shape), generator=generator, device=device, dtype=torch.float32,
                       out=out)


def add_scaled_noise(image: torch.Tensor, std: float, seed: int,
                     scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``image += std * N(0, 1)`` in place, in one fused pass (same kernel on both paths)."""
    noise = standard_noise(image.shape, seed, image.device, scratch)
    return image.add_(noise, alpha=float(np.float32(std)))


def apply_augmentation(image: np.ndarray, label: np.ndarray, aug: Augmentation,
                       patch: Sequence[int], out_image: np.ndarray | None = None,
                       out_label: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Crop, flip, cast, brightness and noise: ``(C, D, H, W)`` volumes -> ``(C, *patch)``
    float32 image and uint8 label, new arrays or written into ``out_image``/``out_label``
    (the inputs are only read)."""
    out_image = crop_and_flip(image, aug.start, patch, aug.flips, np.float32, out_image)
    out_label = crop_and_flip(label, aug.start, patch, aug.flips, np.uint8, out_label)
    if aug.brightness is not None:
        out_image *= np.float32(aug.brightness)
    if aug.noise_std is not None:
        # numpy-allocated scratch: reused heap memory, where torch's allocator would fault
        # in fresh pages for every sample.
        scratch = torch.from_numpy(np.empty(out_image.shape, np.float32))
        add_scaled_noise(torch.from_numpy(out_image), aug.noise_std, aug.noise_seed, scratch)
    return out_image, out_label


# --------------------------------------------------------------------------------------------
# torch implementation (any device; batched, for the device-resident cache)

def patch_indices(offsets: torch.Tensor, shapes: torch.Tensor, starts: torch.Tensor,
                  flips: torch.Tensor, patch: Sequence[int]) -> torch.Tensor:
    """Flat indices ``(B, *patch)`` (int64) of cropped and flipped patches of volumes stored
    back to back in one 1-D tensor.

    Per sample ``b``: ``offsets[b]`` where its single-channel C-order volume begins,
    ``shapes[b]`` its ``(D, H, W)``, ``starts[b]`` the patch corner, ``flips[b]`` (bool) the
    axes to flip. Index tensors are int64 (flips bool), ``(B,)`` or ``(B, 3)``, all on the
    device the indices are wanted on. A flipped axis simply counts down.
    """
    batch = starts.shape[0]
    coords = []
    for axis, p in enumerate(patch):
        ramp = torch.arange(p, device=starts.device, dtype=torch.int64)
        ramp = torch.where(flips[:, axis, None], p - 1 - ramp, ramp)       # (B, p)
        coords.append(starts[:, axis, None] + ramp)
    stride_h = shapes[:, 2]
    stride_d = shapes[:, 1] * stride_h
    return (offsets.view(batch, 1, 1, 1)
            + (coords[0] * stride_d[:, None]).view(batch, -1, 1, 1)
            + (coords[1] * stride_h[:, None]).view(batch, 1, -1, 1)
            + coords[2].view(batch, 1, 1, -1))


def gather_patches(flat: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``flat[indices]`` with a channel axis: ``(B, 1, *patch)``, ``flat``'s dtype; one gather
    for the whole batch (image and label share the same ``indices``)."""
    return flat[indices].unsqueeze(1)


def scale_brightness(images: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``images (B, C, ...)`` times one float32 factor per sample ``(B,)`` (1.0 = unchanged,
    exactly), in place."""
    return images.mul_(factors.view(-1, *([1] * (images.dim() - 1))))


def add_noise(images: torch.Tensor, stds: Sequence[float | None],
              seeds: Sequence[int]) -> torch.Tensor:
    """Add Gaussian noise in place to the samples whose ``stds[b]`` is not None, each from a
    generator on ``images``' device seeded with ``seeds[b]``."""
    for b, (std, seed) in enumerate(zip(stds, seeds)):
        if std is None:
            continue
        add_scaled_noise(images[b], std, seed)
    return images
