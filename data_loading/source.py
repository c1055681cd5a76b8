"""What a data source gives the runtime: a summary before anything is built, then this rank's loaders.

``data_loading.data_loader.data_source(config)`` picks the source: the preprocessed folder
(``PreprocessedData``) or random tensors (``SyntheticData``, ``--loader synthetic``); tests pass
their own. Each source imports this module and neither imports the other.

The runtime asks a source in the data's terms: :class:`DataUse` (what the run reads: ``summary``
checks the data has it) and :class:`LoaderSettings` (how ``loaders`` builds this rank's loaders:
the resolved plan's values, ``runtime.build.loader_settings``). A source's loaders are a
:class:`Loaders` pair: a :class:`TrainLoader` and an :class:`EvalLoader`, the protocols the
training loop, the evaluation and the benchmarks read them by.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Protocol, Sequence

import torch


@dataclass(frozen=True)
class DataSummary:
    """What the runtime must know of a dataset before it builds anything."""

    num_train: int  # training cases
    num_eval: int  # evaluation cases
    train_bytes: int = 0  # the training volumes in memory (image float32 + label uint8)
    # the folder's synthetic marker in words (data_loading.synthetic.MARKER_NAME), "" when it has
    # none: its data is not KiTS19, so the run is not closed (runtime.division.data_reasons)
    synthetic: str = ""


@dataclass(frozen=True)
class DataUse:
    """What a run reads of the data, which ``summary`` checks it has: the training cases, cut into
    ``patch``-sized crops (``trains``), and every evaluation case (``evaluates``: a run that scores
    them; ``--benchmark`` times some and needs none)."""

    trains: bool = True
    evaluates: bool = True
    patch: tuple[int, ...] = (128, 128, 128)

    @classmethod
    def of_flags(cls, flags) -> "DataUse":
        """The use of a run of the parsed flags (``runtime.config.Config``: its mode and ``--input_shape``)."""
        return cls(trains=flags.mode.trains, evaluates=not flags.mode.benchmark, patch=tuple(flags.input_shape))


@dataclass(frozen=True)
class LoaderSettings:
    """How a source builds this rank's loaders: the training loader's (built now, its cases
    checked, where the run ``trains``; else at its first iteration) seed, cache (none, memory or
    device: decided), patch, batch, gradient accumulation, last batch, crop sampler (``--semantics``),
    oversampling, brightness, workers and prefetch depth, and the evaluation's window and overlap
    (its cases are shared between ranks by their windows)."""

    seed: int
    cache: str
    patch: tuple[int, ...]
    batch_size: int
    trains: bool = True
    ga_steps: int = 1
    last_batch: str = "pad"
    crop: str = "reference"
    oversampling: float = 0.4
    brightness: str = "reference"
    num_workers: int = 8
    prefetch: int = 2
    window: tuple[int, ...] = (128, 128, 128)
    overlap: float = 0.5

    @classmethod
    def of_flags(cls, flags) -> "LoaderSettings":
        """The settings of the parsed flags (``runtime.config.Config``) of a tool that plans nothing:
        its ``--seed`` (>= 0) and ``--cache`` (not auto) as given, its window ``--val_input_shape``."""
        if flags.seed < 0 or flags.cache == "auto":
            raise ValueError("the loaders need a seed >= 0 and a cache mode decided (not auto)")
        return cls(seed=flags.seed, cache=flags.cache, patch=tuple(flags.input_shape), batch_size=flags.batch_size,
                   trains=flags.mode.trains, ga_steps=flags.ga_steps, last_batch=flags.last_batch,
                   crop=flags.semantics, oversampling=flags.oversampling, brightness=flags.brightness,
                   num_workers=flags.num_workers, prefetch=flags.prefetch, window=tuple(flags.val_input_shape),
                   overlap=flags.overlap)


class TrainLoader(Protocol):
    """This rank's training batches: ``set_epoch(epoch)`` (epochs from 1) before iterating each
    epoch; yields ``(image, label)``, float32 and uint8, ``(B, 1, *patch)``; ``len()`` = batches
    per epoch on this rank; ``num_cases`` = training cases."""

    num_cases: int

    def set_epoch(self, epoch: int) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    @property
    def samples_trained(self) -> int:
        """Samples of the data all ranks train per epoch (padding not counted)."""

    def step_weights(self, batch_index: int) -> Sequence[float] | None:
        """The loss weights of this rank's batch ``batch_index`` when its optimizer step holds
        padding (``--last_batch pad``: ``data_loading.sampler.step_weights``), else None."""


class EvalLoader(Protocol):
    """This rank's evaluation volumes, whole, one at a time: ``(image, label, case_id)``, each
    ``(1, 1, D, H, W)``; ``len()`` = cases on this rank; ``num_cases`` = evaluation cases on all ranks."""

    num_cases: int

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, str]]: ...

    def volume_shapes(self) -> list[tuple[int, ...]] | None:
        """The spatial shape of each of this rank's volumes, in order (None: not known before they
        are read)."""

    def scan_region(self, case_id: str, shape: Sequence[int]) -> tuple[slice, ...] | None:
        """The scan inside case ``case_id``'s stored volume of ``shape`` (the padding preprocessing
        added left out), None where unknown."""


class Loaders(NamedTuple):
    """A source's loaders for this rank."""

    train: TrainLoader
    eval: EvalLoader


class DataSource(Protocol):
    def description(self):
        """What the data says of itself, before anything of it is read: the preprocessed folder's
        description (``data_loading.description.folder_description``: labels, target spacing,
        split), None for KiTS19's folder (it has none) and for generated tensors. One small file,
        no case: read before the MLPerf ``run_start``; the source keeps it for its split."""

    def summary(self, use: DataUse) -> DataSummary:
        """Checks the data once for ``use`` (raises ``DataError``, one line) and counts it."""

    def loaders(self, settings: LoaderSettings, num_shards: int, global_rank: int, device: Any = None) -> Loaders:
        """This rank's :class:`Loaders` (see ``data_loading.data_loader``)."""
