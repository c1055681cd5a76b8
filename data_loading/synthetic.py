"""Synthetic KiTS19: CT-like volumes in the raw KiTS19 layout, for tests, demos and benchmarks.

Writes ``OUTPUT/case_XXXXX/imaging.nii.gz`` (int16 Hounsfield-like units) and
``segmentation.nii.gz`` (uint8: 0 background, 1 kidney, 2 tumour) with the KiTS19 conventions:
array axes (slices, height, width), ``pixdim[1:4]`` the spacing in that same order, an affine
like the KiTS19 files', anisotropic spacing that varies per case. Every fourth case has exactly
the benchmark's target spacing (1.6, 1.2, 1.2) in its header. Cases with id >= 210 get no
segmentation, like the unlabelled cases of newer KiTS downloads.

Beside the cases it writes ``OUTPUT/synthetic.json`` (:data:`MARKER_NAME`), a marker naming the
folder synthetic, its generator, seeds and case ids; ``preprocess_dataset.py`` copies it into the
preprocessed folder, and a training run on that folder is then not a closed MLPerf result
(``runtime.division.data_reasons``: "synthetic data is not KiTS19").

The anatomy (a body of soft tissue in a fat layer, a spine, two kidneys with a tumour in one or
both) is laid out in coordinates relative to the field of view, so it looks alike at any size.
The tumours are large and have a contrast of several noise standard deviations against both
kidney and soft tissue, so that a small network can learn them within a few CPU minutes.

``--labels kits23`` makes KiTS23-like cases instead: every case labelled whatever its id (KiTS23's
ids go up to 588), with a cyst (label 3) in a kidney, and a ``dataset.json`` description beside
them (:mod:`data_loading.description`: KiTS23's four labels). ``--layout imagesTr`` writes
nnU-Net's flat layout (``imagesTr/case_XXXXX_0000.nii.gz``, ``labelsTr/case_XXXXX.nii.gz``).

Usage::

    python -m data_loading.synthetic --output_dir RAW --cases 8 --seed 0 \
        [--size small|medium|realistic] [--start_id 0] [--labels kits19|kits23] \
        [--layout case_folders|imagesTr]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from data_loading.cli_types import OneLineParser, non_negative_int
from data_loading.description import KITS19

TARGET_SPACING = KITS19.target_spacing  # the benchmark's target spacing, (slices, height, width), mm
FIRST_UNLABELLED_ID = KITS19.first_unlabelled_id
# The marker a generated folder carries (and its preprocessed folder, copied by preprocessing).
MARKER_NAME = "synthetic.json"
GENERATOR = "data_loading.synthetic"

# Hounsfield-like levels (int16 in the file). After the benchmark's clip to [-79, 304] and
# normalisation (x - 101) / 76.9: tissue -0.92, tumour +0.05, kidney +1.03, with noise 0.16.
AIR_HU = -1000
FAT_HU = -100
SOFT_TISSUE_HU = 30
BONE_HU = 700
KIDNEY_HU = 180
TUMOUR_HU = 105
# A cyst (KiTS23's label 3). Real cysts are water-like (0-20 HU), close to soft tissue; here
# darker, -1.8 after normalisation, so that a small network tells it from tissue in minutes.
CYST_HU = -40
KITS23_LABELS = {"background": 0, "kidney": 1, "tumor": 2, "cyst": 3}
LABEL_SETS = ("kits19", "kits23")
NOISE_HU = 12.0


@dataclass(frozen=True)
class SizePreset:
    """Ranges (inclusive) drawn per case.

    ``slices`` and ``pixels`` are the raw array sizes (height == width, as in CT);
    ``out_slices`` and ``out_pixels`` the sizes after resampling to the target spacing, from
    which the spacing follows: ``spacing = target * out / raw``.
    """

    slices: tuple[int, int]
    pixels: tuple[int, int]
    out_slices: tuple[int, int]
    out_pixels: tuple[int, int]


PRESETS = {
    # ~60-140 voxels per axis; after resampling 112-150, so some axes need padding to 128.
    "small": SizePreset(slices=(60, 140), pixels=(90, 140), out_slices=(112, 150),
                        out_pixels=(112, 150)),
    # A quarter of KiTS19's voxel count, for quicker trials at about the benchmark's
    # preprocessed size.
    "medium": SizePreset(slices=(220, 360), pixels=(260, 320), out_slices=(170, 210),
                         out_pixels=(230, 270)),
    # KiTS19 scale: 512 x 512 in-plane, 300-600 slices, about 190 x 250 x 250 after
    # resampling (the sizes the benchmark's preprocessing sees). The slowest preset to write
    # (docs/performance.md, "Preprocessing").
    "realistic": SizePreset(slices=(300, 600), pixels=(512, 512), out_slices=(170, 210),
                            out_pixels=(230, 270)),
}


@dataclass(frozen=True)
class SyntheticCase:
    """One generated case. ``image`` int16 and ``label`` uint8 have shape (D, H, W)."""

    case_id: int
    image: np.ndarray
    label: np.ndarray
    spacing: tuple[float, float, float]


def case_rng(seed: int, case_id: int) -> np.random.Generator:
    """Independent stream per (seed, case): same case, same seed -> same volume, any order."""
    return np.random.default_rng([seed, case_id])


def draw_geometry(rng: np.random.Generator, preset: SizePreset,
                  target_spacing: bool) -> tuple[tuple[int, int, int], tuple[float, ...]]:
    """Array shape (D, H, W) and spacing (mm, same order) of one case."""
    out_d = int(rng.integers(preset.out_slices[0], preset.out_slices[1] + 1))
    out_hw = int(rng.integers(preset.out_pixels[0], preset.out_pixels[1] + 1))
    if target_spacing:
        return (out_d, out_hw, out_hw), TARGET_SPACING
    depth = int(rng.integers(preset.slices[0], preset.slices[1] + 1))
    pixels = int(rng.integers(preset.pixels[0], preset.pixels[1] + 1))
    spacing_d = round(TARGET_SPACING[0] * out_d / depth, 3)
    spacing_hw = round(TARGET_SPACING[1] * out_hw / pixels, 3)
    return (depth, pixels, pixels), (spacing_d, spacing_hw, spacing_hw)


def _axis_coords(size: int) -> np.ndarray:
    """Voxel centres of one axis in field-of-view units, -1 .. 1 (float32)."""
    return ((np.arange(size, dtype=np.float32) + 0.5) / size * 2 - 1).astype(np.float32)


def _ellipsoid(shape: Sequence[int], centre: Sequence[float], radii: Sequence[float]):
    """Mask of an axis-aligned ellipsoid, computed only inside its bounding box.

    ``centre`` and ``radii`` are in field-of-view units per axis. Returns ``(slices, mask)``:
    the bounding box as a tuple of slices and the boolean mask within it.
    """
    box, terms = [], []
    for axis, (size, c, r) in enumerate(zip(shape, centre, radii)):
        coords = _axis_coords(size)
        lo = int(np.searchsorted(coords, c - r))
        hi = int(np.searchsorted(coords, c + r, side="right"))
        box.append(slice(lo, max(lo, hi)))
        term = ((coords[lo:hi] - c) / r) ** 2
        view = [1, 1, 1]
        view[axis] = -1
        terms.append(term.reshape(view))
    return tuple(box), (terms[0] + terms[1] + terms[2]) <= 1.0


def make_case(case_id: int, shape: Sequence[int], spacing: Sequence[float],
              rng: np.random.Generator, cyst: bool = False) -> SyntheticCase:
    """Draw the anatomy of one case on an array of ``shape`` (D, H, W); with ``cyst``, a cyst
    (label 3) in the second kidney (drawn after the KiTS19 anatomy: without it the random
    stream, so each KiTS19-like case, is as before)."""
    depth, height, width = shape
    image = np.full(shape, AIR_HU, dtype=np.int16)
    label = np.zeros(shape, dtype=np.uint8)

    # Body: an elliptic cylinder along the slices, a fat layer around soft tissue.
    y = _axis_coords(height)[:, None]
    x = _axis_coords(width)[None, :]
    ry, rx = rng.uniform(0.70, 0.85), rng.uniform(0.82, 0.95)
    body_r2 = (y / ry) ** 2 + (x / rx) ** 2
    image[:, body_r2 <= 1.0] = FAT_HU
    image[:, body_r2 <= 0.80] = SOFT_TISSUE_HU
    spine = ((y - 0.45 * ry) / 0.12) ** 2 + (x / 0.10) ** 2 <= 1.0
    image[:, spine] = BONE_HU

    centre_d = rng.uniform(-0.15, 0.15)
    kidneys = []
    for side, has_tumour in ((-1, True), (1, bool(rng.random() < 0.5))):
        centre = (centre_d + rng.uniform(-0.1, 0.1), 0.22 * ry + rng.uniform(-0.05, 0.05),
                  side * rng.uniform(0.33, 0.42) * rx)
        radii = (rng.uniform(0.30, 0.40), rng.uniform(0.17, 0.22), rng.uniform(0.14, 0.18))
        box, mask = _ellipsoid(shape, centre, radii)
        image[box][mask] = KIDNEY_HU
        label[box][mask] = 1
        kidneys.append((centre, radii))
        if has_tumour:
            # A sphere-like blob in kidney-relative units, kept inside the kidney.
            r = rng.uniform(0.60, 0.80)
            direction = rng.normal(size=3)
            offset = direction / np.linalg.norm(direction) * rng.uniform(0.0, 0.95 - r)
            t_centre = [c + o * rr for c, o, rr in zip(centre, offset, radii)]
            t_box, t_mask = _ellipsoid(shape, t_centre, [r * rr for rr in radii])
            image[t_box][t_mask] = TUMOUR_HU
            label[t_box][t_mask] = 2

    if cyst:
        # A sphere-like blob at the second kidney's pole away from the slices' centre.
        centre, radii = kidneys[1]
        r = rng.uniform(0.40, 0.50)
        c_centre = [centre[0] + 0.45 * radii[0] * rng.choice((-1, 1)), centre[1], centre[2]]
        c_box, c_mask = _ellipsoid(shape, c_centre, [r * rr for rr in radii])
        image[c_box][c_mask] = CYST_HU
        label[c_box][c_mask] = 3
    noise = rng.standard_normal(size=shape, dtype=np.float32)
    noise *= NOISE_HU
    image += np.rint(noise).astype(np.int16)
    return SyntheticCase(case_id, image, label, tuple(float(s) for s in spacing))


def kits_affine(spacing: Sequence[float]) -> np.ndarray:
    """An affine like KiTS19's: array axis 0 (slices) maps to z, with negated directions."""
    sd, sh, sw = spacing
    return np.array([[0.0, 0.0, -sw, 0.0],
                     [0.0, -sh, 0.0, 0.0],
                     [-sd, 0.0, 0.0, 0.0],
                     [0.0, 0.0, 0.0, 1.0]])


