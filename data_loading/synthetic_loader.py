"""``--loader synthetic``: random tensors of the right shapes, for pure compute benchmarks.

The same interface and attributes as the real loaders (168 training cases, 42 evaluation
cases, the same sharding and batch counts), with no disk access and no per-step cost: a few
batches are generated once on the device, from the run's seed, and yielded again and again.
Evaluation volumes are window-sized (one sliding window each) and carry the real evaluation case
ids.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch

from data_loading.dataset import EVALUATION_CASES_FILE, read_evaluation_ids
from data_loading.description import KITS19
from data_loading.sampler import EpochShape, balance_by_cost
from data_loading.source import DataSummary, DataUse, Loaders, LoaderSettings

TRAIN_CASES = 168
EVAL_CASES = 42
DISTINCT_BATCHES = 2


def _derived_seed(seed: int, stream: int, rank: int) -> int:
    """A 63-bit seed (``manual_seed`` takes a signed 64-bit range) for ``(seed, stream, rank)``."""
    # Shift a Python int: numpy 1.x has no right_shift for a uint64 scalar and a Python int.
    return int(np.random.SeedSequence([seed, stream, rank]).generate_state(1, np.uint64)[0]) >> 1


def random_batch(generator: torch.Generator, batch: int, shape: Sequence[int],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(image float32 N(0, 1), label uint8 in 0..len(KITS19.labels)-1)``, both ``(batch, 1, *shape)``, on
    ``device`` (drawn on the CPU from ``generator`` so every device gets the same values)."""
    size = (batch, 1, *shape)
    image = torch.randn(size, generator=generator)
    label = torch.randint(0, len(KITS19.labels), size, generator=generator, dtype=torch.uint8)
    return image.to(device), label.to(device)


class SyntheticTrainLoader(EpochShape):
    """Random training batches with the real loader's interface."""

    def __init__(self, seed: int, patch: Sequence[int], batch_size: int, num_shards: int,
                 rank: int, device: torch.device, num_cases: int = TRAIN_CASES, ga_steps: int = 1,
                 last_batch: str = "pad"):
        self.num_cases, self.batch_size, self.num_shards = num_cases, batch_size, num_shards
        self.rank, self.ga_steps, self.last_batch = rank, ga_steps, last_batch
        self.epoch = 1
        self.cache = "synthetic"
        generator = torch.Generator().manual_seed(_derived_seed(seed, 0, rank))
        self._batches = [random_batch(generator, batch_size, patch, device)
                         for _ in range(min(DISTINCT_BATCHES, max(1, len(self))))]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step in range(len(self)):
            yield self._batches[step % len(self._batches)]


class SyntheticEvalLoader:
    """Random evaluation volumes ``(1, 1, *shape)`` with case ids, this rank's share."""

    def __init__(self, seed: int, shape: Sequence[int], case_ids: Sequence[str], num_cases: int,
                 device: torch.device):
        self.case_ids, self.num_cases = list(case_ids), num_cases
        generator = torch.Generator().manual_seed(_derived_seed(seed, 1, 0))
        self._volume = random_batch(generator, 1, shape, device)

    def __len__(self) -> int:
        return len(self.case_ids)

    def volume_shapes(self) -> None:
        """Not told: ``--benchmark`` warms the window batch alone and times every volume (each one
        window), as it always has for generated tensors."""
        return None

    def scan_region(self, case_id: str, shape: Sequence[int]) -> None:
        """Generated volumes have no geometry record: unknown."""
        return None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, str]]:
        for case_id in self.case_ids:
            yield (*self._volume, case_id)


def evaluation_ids(count: int = EVAL_CASES) -> list[str]:
    """The real evaluation ids when the list is readable, else ``00000``, ``00001``, ..."""
    ids = read_evaluation_ids(EVALUATION_CASES_FILE) if EVALUATION_CASES_FILE.is_file() else []
    return ids[:count] if len(ids) >= count else [f"{i:05d}" for i in range(count)]


class SyntheticData:
    """``--loader synthetic`` as a data source (the interface of ``PreprocessedData``)."""

    def description(self) -> None:
        """Generated tensors describe no dataset: KiTS19's labels."""
        return None

    def summary(self, use: DataUse) -> DataSummary:
        return DataSummary(TRAIN_CASES, EVAL_CASES, 0)

    def loaders(self, settings: LoaderSettings, num_shards: int, global_rank: int,
                device: torch.device | None = None) -> Loaders:
        return get_synthetic_loaders(settings, num_shards, global_rank, device)


def get_synthetic_loaders(settings: LoaderSettings, num_shards: int, global_rank: int,
                          device: torch.device | None = None) -> Loaders:
    """This rank's loaders of random tensors; the contract of ``get_data_loaders``."""
    device = device if device is not None else torch.device("cpu")
    train = SyntheticTrainLoader(settings.seed, settings.patch, settings.batch_size, num_shards,
                                 global_rank, device, ga_steps=settings.ga_steps, last_batch=settings.last_batch)
    ids = evaluation_ids()
    shards = balance_by_cost([1] * len(ids), num_shards)     # equal volumes: equal cost
    val = SyntheticEvalLoader(settings.seed, settings.window,
                              [ids[i] for i in shards[global_rank]], len(ids), device)
    return Loaders(train, val)
