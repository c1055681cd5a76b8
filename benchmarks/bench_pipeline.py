"""Training data pipeline throughput: the naive per-sample approach vs this pipeline.

Writes ``--cases`` random-blob volumes of ``--shape`` (realistic KiTS19 sizes after
preprocessing) to a temporary folder, then measures side by side, in one run, samples per
second of ``--patch`` crops:

* ``naive``: what the reference does per sample: ``np.load`` both whole volumes, and for a
  foreground crop (probability ``--oversampling``) ``np.unique`` + ``scipy.ndimage.label`` of the
  whole volume + ``find_objects``; crop, flips, cast, brightness, noise (the ratios are against
  this one); also with the labelling done for every sample;
* ``memory`` cache through ``get_data_loaders`` with 0 and 2 worker processes (background
  prefetch on), and ``none`` (re-read per sample, components cached);
* ``device`` cache, its batched torch path run on the CPU here (on a GPU it runs there).

Usage: ``python -m benchmarks.bench_pipeline [--samples 64] [--naive_samples 24]``.
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.ndimage
import torch

from benchmarks.harness import header, table, write_blob_case
from data_loading.data_loader import get_data_loaders
from data_loading.dataset import read_evaluation_ids
from runtime.arguments import Config


def naive_sample(x_path, y_path, patch, oversampling, rng, label_every_sample=False):
    """One training sample the reference's way: whole-volume loads, and whole-volume labelling
    for foreground crops (``label_every_sample``: for every sample, the worst case)."""
    image, label = np.load(x_path), np.load(y_path)
    shape = label.shape[1:]
    start = [int(rng.integers(0, s - p + 1)) for s, p in zip(shape, patch)]
    foreground = rng.random() < oversampling
    if foreground or label_every_sample:
        cls = rng.choice(np.unique(label[label > 0]))
        components, _ = scipy.ndimage.label(label[0] == cls)
    if foreground:
        slices = [s for s in scipy.ndimage.find_objects(components) if s is not None]
        slices.sort(key=lambda sl: -np.prod([s.stop - s.start for s in sl]))
        box = slices[:2][int(rng.integers(len(slices[:2])))]
        for axis, (sl, size, p) in enumerate(zip(box, shape, patch)):
            extent = sl.stop - sl.start
            if extent < p:
                low = sl.start - int(rng.integers(0, p - extent + 1))
            else:
                low = int(rng.integers(sl.start, sl.stop - p + 1))
            start[axis] = min(max(low, 0), size - p)
    index = (slice(None),) + tuple(slice(s, s + p) for s, p in zip(start, patch))
    image, label = image[index], label[index]
    for axis in (1, 2, 3):
        if rng.random() < 1 / 3:
            image, label = np.flip(image, axis).copy(), np.flip(label, axis).copy()
    image, label = image.astype(np.float32), label.astype(np.uint8)
    if rng.random() < 0.1:
        image = (image * (1 + rng.uniform(0.7, 1.3))).astype(np.float32)
    if rng.random() < 0.1:
        image = image + rng.normal(0, rng.uniform(0, 0.1), image.shape).astype(np.float32)
    return image, label


def time_naive(folder, ids, patch, oversampling, samples, label_every_sample=False):
    rng = np.random.default_rng(0)
    pick = [ids[int(i)] for i in rng.integers(len(ids), size=samples + 1)]
    paths = [(folder / f"case_{c}_x.npy", folder / f"case_{c}_y.npy") for c in pick]
    naive_sample(*paths[0], patch, oversampling, rng, label_every_sample)     # warm-up
    start = time.perf_counter()
    for x_path, y_path in paths[1:]:
        naive_sample(x_path, y_path, patch, oversampling, rng, label_every_sample)
    return samples / (time.perf_counter() - start), 0.0


def time_pipeline(config, samples, device=None):
    start = time.perf_counter()
    train, _ = get_data_loaders(config, 1, 0, device)
    setup = time.perf_counter() - start
    done, epoch, timer = 0, 1, None
    while done < samples + config.batch_size:
        train.set_epoch(epoch)
        for image, label in train:
            if timer is None:                                # first batch: workers start up
                timer = time.perf_counter()
                continue
            done += image.shape[0]
            if done >= samples:
                break
        epoch += 1
        if done >= samples:
            break
    return done / (time.perf_counter() - timer), setup


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--shape", type=int, nargs=3, default=[220, 240, 240])
    parser.add_argument("--patch", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--oversampling", type=float, default=0.4)
    parser.add_argument("--samples", type=int, default=64, help="samples timed per pipeline mode")
    parser.add_argument("--naive_samples", type=int, default=24)
    parser.add_argument("--dir", default=None, help="folder for the volumes (default: a temp dir)")
    args = parser.parse_args(argv)

    folder = Path(args.dir or tempfile.mkdtemp(prefix="bench_pipeline_"))
    folder.mkdir(parents=True, exist_ok=True)
    evaluation = set(read_evaluation_ids())
    ids = [f"{i:05d}" for i in range(1000) if f"{i:05d}" not in evaluation][:args.cases]
    rng = np.random.default_rng(2026)
    t0 = time.perf_counter()
    for case_id in ids:
        write_blob_case(folder, case_id, tuple(args.shape), rng)
    print(f"wrote {args.cases} cases of {tuple(args.shape)} to {folder} in "
          f"{time.perf_counter() - t0:.1f} s")
    patch = (args.patch,) * 3
    base = dataclasses.replace(Config(), data_dir=str(folder), input_shape=patch, seed=0,
                               batch_size=args.batch_size, oversampling=args.oversampling,
                               benchmark=True, prefetch=2)
    rows = [("naive (reference-like, 1 process)",
             *time_naive(folder, ids, patch, args.oversampling, args.naive_samples)),
            ("naive, labelling every sample",
             *time_naive(folder, ids, patch, args.oversampling, args.naive_samples, True))]
    for label, changes, device in [
            ("cache none, 0 workers", dict(cache="none", num_workers=0), None),
            ("cache memory, 0 workers", dict(cache="memory", num_workers=0), None),
            ("cache memory, 2 workers", dict(cache="memory", num_workers=2), None),
            ("cache device, torch path on CPU", dict(cache="device", num_workers=0), "cpu")]:
        config = dataclasses.replace(base, **changes)
        rows.append((label, *time_pipeline(config, args.samples, device)))
    if torch.cuda.is_available():
        config = dataclasses.replace(base, cache="device", num_workers=0)
        rows.append(("cache device, CUDA", *time_pipeline(config, args.samples * 20, "cuda")))

    naive = rows[0][1]
    print(header("bench_pipeline", argv) + f"\npatch {patch}, batch {args.batch_size}, oversampling "
          f"{args.oversampling}, {torch.get_num_threads()} torch threads\n")
    print(table(["mode", "samples/s", "vs naive", "setup s"], [[m, r, f"{r / naive:.1f}x", s] for m, r, s in rows]))
    if not args.dir:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
