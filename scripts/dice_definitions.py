"""Why evaluate's Dice (the benchmark's) and predict's Dice differ on the same scan: a
reproducible example with the project's own functions (docs/reliability.md, "Two Dice numbers").

    python scripts/dice_definitions.py [--shape 61 95 97] [--spacing 3.0 0.8 0.8] [--seed 7]

One synthetic KiTS19-like case (default: a small thick-slice scan, as the held-back scans that
showed the difference) goes through ``preprocess_dataset.py``'s steps. Three "predictions" of
known quality are scored three ways:

* rows: the stored label itself (the benchmark's own answer); the ground truth resampled the
  way the image is (trilinear ``align_corners=True`` on its one-hot maps: what a model that
  segments the image sees); the same with the kidneys' footprint drawn into the 4 slices of
  min-shape padding next to the scan (what a model may draw in the replicated slices there);
* columns: the benchmark's Dice (the whole stored volume against the stored label: padding and
  label resampling included; what evaluate reports), the Dice inside the scan (padding excluded,
  still the stored label), and predict's Dice (back to the scan's grid, against the untouched
  ground truth).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from data_loading import preprocessing as pp  # noqa: E402
from data_loading import synthetic  # noqa: E402
from data_loading.scans import crop_padding, labels_in_original_grid, scan_geometry  # noqa: E402
from model.losses import label_map_dice  # noqa: E402
from model.unet3d import N_CLASSES  # noqa: E402


def one_hot(labels: np.ndarray) -> torch.Tensor:
    """(D, H, W) labels -> (N_CLASSES, D, H, W) float."""
    return F.one_hot(torch.from_numpy(labels.astype(np.int64)), N_CLASSES).permute(3, 0, 1, 2).float()


def resampled_like_the_image(label: np.ndarray, shape) -> np.ndarray:
    """The ground truth on the resampled grid as the image is resampled: trilinear
    ``align_corners=True`` on each class map, then the argmax."""
    maps = F.interpolate(one_hot(label)[None], size=tuple(shape), mode="trilinear", align_corners=True)[0]
    return maps.argmax(0).numpy().astype(np.uint8)


def mean_dice(prediction: np.ndarray, target: np.ndarray) -> str:
    kidney, tumour = label_map_dice(prediction, target)
    return f"{(kidney + tumour) / 2:.4f} ({kidney:.3f} / {tumour:.3f})"


def predictions(stored_label: np.ndarray, truth: np.ndarray, geometry) -> dict[str, np.ndarray]:
    """The three predictions on the stored (padded) grid."""
    image_way = resampled_like_the_image(truth, geometry.resampled)
    padded = np.pad(image_way, geometry.padding, mode="edge")   # as the image is padded
    with_slab = padded.copy()
    axis = int(np.argmax([b for b, _ in geometry.padding]))
    before = geometry.padding[axis][0]
    if before:  # the kidneys' footprint drawn into the 4 padded slices next to the scan on that axis
        footprint = np.expand_dims((padded > 0).any(axis=axis), axis)
        index = [slice(None)] * 3
        index[axis] = slice(max(0, before - 4), before)
        with_slab[tuple(index)] = np.where(footprint, 1, with_slab[tuple(index)])
    return {"the stored label (the benchmark's answer)": stored_label,
            "the ground truth resampled like the image": padded,
            "the same, with kidney in 4 padded slices": with_slab}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[61, 95, 97])
    parser.add_argument("--spacing", type=float, nargs=3, default=[3.0, 0.8, 0.8])
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    case = synthetic.make_case(1, args.shape, args.spacing, synthetic.case_rng(args.seed, 1))
    with tempfile.TemporaryDirectory() as folder:  # through the NIfTI files, as preprocess_dataset.py reads them
        synthetic.save_case(case, folder, labelled=True)
        raw = pp.find_cases(folder)[0][0]
        image, label, spacing = pp.load_pair(raw)
    _, stored = pp.preprocess_arrays(image, label, spacing)
    stored, truth = stored[0], label[0]
    geometry = scan_geometry(truth.shape, spacing)
    print(f"scan {truth.shape} at {[round(s, 3) for s in spacing]} mm -> resampled {geometry.resampled} "
          f"-> stored {stored.shape} (padding {geometry.padding})")
    print("| prediction | benchmark Dice (evaluate) | inside the scan | scan's grid (predict) |")
    print("| --- | --- | --- | --- |")
    for name, prediction in predictions(stored, truth, geometry).items():
        inside = (crop_padding(prediction, geometry), crop_padding(stored, geometry))
        back = labels_in_original_grid(one_hot(prediction), geometry)
        print(f"| {name} | {mean_dice(prediction, stored)} | {mean_dice(*inside)} | {mean_dice(back, truth)} |")
    print("(mean (kidney / tumour); torch", torch.__version__, ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
