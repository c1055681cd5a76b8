"""``predict --int8`` against float ``predict`` on trained weights: voxel agreement, Dice, time.

Each setting runs the predict CLI (``main.py --exec_mode predict``) in its own process on the
same scans, so what is measured is what users run. Settings, each under every oneDNN ISA cap
asked for (``--isa``: ``native`` is the CPU as it is; ``AVX2`` sets ``ONEDNN_MAX_CPU_ISA=AVX2``,
which makes a newer x86 CPU run the int8 kernels of an AVX2-only one, saturating pairs included):

* ``float``: the float model (channels-last inference copy);
* ``int8``: ``--int8`` with the activation grid the CPU's probe chooses (what users get);
* ``int8-full`` / ``int8-7bit-weights`` / ``int8-7bit-activations``: ``--int8`` with the grid
  forced (``full`` under an AVX2 cap is the arithmetic of every AVX2-only CPU before the probe
  existed; the two 7-bit grids are the two ways to keep pairs of products within 16 bits).

Per setting: the fraction of all voxels, and of the foreground union (voxels that either
segmentation calls kidney or tumour), whose label equals float's; mean Dice against the ground
truth (predict's summary: the scan's own grid) and its change from float; wall time.

Usage: ``python benchmarks/bench_int8_agreement.py --checkpoint CKPT --input SCANS
[--isa native AVX2] [--out table.md] [-- more predict flags]``. ``SCANS`` is a folder predict
accepts with ground truth beside the images (KiTS19 case folders).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nibabel
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runtime.isa import isa_line  # noqa: E402

# A process that forces the int8 grid, then runs the CLI unchanged.
FORCED_GRID = ("import sys; sys.path.insert(0, {root!r}); import runtime.inference.torch_copy as m; "
               "m.int8_grid = lambda: m.{grid}; import main; sys.exit(main.main(sys.argv[1:]))")
SETTINGS = {"float": ([], None), "int8": (["--int8"], None), "int8-full": (["--int8"], "FULL_GRID"),
            "int8-7bit-weights": (["--int8"], "SEVEN_BIT_WEIGHTS"),
            "int8-7bit-activations": (["--int8"], "SEVEN_BIT_ACTIVATIONS")}


def run_predict(setting: str, isa: str, args: argparse.Namespace, output_dir: Path) -> float:
    flags, grid = SETTINGS[setting]
    argv = ["--exec_mode", "predict", "--input", args.input, "--output_dir", str(output_dir),
            "--load_ckpt_path", args.checkpoint, "--channels_last", *flags, *args.predict_flags]
    program = (["-c", FORCED_GRID.format(root=str(ROOT), grid=grid)] if grid is not None
               else [str(ROOT / "main.py")])
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    if isa != "native":
        env["ONEDNN_MAX_CPU_ISA"] = isa
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *program, *argv], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"bench_int8_agreement: {setting} under {isa} failed: {proc.stderr.strip()[-2000:]}")
    return time.perf_counter() - start


def labels_of(output_dir: Path) -> dict[str, np.ndarray]:
    return {p.name: np.asarray(nibabel.load(str(p)).dataobj) for p in sorted(output_dir.glob("*.nii.gz"))}


def mean_dice(output_dir: Path) -> float:
    rows = [json.loads(line) for line in (output_dir / "summary.jsonl").read_text().splitlines()]
    return next(r["mean_dice"] for r in rows if r["case"] == "mean")


def agreement(float_labels: dict, other: dict) -> tuple[float, float]:
    """(all voxels equal, foreground-union voxels equal), pooled over the scans."""
    equal = total = fg_equal = fg_total = 0
    for name, a in float_labels.items():
        b = other[name]
        union = (a > 0) | (b > 0)
        equal += int((a == b).sum())
        total += a.size
        fg_equal += int((a == b)[union].sum())
        fg_total += int(union.sum())
    return equal / total, fg_equal / max(fg_total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--isa", nargs="+", default=["native", "AVX2"])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--out", default=None)
    parser.add_argument("predict_flags", nargs="*", help="more predict flags, after --")
    args = parser.parse_args()
    lines = [f"# {isa_line()}", f"# checkpoint {args.checkpoint}, scans {args.input}", "",
             "| oneDNN ISA | setting | voxels equal to float | foreground union equal | mean Dice | "
             "Dice - float | wall s |", "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as work:
        for isa in args.isa:
            results = {}
            for setting in ["float"] + [s for s in args.settings if s != "float"]:
                out = Path(work) / f"{isa}-{setting}"
                seconds = run_predict(setting, isa, args, out)
                results[setting] = (labels_of(out), mean_dice(out), seconds)
            base_labels, base_dice, _ = results["float"]
            for setting, (labels, dice, seconds) in results.items():
                voxels, foreground = agreement(base_labels, labels)
                lines.append(f"| {isa} | {setting} | {voxels:.4%} | {foreground:.4%} | {dice:.4f} | "
                             f"{dice - base_dice:+.4f} | {seconds:.1f} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
