"""Public entry point: ``data_source(config)`` -> ``.summary(use)`` and
``.loaders(settings, num_shards, global_rank, device=None)`` (or ``get_data_loaders`` for a tool
that has the flags only), in the terms of ``data_loading.source``.

Returns the pair :class:`~data_loading.source.Loaders` ``(train, eval)``:

* ``train`` (a :class:`~data_loading.source.TrainLoader`): call ``set_epoch(epoch)`` (epochs
  from 1) before iterating each epoch; yields ``(image, label)``, float32 and uint8,
  ``(B, 1, *patch)``, on ``device`` when given (else CPU). ``len()`` = batches per epoch on this
  rank; ``num_cases`` = training cases (the global samples per epoch are the plan's
  ``samples_per_epoch``, from ``runtime.schedule``); ``step_weights(i)``: the loss weights of
  batch ``i`` when its optimizer step holds padding (``--last_batch pad``,
  ``data_loading.sampler.step_weights``), else None.
* ``eval`` (an :class:`~data_loading.source.EvalLoader`): yields ``(image, label, case_id)`` for
  the evaluation cases of this rank (``(1, 1, D, H, W)``, whole volumes), balanced across ranks by
  number of sliding windows; ``len()`` = cases on this rank; ``num_cases`` = evaluation cases on
  all ranks.

``settings.cache`` chooses where training volumes live: ``none`` (read the .npy per sample),
``memory`` (memory-mapped once, CPU workers crop), ``device`` (all volumes on the device,
augmentations as batched tensor ops there, no CPU workers); ``--cache auto`` is decided once by
``runtime.resolve`` (``resolve_cache``: device on CUDA when it fits, else memory).
"""
from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

import numpy as np
import torch

from data_loading.dataset import (Case, DataError, DeviceVolumes, TrainingSet, case_foreground_boxes,
                                  check_finite, check_label_values, check_patch_fits, collate_batch,
                                  discover_cases, load_array, read_evaluation_ids,
                                  split_cases)
from data_loading.description import KITS19, DatasetDescription, DescriptionError, folder_description
from data_loading.geometry import read_record, record_path, scan_region
from data_loading.prefetch import prefetch, resolve_device
from data_loading.sampler import EpochBatchSampler, EpochShape, balance_by_cost, epoch_batches
from data_loading.source import DataSource, DataSummary, DataUse, Loaders, LoaderSettings
from data_loading.synthetic_loader import SyntheticData
from data_loading.transforms import add_noise, gather_patches, patch_indices, scale_brightness
from data_loading.windows import window_geometry

