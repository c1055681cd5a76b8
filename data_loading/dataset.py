"""Preprocessed KiTS19 cases on disk: discovery, split, validation and caching.

A dataset folder holds ``case_XXXXX_x.npy`` (float32 image, ``(1, D, H, W)``) and
``case_XXXXX_y.npy`` (uint8 label, same shape, 0 background, 1 kidney, 2 tumour) per case.
The evaluation set is the ids listed in ``evaluation_cases.txt`` at the repository root (or, in
a folder preprocessed from a description, the split saved in its ``dataset.json``); the other
cases are the training set. A folder's description (``data_loading.description.folder_description``)
gives its labels 0..N-1 (KiTS19's 0, 1, 2 without one).

What is deterministic is done once, when the dataset is opened: file headers are checked, and
the bounding boxes of the two largest connected components of each foreground class are
computed per training case (the reference re-labels the whole volume for every sample).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import scipy.ndimage
import torch

from data_loading.description import KITS19
from data_loading.sampler import sample_rng
from data_loading.transforms import (Box, ForegroundBoxes, apply_augmentation,
                                     draw_augmentation)

EVALUATION_CASES_FILE = Path(__file__).resolve().parents[1] / "evaluation_cases.txt"
FOREGROUND_CLASSES = (1, 2)
MAX_ANCHORS = 16
_FILE_PATTERN = re.compile(r"^case_(\d+)_([xy])\.npy$")
_NPY_MAGIC = b"\x93NUMPY"


class DataError(ValueError):
    """A dataset problem, with a one-line message naming the file or case."""


@dataclass(frozen=True)
class Case:
    """One case: its id (``"00003"``), files, and spatial shape ``(D, H, W)``."""

    case_id: str
    image_path: Path
    label_path: Path
    shape: tuple[int, ...]


# --------------------------------------------------------------------------------------------
# discovery, validation, split

def read_evaluation_ids(path: Path = EVALUATION_CASES_FILE) -> list[str]:
    """Case ids of the evaluation set (one per line, e.g. ``00003``)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").split()
    except OSError as err:
        raise DataError(f"cannot read the evaluation case list {path}: {err.strerror}") from None
    return [line.strip() for line in lines if line.strip()]


def open_npy(path: Path) -> np.ndarray:
    """Memory-map an .npy file (reads only its header now); DataError naming it if unreadable."""
    try:
        with open(path, "rb") as handle:
            if handle.read(len(_NPY_MAGIC)) != _NPY_MAGIC:
                raise DataError(f"corrupt or unreadable file {path}: not a .npy file")
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"corrupt or unreadable file {path}: {err}".splitlines()[0]) from None


def _check_pair(case_id: str, image_path: Path, label_path: Path) -> tuple[int, ...]:
    image, label = open_npy(image_path), open_npy(label_path)
    if image.ndim != 4 or image.shape[0] != 1:
        raise DataError(f"case {case_id}: {image_path.name} has shape {image.shape}, "
                        "expected (1, D, H, W)")
    if image.shape != label.shape:
        raise DataError(f"case {case_id}: image {image_path.name} has shape {image.shape} but "
                        f"label {label_path.name} has shape {label.shape}")
    if image.dtype.kind != "f":
        raise DataError(f"case {case_id}: {image_path.name} has dtype {image.dtype}, expected float32")
    if label.dtype.kind not in "iub":
        raise DataError(f"case {case_id}: {label_path.name} has dtype {label.dtype}, expected uint8")
    return tuple(int(s) for s in image.shape[1:])


