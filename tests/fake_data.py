"""A tiny deterministic data source (the interface of data_loading.data_loader.PreprocessedData,
``data_loading.source``'s protocols) for runtime tests: ``run(config, data=FakeData())``."""
from __future__ import annotations

import numpy as np
import torch


def _volume(case: int, shape):
    rng = np.random.default_rng(case)
    label = np.zeros(shape, np.uint8)
    c = [s // 2 for s in shape]
    r = max(3, min(shape) // 4)
    grid = np.ogrid[tuple(slice(0, s) for s in shape)]
    dist2 = sum((g - cc) ** 2 for g, cc in zip(grid, c))
    label[dist2 < r * r] = 1
    label[dist2 < (r // 2) ** 2] = 2
    image = (label * 1.5 + rng.normal(0, 0.3, shape)).astype(np.float32)
    return torch.from_numpy(image)[None], torch.from_numpy(label)[None]


class FakeTrainLoader:
    def __init__(self, cases, batch_size, patch, seed, world, rank):
        self.cases, self.batch, self.patch, self.seed = cases, batch_size, patch, seed
        self.world, self.rank, self.epoch = world, rank, 0
        self.num_cases = len(cases)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.cases) // self.world // self.batch

    @property
    def samples_trained(self):
        return len(self) * self.world * self.batch  # the remainder is dropped: no padding

    def step_weights(self, batch_index):
        return None

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.cases))
        mine = order[self.rank::self.world]
        for b in range(len(self)):
            imgs, labels = [], []
            for index in mine[b * self.batch:(b + 1) * self.batch]:
                rng = np.random.default_rng([self.seed, self.epoch, int(index)])
                image, label = _volume(self.cases[index], [s + 8 for s in self.patch])
                o = [int(rng.integers(0, 9)) for _ in range(3)]
                sl = tuple(slice(a, a + s) for a, s in zip(o, self.patch))
                imgs.append(image[(slice(None), *sl)])
                labels.append(label[(slice(None), *sl)])
            yield torch.stack(imgs), torch.stack(labels)


class FakeValLoader:
    def __init__(self, cases, shape, world, rank):
        self.all_cases = cases
        self.cases = cases[rank::world]
        self.num_cases = len(cases)
        self.shape = shape

    def __len__(self):
        return len(self.cases)

    def volume_shapes(self):
        return None  # not told: the benchmark times every volume

    def scan_region(self, case_id, shape):
        return None  # no geometry record

    def __iter__(self):
        for case in self.cases:
            image, label = _volume(case, self.shape)
            yield image[None], label[None], f"{case:05d}"


class FakeData:
    def __init__(self, n_train=6, n_val=3, val_shape=(40, 36, 44)):
        self.n_train, self.n_val, self.val_shape = n_train, n_val, val_shape

    def description(self):
        return None

    def summary(self, use):
        from data_loading.source import DataSummary

        return DataSummary(self.n_train, self.n_val, 0)

    def loaders(self, settings, num_shards, global_rank, device=None):
        from data_loading.source import Loaders

        train = FakeTrainLoader(list(range(self.n_train)), settings.batch_size, settings.patch, settings.seed,
                                num_shards, global_rank)
        val = FakeValLoader(list(range(100, 100 + self.n_val)), self.val_shape, num_shards, global_rank)
        return Loaders(train, val)