def leave_stop_signals_to_the_trainer(_worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: a worker ignores SIGTERM and SIGUSR1. A scheduler (SLURM's
    scancel, requeue, pre-emption, time limit) signals every process of a job at once; a worker
    killed by it makes the training process raise at its next batch instead of saving its
    checkpoint. The training process acts on the signal and ends its workers itself (a worker
    also exits when its training process is gone)."""
    for name in ("SIGTERM", "SIGUSR1"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)


class FolderTrainLoader(EpochShape):
    """This rank's training batches; see the module docstring for the contract.

    The deterministic preparation (foreground boxes of every case, the device cache) runs in
    the constructor when ``eager`` (training: bad data is reported before anything starts),
    else at the first iteration (evaluation runs never pay for it).
    """

    def __init__(self, cases: Sequence[Case], *, patch: Sequence[int], oversampling: float,
                 brightness: str, seed: int, num_shards: int, rank: int, batch_size: int,
                 cache: str, device: torch.device | None, num_workers: int, prefetch_depth: int,
                 eager: bool = True, crop: str = "reference", ga_steps: int = 1, last_batch: str = "pad",
                 n_class: int = len(KITS19.labels), ignore: int | None = None):
        if cache not in ("none", "memory", "device"):
            raise ValueError(f"TrainLoader cache must be none, memory or device, got {cache!r}")
        self.cases, self.patch, self.seed = list(cases), tuple(patch), seed
        self.oversampling, self.brightness, self.crop = oversampling, brightness, crop
        self.batch_size, self.num_shards, self.rank = batch_size, num_shards, rank
        self.ga_steps, self.last_batch = ga_steps, last_batch
        self.cache, self.device = cache, device
        self.n_class = n_class  # label values 0..n_class-1; 1..n_class-1 are the foreground to oversample
        self.ignore = ignore  # nnU-Net's ignore label (no class), a value its labels may hold too
        self.num_workers = 0 if cache == "device" else num_workers
        self._prepare_threads = max(1, num_workers)
        self.prefetch_depth = prefetch_depth
        self.num_cases = len(self.cases)
        self.epoch = 1
        self.dataset: TrainingSet | None = None
        self._sampler = EpochBatchSampler(seed, self.num_cases, num_shards, rank, batch_size, ga_steps, last_batch)
        self._loader = None
        self._volumes: DeviceVolumes | None = None
        if eager:
            self.prepare()

    def prepare(self) -> None:
        """Compute the foreground boxes and fill the cache (once)."""
        if self.dataset is not None:
            return
        boxes = compute_boxes(self.cases, self._prepare_threads, self.n_class, self.ignore)
        self.dataset = TrainingSet(self.cases, boxes, self.patch, self.oversampling,
                                   self.brightness, self.seed,
                                   cache="memory" if self.cache == "device" else self.cache, crop=self.crop)
        if self.cache == "device":
            self._volumes = DeviceVolumes(self.cases, self.device or torch.device("cpu"))
            return
        cuda = self.device is not None and self.device.type == "cuda"
        # An explicit generator: the DataLoader then draws its workers' base seed from it
        # instead of from the global torch RNG (which it would otherwise advance every epoch).
        self._loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=self._sampler, num_workers=self.num_workers,
            collate_fn=collate_batch, pin_memory=cuda, persistent_workers=self.num_workers > 0,
            worker_init_fn=leave_stop_signals_to_the_trainer,
            generator=torch.Generator().manual_seed(self.seed))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self._sampler.set_epoch(epoch)

    def batch_keys(self, epoch: int | None = None) -> list[list[tuple[int, int, int]]]:
        """This rank's ``(epoch, position, case)`` keys per batch (for inspection and tests)."""
        return epoch_batches(self.seed, self.epoch if epoch is None else epoch,
                             self.num_cases, self.num_shards, self.rank, self.batch_size, self.ga_steps,
                             self.last_batch)

    def _device_batches(self, batch_keys) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        volumes, dev = self._volumes, self._volumes.device
        for keys in batch_keys:
            augs = [self.dataset.augmentation(key) for key in keys]
            # Two small host-to-device copies per batch: integer and float parameters.
            ints = torch.tensor([[key[2], *a.start, *a.flips] for key, a in zip(keys, augs)],
                                dtype=torch.int64).to(dev)
            factors = torch.tensor([1.0 if a.brightness is None else a.brightness for a in augs],
                                   dtype=torch.float32).to(dev)
            cases, starts, flips = ints[:, 0], ints[:, 1:4], ints[:, 4:7].bool()
            offsets, shapes = volumes.offsets[cases], volumes.shapes[cases]
            indices = patch_indices(offsets, shapes, starts, flips, self.patch)
            images = gather_patches(volumes.images, indices)
            labels = gather_patches(volumes.labels, indices)
            del indices
            scale_brightness(images, factors)
            add_noise(images, [a.noise_std for a in augs], [a.noise_seed for a in augs])
            yield images, labels

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.prepare()
        # The DataLoader iterator (and its worker processes) is created here, in the calling
        # thread; the prefetch thread only pulls batches from it.
        if self._loader is None:
            batches = self._device_batches(self.batch_keys())
        else:
            batches = iter(self._loader)
        return prefetch(batches, self.device, self.prefetch_depth)


class FolderEvalLoader:
    """This rank's evaluation volumes, whole, one at a time: ``(image, label, case_id)``."""

    def __init__(self, cases: Sequence[Case], num_cases: int, device: torch.device | None,
                 prefetch_depth: int, n_class: int = len(KITS19.labels), ignore: int | None = None):
        self.cases, self.num_cases, self.n_class, self.ignore = list(cases), num_cases, n_class, ignore
        self.device, self.prefetch_depth = device, prefetch_depth
        self._checked: set[str] = set()  # cases whose label values and finiteness were checked

    def __len__(self) -> int:
        return len(self.cases)

    def _volumes(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, str]]:
        for case in self.cases:
            image = load_array(case.image_path, np.float32)
            label = load_array(case.label_path, np.uint8)
            if case.case_id not in self._checked:  # once: evaluation repeats every few epochs
                check_label_values(case, label, self.n_class, self.ignore)
                check_finite(case, image, " (an evaluation case)")
                self._checked.add(case.case_id)
            yield (torch.from_numpy(image).unsqueeze(0), torch.from_numpy(label).unsqueeze(0),
                   case.case_id)

    def volume_shapes(self) -> list[tuple[int, ...]]:
        """The spatial shape of each of this rank's volumes, in order (from the case listing)."""
        return [tuple(case.shape) for case in self.cases]

    def scan_region(self, case_id: str, shape: Sequence[int]) -> tuple[slice, ...] | None:
        """The scan inside case ``case_id``'s stored volume of ``shape`` (padding excluded), from
        the geometry record preprocessing wrote beside its arrays; None without one."""
        case = next((c for c in self.cases if c.case_id == case_id), None)
        if case is None:
            return None
        name = case.image_path.name[:-len("_x.npy")]
        return scan_region(read_record(record_path(str(case.image_path.parent), name)), shape)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, str]]:
        return prefetch(self._volumes(), self.device, min(self.prefetch_depth, 1))