def discover_cases(data_dir: str | Path) -> list[Case]:
    """All ``case_XXXXX_x.npy``/``_y.npy`` pairs in ``data_dir``, sorted by id, headers checked.

    Raises :class:`DataError` when the folder has no pair, an image has no label (or a label no
    image), shapes differ, or a file cannot be read as .npy.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data directory {data_dir} does not exist or is not a folder")
    files: dict[str, dict[str, Path]] = {}
    for path in data_dir.iterdir():
        match = _FILE_PATTERN.match(path.name)
        if match:
            files.setdefault(match.group(1), {})[match.group(2)] = path
    if not files:
        raise DataError(f"no case_XXXXX_x.npy / case_XXXXX_y.npy pairs found in {data_dir}")
    cases = []
    for case_id in sorted(files):
        pair = files[case_id]
        if "y" not in pair:
            raise DataError(f"image {pair['x']} has no label case_{case_id}_y.npy")
        if "x" not in pair:
            raise DataError(f"label {pair['y']} has no image case_{case_id}_x.npy")
        shape = _check_pair(case_id, pair["x"], pair["y"])
        cases.append(Case(case_id, pair["x"], pair["y"], shape))
    return cases


def split_cases(cases: Sequence[Case], evaluation_ids: Sequence[str]) -> tuple[list[Case], list[Case]]:
    """(training, evaluation): evaluation = the cases whose id is listed, training = the rest."""
    listed = set(evaluation_ids)
    return ([c for c in cases if c.case_id not in listed], [c for c in cases if c.case_id in listed])


def check_patch_fits(cases: Sequence[Case], patch: Sequence[int]) -> None:
    """DataError naming the first case smaller than ``patch`` along some axis."""
    for case in cases:
        for axis, (size, p) in enumerate(zip(case.shape, patch)):
            if size < p:
                raise DataError(f"case {case.case_id}: volume {case.image_path.name} of shape "
                                f"{case.shape} is smaller than --input_shape {tuple(patch)} "
                                f"on axis {axis}")


def check_label_values(case: Case, label: np.ndarray, n_class: int = len(KITS19.labels),
                       ignore: int | None = None) -> None:
    """DataError if ``label`` holds a value outside 0..``n_class``-1 (KiTS19's 0..2 by default)
    and the data's ``ignore`` label (nnU-Net's: no class; None without one)."""
    top = int(label.max()) if label.size else 0
    allowed = n_class - 1 if ignore is None else max(n_class - 1, ignore)
    if top > allowed or (label.dtype.kind == "i" and int(label.min()) < 0):
        also = "" if ignore is None else f" and the ignore label {ignore}"
        raise DataError(f"case {case.case_id}: label {case.label_path.name} has values outside "
                        f"0..{n_class - 1}{also} (max {top})")


def check_finite(case: Case, image: np.ndarray | torch.Tensor, where: str = "") -> None:
    """DataError naming the case and file if ``image`` holds NaN or an infinity."""
    finite = bool(torch.isfinite(image).all()) if isinstance(image, torch.Tensor) else bool(np.isfinite(image).all())
    if not finite:
        raise DataError(f"case {case.case_id}: {case.image_path} holds NaN or infinite values{where}; "
                        "preprocess the case again or remove it")


FINITE_BLOCK = 16  # slices checked at a time: a bounded temporary, whatever the volume's size


def check_volume_finite(case: Case, where: str) -> None:
    """DataError naming the case and file if its image holds NaN or an infinity anywhere: the
    whole volume, read once (memory-mapped, a few slices at a time), not only the patches that
    training happens to sample."""
    image = open_npy(case.image_path)
    for start in range(0, image.shape[1], FINITE_BLOCK):
        check_finite(case, np.asarray(image[:, start:start + FINITE_BLOCK]), where)


def load_array(path: Path, dtype) -> np.ndarray:
    """Whole .npy file as a ``dtype`` array; DataError naming it if unreadable."""
    try:
        return np.load(path, allow_pickle=False).astype(dtype, copy=False)
    except (OSError, ValueError, EOFError) as err:
        raise DataError(f"corrupt or unreadable file {path}: {err}".splitlines()[0]) from None


# --------------------------------------------------------------------------------------------
# connected components, once per case

def _bounding_slices(mask: np.ndarray) -> tuple[slice, ...] | None:
    """Smallest box holding every True voxel of ``mask``, or None if there is none."""
    slices = []
    for axis in range(mask.ndim):
        other = tuple(a for a in range(mask.ndim) if a != axis)
        hits = np.flatnonzero(mask.any(axis=other))
        if hits.size == 0:
            return None
        slices.append(slice(int(hits[0]), int(hits[-1]) + 1))
    return tuple(slices)


def foreground_boxes(label: np.ndarray, classes: Sequence[int] = FOREGROUND_CLASSES,
                     keep: int = 2) -> dict[int, tuple[Box, ...]]:
    """Per class, the boxes of its ``keep`` largest connected components (by box volume).

    ``label``: ``(D, H, W)`` integer array. Components are ``scipy.ndimage.label``'s (face
    connectivity), labelled inside the class's own bounding box only (same result, a fraction
    of the work on CT volumes where kidneys fill a few percent). A class absent from the label
    maps to an empty tuple.
    """
    result: dict[int, tuple[Box, ...]] = {}
    for cls in classes:
        mask = label == cls
        region = _bounding_slices(mask)
        if region is None:
            result[cls] = ()
            continue
        origin = np.array([s.start for s in region])
        components, _ = scipy.ndimage.label(mask[region])
        found = [(idx + 1, sl) for idx, sl in enumerate(scipy.ndimage.find_objects(components))
                 if sl is not None]
        # The reference's choice, ties included: np.argsort of the box volumes in component order,
        # its last ``keep`` (components are numbered in raster order, in the class's bounding
        # box as in the whole volume).
        volumes = [np.prod([s.stop - s.start for s in sl]) for _, sl in found]
        chosen = [found[i] for i in np.argsort(volumes)[-keep:]][::-1] if keep > 0 else []
        boxes = []
        for component, sl in chosen:
            voxels = np.argwhere(components[sl] == component)      # raster order
            pick = np.unique(np.linspace(0, len(voxels) - 1, MAX_ANCHORS).round().astype(int))
            corner = origin + [s.start for s in sl]
            boxes.append(Box(start=tuple(int(v) for v in corner),
                             stop=tuple(int(v) for v in origin + [s.stop for s in sl]),
                             anchors=(voxels[pick] + corner).astype(np.int64)))
        result[cls] = tuple(boxes)
    return result


def case_foreground_boxes(case: Case, n_class: int = len(KITS19.labels),
                          ignore: int | None = None) -> dict[int, tuple[Box, ...]]:
    """Read one case's label once, check its values (0..``n_class``-1, and ``ignore``) and compute
    the boxes of its foreground labels 1..``n_class``-1 (never the ignore label: no class to
    oversample); check that its image is finite everywhere (once, as training first reads the case)."""
    label = np.asarray(open_npy(case.label_path)[0])
    check_label_values(case, label, n_class, ignore)
    check_volume_finite(case, " (found when the training volumes were first read)")
    return foreground_boxes(label, tuple(range(1, n_class)))


# --------------------------------------------------------------------------------------------
# training samples from the CPU caches (none, memory)

class TrainingSet(torch.utils.data.Dataset):
    """Map-style dataset of augmented training patches, keyed by ``(epoch, position, case)``.

    ``cache``: ``"memory"`` memory-maps every volume once per process (the OS page cache holds
    the data once for all worker processes; nothing is copied per worker), ``"none"`` reads the
    whole .npy again for every sample as the reference does. ``boxes`` are the precomputed
    foreground boxes per case. Items are ``(image (1, *patch) float32, label (1, *patch)
    uint8)`` CPU tensors, a pure function of the key and ``seed``.
    """

    def __init__(self, cases: Sequence[Case], boxes: Sequence[ForegroundBoxes],
                 patch: Sequence[int], oversampling: float, brightness: str, seed: int,
                 cache: str = "memory", crop: str = "reference"):
        if cache not in ("none", "memory"):
            raise ValueError(f"TrainingSet cache must be 'none' or 'memory', got {cache!r}")
        self.cases, self.boxes = list(cases), list(boxes)
        self.patch, self.oversampling = tuple(patch), oversampling
        self.brightness, self.seed, self.cache = brightness, seed, cache
        self.crop = crop  # the crop placement (data_loading.transforms.CROP_MODES; --semantics)
        self._maps: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.cases)

    def __getstate__(self):
        # Worker processes started by spawn/forkserver reopen the maps instead of receiving
        # copies of the volumes through a pipe.
        state = self.__dict__.copy()
        state["_maps"] = {}
        return state

    def volumes(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        case = self.cases[index]
        if self.cache == "none":
            return load_array(case.image_path, np.float32), load_array(case.label_path, np.uint8)
        if index not in self._maps:
            self._maps[index] = (open_npy(case.image_path), open_npy(case.label_path))
        return self._maps[index]

    def augmentation(self, key: tuple[int, int, int]):
        epoch, position, index = key
        rng = sample_rng(self.seed, epoch, position)
        return draw_augmentation(rng, self.cases[index].shape, self.patch, self.boxes[index],
                                 self.oversampling, self.brightness, self.crop)

    def __getitem__(self, key: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = self.__getitems__([key])
        return images[0], labels[0]

    def __getitems__(self, keys: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole batch ``(images (B, 1, *patch) float32, labels (B, 1, *patch) uint8)``,
        each patch cropped straight into the batch tensor (no per-sample arrays, no stacking).
        The DataLoader calls this with one batch of keys; pair it with :func:`collate_batch`."""
        shape = (len(keys), 1, *self.patch)
        images, labels = batch_buffer(shape, torch.float32), batch_buffer(shape, torch.uint8)
        image_array, label_array = images.numpy(), labels.numpy()
        for b, key in enumerate(keys):
            image, label = self.volumes(key[2])
            apply_augmentation(image, label, self.augmentation(key), self.patch,
                               image_array[b], label_array[b])
            # Checked per sampled patch: the volumes are memory-mapped, never read whole here.
            check_finite(self.cases[key[2]], image_array[b], " (in a sampled training patch)")
        return images, labels


