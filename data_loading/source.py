"""What a data source gives the runtime: a summary before anything is built, then this rank's loaders.

``data_loading.data_loader.data_source(config)`` picks the source: the preprocessed folder
(``PreprocessedData``) or random tensors (``SyntheticData``, ``--loader synthetic``); tests pass
their own. Each source imports this module and neither imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class DataSummary:
    """What the runtime must know of a dataset before it builds anything."""

    num_train: int  # training cases
    num_eval: int  # evaluation cases
    train_bytes: int = 0  # the training volumes in memory (image float32 + label uint8)
    # the folder's synthetic marker in words (data_loading.synthetic.MARKER_NAME), "" when it has
    # none: its data is not KiTS19, so the run is not closed (runtime.division.data_reasons)
    synthetic: str = ""


class DataSource(Protocol):
    def description(self):
        """What the data says of itself, before anything of it is read: the preprocessed folder's
        description (``data_loading.description.folder_description``: labels, target spacing,
        split), None for KiTS19's folder (it has none) and for generated tensors. One small file,
        no case: read before the MLPerf ``run_start``; the source keeps it for its split."""

    def summary(self, config) -> DataSummary:
        """Checks the data once (raises ``DataError``, one line) and counts it."""

    def loaders(self, config, num_shards: int, global_rank: int, device: Any = None) -> tuple:
        """``(train_loader, val_loader)`` of this rank (see ``data_loading.data_loader``)."""