def assign_evaluation_cases(cases: Sequence[Case], roi: Sequence[int], overlap: float,
                            num_shards: int) -> list[list[Case]]:
    """Evaluation cases per rank, balanced by their number of sliding windows."""
    costs = [window_geometry(c.shape, roi, overlap).n_windows for c in cases]
    return [[cases[i] for i in shard] for shard in balance_by_cost(costs, num_shards)]


def compute_boxes(cases: Sequence[Case], threads: int, n_class: int = len(KITS19.labels),
                  ignore: int | None = None) -> list:
    """Foreground boxes of every case (labels 1..``n_class``-1), a few cases at a time (numpy and
    the labelling release the GIL for most of the work)."""
    threads = max(1, min(threads, os.cpu_count() or 1, len(cases)))
    if threads == 1:
        return [case_foreground_boxes(case, n_class, ignore) for case in cases]
    with ThreadPoolExecutor(threads, thread_name_prefix="foreground-boxes") as pool:
        return list(pool.map(lambda case: case_foreground_boxes(case, n_class, ignore), cases))


class PreprocessedData:
    """The preprocessed KiTS19 folder ``data_dir``: found and checked once, then loaded per rank.

    ``summary(use)`` lists and checks the cases (raises :class:`DataError`, one line naming
    the folder or case); ``loaders(settings, num_shards, rank, device)`` builds this rank's loaders
    from the same listing.
    """

    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self._split: tuple[list[Case], list[Case]] | None = None
        self._description: DatasetDescription | None = None
        self._described = False  # the description read (once)
        self._split_source = "evaluation_cases.txt"

    def description(self) -> DatasetDescription | None:
        """The folder's description (``data_loading.description.folder_description``), read once:
        None for KiTS19's folder. Reads only ``dataset.json`` (before the MLPerf clock)."""
        if not self._described:
            try:
                self._description = folder_description(self.data_dir)
            except DescriptionError as err:
                raise DataError(str(err)) from None
            self._described = True
        return self._description

    def split(self) -> tuple[list[Case], list[Case]]:
        if self._split is None:
            # a described folder: its own split if it has one
            ids = list(self.description().evaluation_cases) if self.description() is not None else []
            if ids:
                self._split_source = f"the split of {self.description().path}"
            self._split = split_cases(discover_cases(self.data_dir), ids or read_evaluation_ids())
        return self._split

    def n_class(self) -> int:
        """The classes of the folder: its description's (the run's label set, decided from it
        before ``run_start``), KiTS19's 3 without one."""
        return len((self.description() or KITS19).labels)

    def ignore(self) -> int | None:
        """The folder's nnU-Net ignore label (a value its labels hold that is no class), None without."""
        return self.description().ignore if self.description() is not None else None

    def summary(self, use: DataUse) -> DataSummary:
        train_cases, eval_cases = self.split()
        if use.trains and not train_cases:
            raise DataError(f"no training cases in {self.data_dir}: every case found is listed "
                            f"in {self._split_source}")
        if use.evaluates and not eval_cases:
            raise DataError(f"no evaluation case in {self.data_dir}: none of the ids in "
                            f"{self._split_source} has a case_XXXXX_x.npy / _y.npy pair there")
        if use.trains:  # evaluate samples no patch (--input_shape is a training flag)
            check_patch_fits(train_cases, use.patch)
        nbytes = sum(5 * int(np.prod(case.shape)) for case in train_cases)
        return DataSummary(len(train_cases), len(eval_cases), nbytes, synthetic=synthetic_marker(self.data_dir))

    def loaders(self, settings: LoaderSettings, num_shards: int, global_rank: int,
                device: torch.device | str | None = None) -> Loaders:
        """This rank's loaders (``settings``: the resolved seed, the same on every rank, and
        cache mode; see the module docstring)."""
        device = resolve_device(device)
        if not 0 <= global_rank < num_shards:
            raise ValueError(f"global_rank {global_rank} not in [0, {num_shards})")
        if settings.seed < 0 or settings.cache == "auto":
            raise ValueError("the loaders need a resolved seed (>= 0) and cache mode (not auto)")
        train_cases, eval_cases = self.split()
        train_loader = FolderTrainLoader(
            train_cases, patch=settings.patch, oversampling=settings.oversampling,
            brightness=settings.brightness, seed=settings.seed, num_shards=num_shards, rank=global_rank,
            batch_size=settings.batch_size, cache=settings.cache, device=device,
            num_workers=settings.num_workers, prefetch_depth=settings.prefetch, eager=settings.trains,
            crop=settings.crop, ga_steps=settings.ga_steps, last_batch=settings.last_batch, n_class=self.n_class(),
            ignore=self.ignore())
        if settings.trains and len(train_loader) == 0:
            raise DataError(f"{len(train_cases)} training cases in {self.data_dir} make no full "
                            f"batch of {settings.batch_size} on each of {num_shards} ranks")
        shards = assign_evaluation_cases(eval_cases, settings.window, settings.overlap, num_shards)
        val_loader = FolderEvalLoader(shards[global_rank], len(eval_cases), device, settings.prefetch, self.n_class(),
                                      self.ignore())
        return Loaders(train_loader, val_loader)


def synthetic_marker(data_dir) -> str:
    """``data_dir``'s synthetic marker in words (``data_loading.synthetic``'s, copied there by
    preprocessing), "" when it has none."""
    from data_loading.synthetic import MARKER_NAME, marker_text, read_marker

    record = read_marker(str(data_dir))
    return "" if record is None else f"{os.path.join(str(data_dir), MARKER_NAME)}: {marker_text(record)}"


def data_source(config) -> DataSource:
    """The data ``config.loader`` names: the preprocessed folder, or random tensors."""
    if config.loader == "synthetic":
        return SyntheticData()
    return PreprocessedData(config.data_dir)


def get_data_loaders(config, num_shards: int, global_rank: int,
                     device: torch.device | str | None = None) -> Loaders:
    """This rank's loaders of the parsed flags' data (``config``: a tool's ``runtime.config.Config``,
    its seed and cache given), after the data checks of ``summary``."""
    source = data_source(config)
    source.summary(DataUse.of_flags(config))
    return source.loaders(LoaderSettings.of_flags(config), num_shards, global_rank, device)
