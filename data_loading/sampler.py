"""Which sample goes to which rank, in which order, with which random numbers.

Everything here is a pure function of (master seed, epoch, index): no global ``random`` or
``np.random`` state, so any number of workers, any rank and a resumed run see the same draws.

Training epoch ``e`` on ``W`` ranks with batch size ``B`` over ``N`` cases:
the global order is ``perm = epoch_permutation(seed, e, N)`` (identical on every rank);
rank ``r`` owns the positions ``r, r + W, r + 2W, ...`` (shards are disjoint and cover the
epoch); every rank trains the first ``(N // W) // B`` full batches of its shard, so all ranks
take the same number of steps and incomplete batches are dropped everywhere.
Sample at global position ``i`` draws its augmentation from ``sample_rng(seed, e, i)``.
"""
from __future__ import annotations

import heapq
from typing import Iterator, Sequence

import numpy as np

# Stream tags keep the shuffle and the per-sample draws independent. (numpy's SeedSequence
# pads entropy with zeros, so [seed, epoch] and [seed, epoch, 0] would be the same stream.)
_SHUFFLE_STREAM = 1
_SAMPLE_STREAM = 2

# One training sample: (epoch, global position in the epoch, case index).
SampleKey = tuple[int, int, int]


def epoch_permutation(seed: int, epoch: int, num_cases: int) -> np.ndarray:
    """The epoch's global order of case indices (the same on all ranks)."""
    return np.random.default_rng([seed, epoch, _SHUFFLE_STREAM]).permutation(num_cases)


def sample_rng(seed: int, epoch: int, position: int) -> np.random.Generator:
    """The generator of every random draw of the sample at ``position`` of ``epoch``."""
    return np.random.default_rng([seed, epoch, _SAMPLE_STREAM, position])


def batches_per_epoch(num_cases: int, num_shards: int, batch_size: int) -> int:
    """Full batches each rank trains per epoch (the same on every rank)."""
    return (num_cases // num_shards) // batch_size


def shard_positions(num_cases: int, num_shards: int, rank: int) -> range:
    """Global positions owned by ``rank`` (disjoint across ranks, together all positions)."""
    return range(rank, num_cases, num_shards)


def epoch_batches(seed: int, epoch: int, num_cases: int, num_shards: int, rank: int,
                  batch_size: int) -> list[list[SampleKey]]:
    """This rank's batches of ``epoch``, each a list of ``batch_size`` sample keys."""
    perm = epoch_permutation(seed, epoch, num_cases)
    positions = shard_positions(num_cases, num_shards, rank)
    count = batches_per_epoch(num_cases, num_shards, batch_size)
    keys = [(epoch, i, int(perm[i])) for i in positions[:count * batch_size]]
    return [keys[b * batch_size:(b + 1) * batch_size] for b in range(count)]


class EpochBatchSampler:
    """Batch sampler for ``torch.utils.data.DataLoader``: yields this rank's batches of the
    current epoch as lists of :data:`SampleKey` (the epoch travels inside each key, so
    persistent workers need no per-epoch state)."""

    def __init__(self, seed: int, num_cases: int, num_shards: int, rank: int, batch_size: int):
        self.seed, self.num_cases, self.num_shards = seed, num_cases, num_shards
        self.rank, self.batch_size = rank, batch_size
        self.epoch = 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return batches_per_epoch(self.num_cases, self.num_shards, self.batch_size)

    def __iter__(self) -> Iterator[list[SampleKey]]:
        return iter(epoch_batches(self.seed, self.epoch, self.num_cases, self.num_shards,
                                  self.rank, self.batch_size))


def balance_by_cost(costs: Sequence[int], num_shards: int) -> list[list[int]]:
    """Assign items (e.g. evaluation volumes, cost = number of sliding windows) to shards.

    Largest first, each to the currently lightest shard (ties: lower index); every item goes to
    exactly one shard, a shard may get none. The heaviest and lightest shard differ by at most
    the largest single cost. Returns per shard the item indices, ascending.
    """
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    heap = [(0, shard) for shard in range(num_shards)]
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    for item in order:
        load, shard = heapq.heappop(heap)
        shards[shard].append(item)
        heapq.heappush(heap, (load + costs[item], shard))
    return [sorted(items) for items in shards]
