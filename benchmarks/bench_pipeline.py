"""Training data pipeline throughput: samples/s of ``--patch`` crops, the reference's per-sample way (the baseline:
whole-volume ``np.load`` and, for foreground crops, ``np.unique`` + ``scipy.ndimage.label``; also labelling every
sample) against this pipeline's ``none``, ``memory`` (0 and 2 workers) and ``device`` caches (batched torch path
on the CPU, and CUDA where there is one), on ``--cases`` random-blob volumes of ``--shape`` (KiTS19 sizes)."""
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

from benchmarks.harness import header, table, training_ids, write_blob_cases
from data_loading.data_loader import get_data_loaders
from runtime.config import Config


def naive_sample(x_path, y_path, patch, oversampling, rng, label_every_sample=False):
    """One training sample the reference's way: whole-volume loads, and whole-volume labelling
    for foreground crops (``label_every_sample``: for every sample, the worst case)."""
    image, label = np.load(x_path), np.load(y_path)
    shape = label.shape[1:]
    start = [int(rng.integers(0, s - p + 1)) for s, p in zip(shape, patch)]
    foreground = rng.random() < oversampling
    if foreground or label_every_sample:
        components, _ = scipy.ndimage.label(label[0] == rng.choice(np.unique(label[label > 0])))
    if foreground:
        slices = sorted((s for s in scipy.ndimage.find_objects(components) if s is not None),
                        key=lambda sl: -np.prod([s.stop - s.start for s in sl]))[:2]
        for axis, (sl, size, p) in enumerate(zip(slices[int(rng.integers(len(slices)))], shape, patch)):
            extent = sl.stop - sl.start
            low = (sl.start - int(rng.integers(0, p - extent + 1)) if extent < p
                   else int(rng.integers(sl.start, sl.stop - p + 1)))
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
    paths = [(folder / f"case_{ids[int(i)]}_x.npy", folder / f"case_{ids[int(i)]}_y.npy")
             for i in rng.integers(len(ids), size=samples + 1)]
    naive_sample(*paths[0], patch, oversampling, rng, label_every_sample)     # warm-up
    start = time.perf_counter()
    for x_path, y_path in paths[1:]:
        naive_sample(x_path, y_path, patch, oversampling, rng, label_every_sample)
    return samples / (time.perf_counter() - start), 0.0


def time_pipeline(config, samples, device=None):
    """``(samples/s after the first batch (workers start up), seconds building the loaders)``."""
    start = time.perf_counter()
    train, _ = get_data_loaders(config, 1, 0, device)
    setup = time.perf_counter() - start
    done, epoch, timer = 0, 1, None
    while done < samples:
        train.set_epoch(epoch)
        for image, _ in train:
            if timer is None:
                timer = time.perf_counter()
                continue
            done += image.shape[0]
            if done >= samples:
                break
        epoch += 1
    return done / (time.perf_counter() - timer), setup


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
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
    ids, t0 = training_ids(args.cases), time.perf_counter()
    write_blob_cases(folder, ids, args.shape, np.random.default_rng(2026))
    print(f"wrote {args.cases} cases of {tuple(args.shape)} to {folder} in {time.perf_counter() - t0:.1f} s")
    patch = (args.patch,) * 3
    base = dataclasses.replace(Config(), data_dir=str(folder), input_shape=patch, seed=0, batch_size=args.batch_size,
                               oversampling=args.oversampling, benchmark=True, prefetch=2)
    rows = [(label, *time_naive(folder, ids, patch, args.oversampling, args.naive_samples, every)) for label, every
            in [("naive (reference-like, 1 process)", False), ("naive, labelling every sample", True)]]
    for label, cache, workers, device, samples in [
            ("cache none, 0 workers", "none", 0, None, args.samples),
            ("cache memory, 0 workers", "memory", 0, None, args.samples),
            ("cache memory, 2 workers", "memory", 2, None, args.samples),
            ("cache device, torch path on CPU", "device", 0, "cpu", args.samples),
            *[("cache device, CUDA", "device", 0, "cuda", args.samples * 20)] * torch.cuda.is_available()]:
        rows.append((label, *time_pipeline(dataclasses.replace(base, cache=cache, num_workers=workers), samples, device)))
    naive = rows[0][1]
    print(header("bench_pipeline", argv) + f"\npatch {patch}, batch {args.batch_size}, oversampling "
          f"{args.oversampling}, {torch.get_num_threads()} torch threads\n")
    print(table(["mode", "samples/s", "vs naive", "setup s"], [[m, r, f"{r / naive:.1f}x", s] for m, r, s in rows]))
    if not args.dir:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
