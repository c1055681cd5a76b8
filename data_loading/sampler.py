"""Which sample goes to which rank, in which order, with which random numbers.

Everything here is a pure function of (master seed, epoch, index): no global ``random`` or
``np.random`` state, so any number of workers, any rank and a resumed run see the same draws.

Training epoch ``e`` on ``W`` ranks with batch size ``B``, ``A`` accumulation steps (global batch
``G = B * W * A``) over ``N`` cases: the global order is ``perm = epoch_permutation(seed, e, N)``
(identical on every rank); rank ``r`` owns the positions ``r, r + W, r + 2W, ...``, so micro-batch
``k`` of every rank together covers the positions ``[k * W * B, (k + 1) * W * B)`` and optimizer
step ``s`` the positions ``[s * G, (s + 1) * G)``.

``last_batch`` says what happens when ``G`` does not divide ``N``:

* ``pad`` (the default; the rules: "each datum appears exactly once", "the last batch may be
  padded"): the order is padded to ``ceil(N / G) * G`` positions, the rules' samples per epoch;
  position ``i >= N`` repeats case ``perm[i - N]`` with weight 0 in the loss
  (:func:`step_weights`), so every rank runs the same number of same-shape steps and every case is
  trained once. Where ``G`` divides ``N`` nothing is padded and the batches are those of ``drop``.
* ``drop`` (the MLCommons reference's ``drop_last=True``; an open run): every rank trains the
  first ``(N // W) // B`` full batches of its shard; the rest is dropped.

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


LAST_BATCH_MODES = ("pad", "drop")


def padded_epoch(num_cases: int, global_batch: int) -> int:
    """The rules' samples per epoch: ``ceil(N / G) * G`` (a padded last batch counted)."""
    return -(-num_cases // global_batch) * global_batch


def batches_per_epoch(num_cases: int, num_shards: int, batch_size: int, ga_steps: int = 1,
                      last_batch: str = "pad") -> int:
    """Batches each rank trains per epoch (the same on every rank): with ``pad`` the padded epoch's
    (a multiple of ``ga_steps``), with ``drop`` the full batches of the rank's shard."""
    if last_batch not in LAST_BATCH_MODES:
        raise ValueError(f"last_batch must be one of {LAST_BATCH_MODES}, got {last_batch!r}")
    if last_batch == "drop":
        return (num_cases // num_shards) // batch_size
    return padded_epoch(num_cases, batch_size * num_shards * ga_steps) // (batch_size * num_shards)


def real_samples_per_epoch(num_cases: int, num_shards: int, batch_size: int, ga_steps: int = 1,
                           last_batch: str = "pad") -> int:
    """Samples of the data trained per epoch on all ranks (padding not counted)."""
    if last_batch == "pad":
        return num_cases
    return num_shards * batch_size * batches_per_epoch(num_cases, num_shards, batch_size, 1, "drop")


def step_weights(num_cases: int, num_shards: int, rank: int, batch_size: int, ga_steps: int,
                 batch_index: int) -> list[float] | None:
    """The loss weights of this rank's micro-batch ``batch_index`` (0-based) of a padded epoch, or
    None for a batch of a step without padding (which trains as it always did).

    In a step with ``R < G`` real samples, sample ``j`` weighs ``W / R`` when real and 0 when
    padding: the micro-batch's loss is ``sum_j w_j * loss_j``, DDP averages the ranks' gradients
    (``1 / W``) and accumulation sums the micro-batches, so the step's gradient is the mean over its
    ``R`` real samples, as a full step's (``w_j = 1 / (B * A)`` there) is over its ``G``.
    """
    global_batch = batch_size * num_shards * ga_steps
    real = min(global_batch, num_cases - (batch_index // ga_steps) * global_batch)
    if real >= global_batch:
        return None
    first = batch_index * batch_size * num_shards + rank
    return [num_shards / real if first + num_shards * j < num_cases else 0.0 for j in range(batch_size)]


def shard_positions(num_cases: int, num_shards: int, rank: int) -> range:
    """Global positions owned by ``rank`` (disjoint across ranks, together all positions)."""
    return range(rank, num_cases, num_shards)


def epoch_batches(seed: int, epoch: int, num_cases: int, num_shards: int, rank: int,
                  batch_size: int, ga_steps: int = 1, last_batch: str = "pad") -> list[list[SampleKey]]:
    """This rank's batches of ``epoch``, each a list of ``batch_size`` sample keys (a padding
    position ``i >= num_cases`` repeats case ``perm[i - num_cases]``)."""
    perm = epoch_permutation(seed, epoch, num_cases)
    count = batches_per_epoch(num_cases, num_shards, batch_size, ga_steps, last_batch)
    positions = shard_positions(count * batch_size * num_shards, num_shards, rank)
    keys = [(epoch, i, int(perm[i % num_cases])) for i in positions]
    return [keys[b * batch_size:(b + 1) * batch_size] for b in range(count)]


class EpochShape:
    """The epoch of one rank's training loader, from its ``num_cases``, ``num_shards``, ``rank``,
    ``batch_size``, ``ga_steps`` and ``last_batch`` attributes: the real and the synthetic loader
    share it."""

    num_cases: int
    num_shards: int
    rank: int
    batch_size: int
    ga_steps: int
    last_batch: str

    def __len__(self) -> int:
        return batches_per_epoch(self.num_cases, self.num_shards, self.batch_size, self.ga_steps, self.last_batch)

    @property
    def samples_trained(self) -> int:
        """Samples of the data all ranks train per epoch (padding not counted)."""
        return real_samples_per_epoch(self.num_cases, self.num_shards, self.batch_size, self.ga_steps,
                                      self.last_batch)

    def step_weights(self, batch_index: int) -> list[float] | None:
        """Loss weights of this rank's batch ``batch_index`` in a padded step, else None."""
        if self.last_batch != "pad":
            return None
        return step_weights(self.num_cases, self.num_shards, self.rank, self.batch_size, self.ga_steps,
                            batch_index)


class EpochBatchSampler:
    """Batch sampler for ``torch.utils.data.DataLoader``: yields this rank's batches of the
    current epoch as lists of :data:`SampleKey` (the epoch travels inside each key, so
    persistent workers need no per-epoch state)."""

    def __init__(self, seed: int, num_cases: int, num_shards: int, rank: int, batch_size: int,
                 ga_steps: int = 1, last_batch: str = "pad"):
        self.seed, self.num_cases, self.num_shards = seed, num_cases, num_shards
        self.rank, self.batch_size = rank, batch_size
        self.ga_steps, self.last_batch = ga_steps, last_batch
        self.epoch = 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return batches_per_epoch(self.num_cases, self.num_shards, self.batch_size, self.ga_steps,
                                 self.last_batch)

    def __iter__(self) -> Iterator[list[SampleKey]]:
        return iter(epoch_batches(self.seed, self.epoch, self.num_cases, self.num_shards,
                                  self.rank, self.batch_size, self.ga_steps, self.last_batch))


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