def save_case(case: SyntheticCase, output_dir: str, labelled: bool, layout: str = "case_folders") -> str:
    """Write ``output_dir/case_XXXXX/{imaging,segmentation}.nii.gz`` (``layout="imagesTr"``:
    ``output_dir/imagesTr/case_XXXXX_0000.nii.gz`` and ``labelsTr/case_XXXXX.nii.gz``); returns
    the case folder (the image's folder)."""
    import nibabel

    name = f"case_{case.case_id:05d}"
    if layout == "imagesTr":
        folder = os.path.join(output_dir, "imagesTr")
        paths = (os.path.join(folder, f"{name}_0000.nii.gz"), os.path.join(output_dir, "labelsTr", f"{name}.nii.gz"))
    else:
        folder = os.path.join(output_dir, name)
        paths = (os.path.join(folder, "imaging.nii.gz"), os.path.join(folder, "segmentation.nii.gz"))
    affine = kits_affine(case.spacing)
    items = [(paths[0], case.image)]
    if labelled:
        items.append((paths[1], case.label))
    for path, array in items:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        nifti = nibabel.Nifti1Image(array, affine)
        nifti.header.set_zooms(case.spacing)  # pixdim[1:4] in array-axis order
        nibabel.save(nifti, path)
    return folder


def write_description(output_dir: str, layout: str = "case_folders") -> str:
    """The KiTS23-like set's description, ``output_dir/dataset.json`` (data_loading.description):
    its four labels and its layout; returns its path."""
    from data_loading.description import DESCRIPTION_FILE

    record = {"name": "synthetic KiTS23-like", "labels": KITS23_LABELS, "file_ending": ".nii.gz",
              "layout": layout, "channel_names": {"0": "CT"}}
    if layout == "case_folders":
        record.update(image_file="imaging.nii.gz", label_file="segmentation.nii.gz")
    path = os.path.join(output_dir, DESCRIPTION_FILE)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1)
        handle.write("\n")
    return path


