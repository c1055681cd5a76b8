"""Sliding-window inference of one volume: the reference's way against the fast paths, in one run.

Variants (all through ``runtime.inference.sliding_window_inference``, overlap 0.5, Gaussian
weights, the same model weights and volume):

* ``reference``: what the MLCommons reference does: fp32, NCDHW, one window per forward, under
  ``torch.no_grad`` (also this application's ``evaluate`` at default flags);
* ``amp_cl``: the application's evaluate levers today: bf16 autocast, channels-last weights,
  ``--sw_batch_size`` windows per forward;
* ``fast``: ``runtime.inference.fast_predictor``: an inference copy of the model whose instance
  norms keep the channels-last layout, fp32, under ``torch.inference_mode``;
* ``fast_int8``: the same with the 3x3x3 convolutions in oneDNN int8 (dynamic per-window
  activation ranges, per-channel weights), float32 output.

Each repeat runs every variant once, the starting variant rotating from repeat to repeat so that
load from other jobs on a shared machine falls on all of them alike; the table gives median
seconds, the median over repeats of the per-repeat speed-up against ``reference``, achieved
TFLOP/s (the model's forward FLOPs times the number of windows) and its fraction of the given
fp32 and bf16 ceilings. Agreement columns compare each variant's prediction (argmax) with the
reference's: the share of voxels with the same class and the Dice of the two for kidney and
tumour; ``dice vs label`` is the benchmark's score against the volume's label (meaningful only
with trained weights, ``--ckpt``).

Usage::

    python benchmarks/bench_inference.py --repeats 3 --out inference.md     # 190 x 250 x 250
    python benchmarks/bench_inference.py --shape 128 128 192 --repeats 2    # 2 windows, quicker
    python benchmarks/bench_inference.py --smoke                            # tiny, for tests
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_pipeline import write_blob_case  # noqa: E402
from data_loading.windows import window_geometry  # noqa: E402
from model.inference import int8_available  # noqa: E402
from model.losses import DiceScore  # noqa: E402
from model.unet3d import DEFAULT_FILTERS, Unet3D  # noqa: E402
from runtime.inference import fast_predictor, sliding_window_inference  # noqa: E402
from runtime.speed import flop_count_per_sample  # noqa: E402

VARIANTS = ("reference", "amp_cl", "fast", "fast_int8")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=3, default=[190, 250, 250], help="volume D H W")
    p.add_argument("--roi", type=int, default=128, help="window edge")
    p.add_argument("--overlap", type=float, default=0.5)
    p.add_argument("--filters", type=int, nargs="+", default=list(DEFAULT_FILTERS))
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    p.add_argument("--sw_batch_size", type=int, default=2, help="windows per forward (amp_cl, fast*)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--ckpt", default="", help="checkpoint with trained weights (best_model_state_dict "
                   "or a bare state_dict); default: random weights from --seed")
    p.add_argument("--data", nargs=2, default=None, metavar=("X_NPY", "Y_NPY"),
                   help="a preprocessed case (case_XXXXX_x.npy, _y.npy) instead of a synthetic one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ceiling_fp32", type=float, default=0.4, help="TFLOP/s peak, fp32")
    p.add_argument("--ceiling_bf16", type=float, default=0.8, help="TFLOP/s peak, bf16")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and filters (tests)")
    p.add_argument("--out", default="", help="also write the markdown table here")
    return p


def load_volume(args) -> tuple[torch.Tensor, torch.Tensor]:
    """``(image (1, 1, D, H, W) float32, label (1, 1, D, H, W) uint8)``: a preprocessed case, or a
    synthetic CT-like one (noise plus two kidneys and a tumour, ``bench_pipeline``)."""
    if args.data:
        x, y = (np.load(path) for path in args.data)
    else:
        with tempfile.TemporaryDirectory(prefix="bench_inference_") as folder:
            write_blob_case(Path(folder), "00000", tuple(args.shape), np.random.default_rng(args.seed))
            x = np.load(Path(folder) / "case_00000_x.npy")
            y = np.load(Path(folder) / "case_00000_y.npy")
    return torch.from_numpy(x)[None], torch.from_numpy(y)[None]


def load_model(args) -> Unet3D:
    torch.manual_seed(args.seed)
    model = Unet3D(filters=args.filters)
    if args.ckpt:
        state = torch.load(args.ckpt, map_location="cpu", weights_only=True)
        state = state.get("best_model_state_dict", state) if isinstance(state, dict) else state
        model.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    return model.eval()


def make_runner(name: str, model: Unet3D, args):
    """``run(image, label) -> (logits, trimmed label)`` for one variant (setup such as preparing the model is
    done here, outside the timed call)."""
    roi, sw = (args.roi,) * 3, args.sw_batch_size
    window = partial(sliding_window_inference, roi=roi, overlap=args.overlap)
    if name == "reference":
        def run(image, label):
            with torch.no_grad():
                return window(model, image, label, sw_batch_size=1)
    elif name == "amp_cl":
        cl_model = Unet3D(filters=args.filters).eval()
        cl_model.load_state_dict(model.state_dict())
        cl_model = cl_model.to(memory_format=torch.channels_last_3d)

        def predict(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return cl_model(x)

        def run(image, label):
            with torch.no_grad():
                return window(predict, image, label, sw_batch_size=sw)
    elif name in ("fast", "fast_int8"):
        predict = fast_predictor(model, channels_last=True, int8=name == "fast_int8")

        def run(image, label):
            with torch.inference_mode():
                return window(predict, image, label, sw_batch_size=sw)
    else:
        raise SystemExit(f"bench_inference: unknown variant {name!r}; choose from {VARIANTS}")
    return run


def agreement(logits: torch.Tensor, reference: torch.Tensor, label: torch.Tensor) -> dict:
    """Prediction ``logits`` against the reference's prediction and against ``label``."""
    score = DiceScore()
    ref_class = reference.argmax(1, keepdim=True)
    vs_ref = score(logits, ref_class)
    vs_label = score(logits, label)
    return {"agree": float((logits.argmax(1, keepdim=True) == ref_class).float().mean()),
            "dice_vs_ref": [float(v) for v in vs_ref], "mean_dice_vs_ref": float(vs_ref.mean()),
            "rel_err": float((logits - reference).norm() / reference.norm()),
            "dice_vs_label": float(vs_label.mean())}


