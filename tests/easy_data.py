"""A preprocessed-format dataset a tiny network learns in a few CPU epochs.

Each case is a 40x40x72 volume: a kidney ball with a tumour ball inside, intensities well apart
(background -2 like air after the benchmark's normalisation, so that the evaluator's -2.2
padding looks like background; kidney 0.5, tumour 2) under Gaussian noise. Ids 0..n-1 so that the official
evaluation ids fall inside the set.
"""
from __future__ import annotations

import os

import numpy as np

SHAPE = (40, 40, 72)


def make_case(case: int, shape=SHAPE):
    rng = np.random.default_rng(1000 + case)
    grid = np.stack(np.meshgrid(*[np.arange(s) for s in shape], indexing="ij"))
    centre = np.array([rng.uniform(12, s - 12) for s in shape])[:, None, None, None]
    dist = np.sqrt(((grid - centre) ** 2).sum(0))
    kidney_r = rng.uniform(9, 12)
    label = np.zeros(shape, np.uint8)
    label[dist < kidney_r] = 1
    offset = np.array(rng.uniform(-2, 2, 3))[:, None, None, None]
    tumour_dist = np.sqrt(((grid - centre - offset) ** 2).sum(0))
    label[tumour_dist < rng.uniform(6, 7.5)] = 2
    image = np.choose(label, [-2.0, 0.5, 2.0]) + rng.normal(0, 0.2, shape)
    return image.astype(np.float32)[None], label[None]


def write_dataset(folder: str, case_ids) -> str:
    os.makedirs(folder, exist_ok=True)
    for case in case_ids:
        image, label = make_case(case)
        np.save(os.path.join(folder, f"case_{case:05d}_x.npy"), image, allow_pickle=False)
        np.save(os.path.join(folder, f"case_{case:05d}_y.npy"), label, allow_pickle=False)
    return folder