def read_marker(folder: str) -> dict | None:
    """The synthetic marker of ``folder`` (:data:`MARKER_NAME`), or None when it has none. A
    marker that cannot be read or parsed still marks the folder: ``{}``."""
    path = os.path.join(folder, MARKER_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def marker_text(record: dict | None) -> str:
    """The marker in words for one line: its generator and seeds."""
    record = record or {}
    seeds = sorted({g.get("seed") for g in record.get("generations", []) if isinstance(g, dict)
                    and isinstance(g.get("seed"), int)})
    return (f"{record.get('generator', GENERATOR)}"
            + (f", seed {', '.join(map(str, seeds))}" if seeds else ""))


def write_marker(output_dir: str, seed: int, size: str, ids: Sequence[int], labels: str = "kits19") -> str:
    """Record one generation in ``output_dir``'s marker (:data:`MARKER_NAME`), keeping the
    generations already recorded there (cases added with ``--start_id``); returns its path."""
    record = read_marker(output_dir) or {}
    generations = [g for g in record.get("generations", []) if isinstance(g, dict)]
    generation = {"seed": seed, "size": size, "case_id_range": [min(ids), max(ids)] if ids else []}
    if labels != "kits19":
        generation["labels"] = labels
    generations.append(generation)
    record = {"synthetic": True, "generator": GENERATOR,
              "note": "synthetic KiTS19-like volumes, not KiTS19: a run on them is not a closed MLPerf result",
              "generations": generations}
    path = os.path.join(output_dir, MARKER_NAME)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1)
        handle.write("\n")
    return path