def collate_batch(batch):
    """The DataLoader's collate for :meth:`TrainingSet.__getitems__`: already a batch."""
    return batch


def batch_buffer(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised CPU tensor for a batch.

    In a DataLoader worker it is allocated in shared memory, so sending it to the main process
    copies nothing (what the default collate does too). Elsewhere it is numpy heap memory,
    which the C library reuses from batch to batch, where torch's CPU allocator would map and
    fault in fresh pages (measured in docs/performance.md, "Data pipeline").
    """
    if torch.utils.data.get_worker_info() is not None:
        numel = int(np.prod(shape))
        storage = torch.UntypedStorage._new_shared(numel * dtype.itemsize)
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))
    return torch.from_numpy(np.empty(tuple(shape), dtype=torch.empty(0, dtype=dtype).numpy().dtype))


# --------------------------------------------------------------------------------------------
# the device-resident cache

class DeviceVolumes:
    """Every training volume in two flat tensors on ``device`` (image float32, label uint8),
    back to back in C order, with per-case ``offsets`` and ``shapes`` (int64, on the device)."""

    def __init__(self, cases: Sequence[Case], device: torch.device):
        self.device = torch.device(device)
        sizes = [int(np.prod(c.shape)) for c in cases]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.images = torch.empty(sum(sizes), dtype=torch.float32, device=self.device)
        self.labels = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        for case, start, size in zip(cases, starts, sizes):
            for flat, path, dtype in ((self.images, case.image_path, np.float32),
                                      (self.labels, case.label_path, np.uint8)):
                host = torch.from_numpy(np.array(open_npy(path), dtype=dtype).reshape(-1))
                flat[start:start + size].copy_(host)
            check_finite(case, self.images[start:start + size], " (loading the device cache)")
        self.offsets = torch.as_tensor(starts[:len(cases)], device=self.device)
        self.shapes = torch.as_tensor([c.shape for c in cases], dtype=torch.int64,
                                      device=self.device).view(-1, 3)
        if self.device.type == "cuda":
            # The batches are cut on another stream (prefetch thread): finish filling first.
            torch.cuda.synchronize(self.device)