def measure(runners: dict, image, label, repeats: int) -> tuple[dict, dict]:
    """Times of every variant per repeat (starting variant rotating) and, from the first
    repeat, each variant's agreement with the reference."""
    names = list(runners)
    times = {n: [] for n in names}
    first_logits, quality = {}, {}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            load = os.getloadavg()[0]
            start = time.perf_counter()
            logits, trimmed = runners[name](image, label)
            elapsed = time.perf_counter() - start
            times[name].append(elapsed)
            print(f"repeat {r} {name:10s} {elapsed:8.2f} s  (load {load:.1f})", flush=True)
            if r == 0:
                first_logits[name] = logits
        if r == 0:
            reference = first_logits.get("reference", first_logits[names[0]])
            quality = {n: agreement(lg, reference, trimmed.long())
                       for n, lg in first_logits.items()}
            first_logits.clear()
    return times, quality


def table(args, times: dict, quality: dict, window_flops: int, n_windows: int) -> str:
    ref = times.get("reference")
    total_tflop = window_flops * n_windows / 1e12
    rows = ["| variant | median s | speed-up vs reference (median of per-repeat ratios) | "
            "TFLOP/s | % of fp32 ceiling | % of bf16 ceiling | voxels = reference | "
            "Dice vs reference (kidney, tumour; mean) | rel. logit error | Dice vs label |",
            "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for name, values in times.items():
        med = statistics.median(values)
        ratio = (statistics.median(r / v for r, v in zip(ref, values)) if ref else float("nan"))
        tflops = total_tflop / med
        q = quality[name]
        rows.append(f"| {name} | {med:.1f} | {ratio:.2f}x | {tflops:.3f} | "
                    f"{100 * tflops / args.ceiling_fp32:.0f}% | {100 * tflops / args.ceiling_bf16:.0f}% | "
                    f"{100 * q['agree']:.3f}% | {q['dice_vs_ref'][0]:.4f}, {q['dice_vs_ref'][1]:.4f}; "
                    f"{q['mean_dice_vs_ref']:.4f} | {q['rel_err']:.2e} | {q['dice_vs_label']:.4f} |")
    return "\n".join(rows)


def describe(args, n_windows: int, window_flops: int) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{datetime.date.today()} · {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, Python {platform.python_version()} · volume "
            f"{tuple(args.shape)}, {n_windows} windows of {args.roi}³ at overlap {args.overlap}, "
            f"filters {tuple(args.filters)}, {window_flops / 1e9:.1f} GFLOP per window, "
            f"{window_flops * n_windows / 1e12:.2f} TFLOP per volume · sw_batch_size "
            f"{args.sw_batch_size} (amp_cl, fast*), {args.repeats} repeats · "
            f"{'weights ' + args.ckpt if args.ckpt else 'random weights, seed ' + str(args.seed)}")


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.roi, args.filters = [40, 70, 52], 32, [4, 8, 16, 32]
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n for n in args.variants.split(",") if n]
    if "fast_int8" in names and int8_available() is not None:
        print(f"skipping fast_int8: {int8_available()}")
        names.remove("fast_int8")
    image, label = load_volume(args)
    model = load_model(args)
    roi = (args.roi,) * 3
    geo = window_geometry(image.shape[2:], roi, args.overlap)
    window_flops = flop_count_per_sample(model, roi)[0]
    setup = {}
    runners = {}
    for name in names:
        start = time.perf_counter()
        runners[name] = make_runner(name, model, args)
        setup[name] = time.perf_counter() - start
    times, quality = measure(runners, image, label, args.repeats)
    header = describe(args, geo.n_windows, window_flops)
    text = header + "\n\n" + table(args, times, quality, window_flops, geo.n_windows)
    text += "\n\nsetup s (not timed above): " + ", ".join(f"{n} {s:.2f}" for n, s in setup.items())
    text += "\nper-repeat s: " + "; ".join(f"{n} " + " ".join(f"{v:.1f}" for v in vs)
                                          for n, vs in times.items())
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