def generate(output_dir: str, cases: int, seed: int = 0, size: str = "small",
             start_id: int = 0, labels: str = "kits19", layout: str = "case_folders") -> list[int]:
    """Generate ``cases`` cases with ids ``start_id ..``; returns the ids written. The folder's
    marker (:func:`write_marker`) records them. ``labels="kits23"``: every case labelled, with a
    cyst, and the description beside them (:func:`write_description`)."""
    preset = PRESETS[size]
    ids = list(range(start_id, start_id + cases))
    kits23 = labels == "kits23"
    os.makedirs(output_dir, exist_ok=True)
    write_marker(output_dir, seed, size, ids, labels)
    if kits23:
        write_description(output_dir, layout)
    for case_id in ids:
        rng = case_rng(seed, case_id)
        shape, spacing = draw_geometry(rng, preset, target_spacing=case_id % 4 == 0)
        case = make_case(case_id, shape, spacing, rng, cyst=kits23)
        save_case(case, output_dir, labelled=kits23 or case_id < FIRST_UNLABELLED_ID, layout=layout)
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m data_loading.synthetic", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True,
                        help="raw dataset folder to write case_XXXXX/ folders into")
    parser.add_argument("--cases", type=non_negative_int, default=8,
                        help="number of cases (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--size", choices=sorted(PRESETS), default="small",
                        help="size preset (default small)")
    parser.add_argument("--start_id", type=non_negative_int, default=0,
                        help="id of the first case (default 0); ids >= 210 get no segmentation (kits19)")
    parser.add_argument("--labels", choices=LABEL_SETS, default="kits19",
                        help="kits19 (default): labels 0-2; kits23: every case labelled, a cyst (3) "
                             "in each, and a dataset.json description beside them")
    parser.add_argument("--layout", choices=("case_folders", "imagesTr"), default="case_folders",
                        help="case_folders (default, KiTS's) or imagesTr (nnU-Net's imagesTr/labelsTr)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        os.makedirs(args.output_dir, exist_ok=True)
    except OSError as exc:
        print(f"--output_dir {args.output_dir}: cannot create: {exc.strerror}", file=sys.stderr)
        return 1
    start = time.perf_counter()
    if args.layout != "case_folders" and args.labels == "kits19":
        print("--layout imagesTr needs a description: use it with --labels kits23", file=sys.stderr)
        return 2
    ids = generate(args.output_dir, args.cases, args.seed, args.size, args.start_id, args.labels, args.layout)
    unlabelled = 0 if args.labels == "kits23" else sum(i >= FIRST_UNLABELLED_ID for i in ids)
    note = f" ({unlabelled} without segmentation)" if unlabelled else ""
    print(f"wrote {len(ids)} {args.size} synthetic cases{note} to {args.output_dir} "
          f"in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
