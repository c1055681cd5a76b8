"""``--exec_mode predict`` end to end on one KiTS-size scan: what each stage costs.

Writes one synthetic CT scan of KiTS19 size (``--shape``, default 300 x 512 x 512 raw, spacing
chosen so that it resamples to about 190 x 250 x 250 like the benchmark's cases) and a randomly
initialised checkpoint of the model (``--filters``, default the benchmark's; the time does not
depend on the weights), then segments the scan with :func:`runtime.predict.segment_scan`, the
very code ``main.py --exec_mode predict`` runs, once per setting and repeat. Settings run side by
side, alternating within each repeat (the machine may be shared: the table gives the median of
the repeats, each stage's median on its own). Stages: read (NIfTI -> float32), preprocess
(resample, normalise, pad), infer (sliding window, softmax), restore (crop, resample the class
probabilities to the scan's grid, argmax), write (uint8 .nii.gz, atomic).

Usage: ``python benchmarks/bench_predict.py [--repeats 3] [--shape 300 512 512]
[--filters 32 64 128 256 320] [--setting NAME "FLAGS"]... [--out table.md]``.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from data_loading import synthetic  # noqa: E402
from data_loading.scans import find_scans, preprocess_scan, read_scan  # noqa: E402
from data_loading.windows import window_geometry  # noqa: E402
from runtime.arguments import parse_args  # noqa: E402
from runtime.checkpoint import saved_for  # noqa: E402
from runtime.distributed import DistInfo  # noqa: E402
from runtime.predict.folder import scan_inference  # noqa: E402
from runtime.predict.scan import STAGES, StageTimer, cover_padding, segment_scan  # noqa: E402
from runtime.resolve import resolve  # noqa: E402

ONE_PROCESS = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
from benchmarks.flops import flop_count_per_sample  # noqa: E402
from runtime.inference.host_memory import reuse_freed_memory  # noqa: E402

DEFAULT_SETTINGS = [("fp32", ""), ("channels_last", "--channels_last"), ("int8", "--int8")]
PEAK_TFLOPS = {"fp32": 0.4, "bf16": 0.8}  # assumed for the 2-core AVX-512 (BF16) VM, as bench_inference.py's --ceiling_*


def make_scan(folder: Path, shape: tuple[int, int, int], seed: int = 0) -> Path:
    """A synthetic KiTS19 case of ``shape`` (D, H, W) that resamples to about 190 x 250 x 250."""
    spacing = (round(1.6 * 190 / shape[0], 3), round(1.2 * 250 / shape[1], 3), round(1.2 * 250 / shape[2], 3))
    case = synthetic.make_case(0, shape, spacing, synthetic.case_rng(seed, 0))
    return Path(synthetic.save_case(case, str(folder), labelled=False)) / "imaging.nii.gz"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", type=int, nargs=3, default=[300, 512, 512])
    parser.add_argument("--filters", type=int, nargs=5, default=[32, 64, 128, 256, 320])
    parser.add_argument("--setting", nargs=2, action="append", metavar=("NAME", "FLAGS"),
                        help="a name and extra predict flags (repeatable); default fp32, channels_last, int8")
    parser.add_argument("--workdir", default=None, help="folder for the scan and outputs (default: a temporary one)")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    args = parser.parse_args(argv)
    reuse_freed_memory()  # as main.py does in predict
    settings = args.setting or DEFAULT_SETTINGS
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_predict_"))
    work.mkdir(parents=True, exist_ok=True)
    scan_path = make_scan(work / "raw", tuple(args.shape))
    ckpt = work / "random.pt"
    torch.manual_seed(0)
    from model.unet3d import Unet3D

    torch.save({"best_model_state_dict": Unet3D(filters=args.filters).state_dict()}, ckpt)
    scan = find_scans(str(scan_path))[0]
    raw = read_scan(str(scan_path))
    image, geometry = preprocess_scan(raw)
    del raw, image
    print(f"scan {tuple(args.shape)} spacing {read_scan(str(scan_path)).spacing} -> preprocessed {geometry.padded}; "
          f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}", flush=True)

    infers, configs = {}, {}
    for name, flags in settings:
        argv = ["--exec_mode", "predict", "--input", str(scan_path), "--output_dir", str(work / name),
                "--load_ckpt_path", str(ckpt), "--device", "cpu", "--filters", *map(str, args.filters),
                *shlex.split(flags)]
        config = parse_args(argv)
        saved = saved_for(config)
        config = resolve(config, ONE_PROCESS, None, saved)
        infers[name], configs[name] = scan_inference(config, saved, ONE_PROCESS)
        os.makedirs(config.output_dir, exist_ok=True)
    runs: dict[str, list[dict]] = {name: [] for name, _ in settings}
    for repeat in range(args.repeats):
        for name, _ in settings:
            timer = StageTimer()
            load = os.getloadavg()[0]
            result = segment_scan(scan, infers[name], configs[name].output_dir, timer=timer)
            runs[name].append(dict(timer.seconds, total=result.seconds, load=load))
            print(f"repeat {repeat + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[name][-1].items()),
                  flush=True)
    table = report(settings, runs, configs, geometry, args)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


def report(settings, runs, configs, geometry, args) -> str:
    """Markdown: median seconds per stage and setting, the ratio to the first setting, and the
    fraction of the CPU's peak reached by the inference."""
    first = settings[0][0]
    stages = [s for s in (*STAGES, "total") if any(s in r for rs in runs.values() for r in rs)]
    med = {n: {s: statistics.median(r[s] for r in runs[n]) for s in stages} for n, _ in settings}
    lines = ["| stage | " + " | ".join(f"{n} (s)" for n, _ in settings) + " | "
             + " | ".join(f"{first} / {n}" for n, _ in settings[1:]) + " |",
             "| --- |" + " ---: |" * (2 * len(settings) - 1)]
    for s in stages:
        lines.append(f"| {s} | " + " | ".join(f"{med[n][s]:.2f}" for n, _ in settings) + " | "
                     + " | ".join(f"{med[first][s] / med[n][s]:.2f}x" for n, _ in settings[1:]) + " |")
    config = configs[first]
    padded = [p + b + a for p, (b, a) in zip(geometry.padded, cover_padding(geometry.padded, config.val_input_shape,
                                                                           config.overlap))]
    windows = window_geometry(padded, config.val_input_shape, config.overlap).n_windows
    model_flops, _ = flop_count_per_sample(_model(args.filters),
                                           config.val_input_shape)
    total = windows * model_flops
    lines.append("")
    lines.append(f"{windows} windows of {list(config.val_input_shape)}, {model_flops / 1e9:.0f} GFLOP each, "
                 f"{total / 1e12:.1f} TFLOP per scan; loads before each run: "
                 + "; ".join(f"{n} " + " ".join(f"{r['load']:.1f}" for r in runs[n]) for n, _ in settings))
    for name, _ in settings:
        dtype = "bf16" if configs[name].amp else "fp32"
        tflops = total / med[name]["infer"] / 1e12
        lines.append(f"- {name}: inference {tflops:.3f} TFLOP/s = {100 * tflops / PEAK_TFLOPS[dtype]:.1f}% of the "
                     f"{PEAK_TFLOPS[dtype]} TFLOP/s {dtype} peak")
    return "\n".join(lines)


def _model(filters):
    from model.unet3d import Unet3D

    return Unet3D(filters=filters)


if __name__ == "__main__":
    sys.exit(main())
