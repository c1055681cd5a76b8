"""Sliding-window inference of one volume: the reference's way against the fast paths, in one run.

Variants (all through ``runtime.inference.sliding_window.sliding_window_inference``, overlap 0.5, Gaussian
weights, the same model weights and volume):

* ``reference``: what the MLCommons reference does: fp32, NCDHW, one window per forward, under
  ``torch.no_grad`` (also this application's ``evaluate`` at default flags);
* ``amp_cl``: the application's evaluate levers today: bf16 autocast, channels-last weights,
  ``--sw_batch_size`` windows per forward;
* ``fast``: ``runtime.inference.predictor.build_predictor(..., inference_copy=True)``: an inference copy of the model whose instance
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

Host memory: ``--memory reuse`` runs with :func:`runtime.inference.host_memory.reuse_freed_memory` (what
``main.py`` does), ``--memory system`` with glibc's defaults (what the reference runs with).
The setting is per process, so comparing the two takes ``--isolate``: every variant then runs
in a process of its own, one after the other within each repeat (starting variant rotating),
and a variant name may carry its memory setting: ``reference+system``, ``fast_int8+reuse``.

Usage::

    python benchmarks/bench_inference.py --repeats 3 --out inference.md     # 190 x 250 x 250
    python benchmarks/bench_inference.py --isolate --variants reference+system,fast+reuse
    python benchmarks/bench_inference.py --shape 128 128 192 --repeats 2    # 2 windows, quicker
    python benchmarks/bench_inference.py --smoke                            # tiny, for tests
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_pipeline import write_blob_case  # noqa: E402
from runtime.isa import isa_line  # noqa: E402
from data_loading.windows import window_geometry  # noqa: E402
from runtime.inference.torch_copy import int8_available  # noqa: E402
from model.losses import DiceScore  # noqa: E402
from model.unet3d import DEFAULT_FILTERS, Unet3D  # noqa: E402
from runtime.inference.predictor import PredictorOptions, build_predictor  # noqa: E402
from runtime.inference.sliding_window import sliding_window_inference, trim_like_window  # noqa: E402

CPU = torch.device("cpu")
from benchmarks.flops import flop_count_per_sample  # noqa: E402
from runtime.inference.host_memory import reuse_freed_memory  # noqa: E402

VARIANTS = ("reference", "amp_cl", "fast", "fast_int8")
MEMORY = ("system", "reuse")


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
    p.add_argument("--progress", action="store_true", help="a line per forward pass")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and filters (tests)")
    p.add_argument("--out", default="", help="also write the markdown table here")
    p.add_argument("--memory", choices=MEMORY, default="system",
                   help="glibc's defaults, or keep and reuse freed memory (runtime.inference.host_memory)")
    p.add_argument("--isolate", action="store_true",
                   help="each variant in a process of its own (names may end in +system/+reuse)")
    p.add_argument("--child_out", default="", help=argparse.SUPPRESS)
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


def make_variant(name: str, model: Unet3D, args) -> tuple:
    """``(predict, sw_batch_size, grad_mode)`` of one variant; setup such as preparing the
    model is done here, outside the timed part."""
    if name == "reference":
        return model, 1, torch.no_grad
    if name == "amp_cl":
        cl_model = Unet3D(filters=args.filters).eval()
        cl_model.load_state_dict(model.state_dict())
        cl_model = cl_model.to(memory_format=torch.channels_last_3d)
        options = PredictorOptions(channels_last=True, amp_dtype="bf16")
        return build_predictor(cl_model, CPU, options), args.sw_batch_size, torch.no_grad
    if name in ("fast", "fast_int8"):
        options = PredictorOptions(channels_last=True, int8=name == "fast_int8")
        return (build_predictor(model, CPU, options, inference_copy=True), args.sw_batch_size,
                torch.inference_mode)
    raise SystemExit(f"bench_inference: unknown variant {name!r}; choose from {VARIANTS}")


class Baton:
    """Runs several sliding-window inferences in lock-step, one at a time.

    Each variant runs in its own thread; only the holder of the baton computes. After every
    forward pass the holder hands the baton to the variant that has done the fewest windows so
    far (ties in the given order), so the variants advance through the volume together and
    load from other jobs on a shared machine falls on all of them alike. ``elapsed[name]`` is
    the time that variant held the baton: its forwards and its own accumulation work.
    """

    def __init__(self, names, verbose=False):
        self.names = list(names)
        self.verbose = verbose
        self.done = {n: 0 for n in self.names}
        self.elapsed = {n: 0.0 for n in self.names}
        self.active = set(self.names)
        self.holder = None
        self.since = 0.0
        self.cond = threading.Condition()

    def _next(self):
        return min(self.active, key=lambda n: (self.done[n], self.names.index(n)), default=None)

    def acquire(self, name):
        with self.cond:
            self.cond.wait_for(lambda: self.holder is None and self._next() == name)
            self.holder, self.since = name, time.perf_counter()

    def release(self, name, windows=0, finished=False):
        with self.cond:
            self.elapsed[name] += time.perf_counter() - self.since
            self.done[name] += windows
            if windows and self.verbose:
                print(f"  {name}: {self.done[name]} windows, {self.elapsed[name]:.1f} s", flush=True)
            if finished:
                self.active.discard(name)
            self.holder = None
            self.cond.notify_all()

    def wrap(self, name, predict):
        def turn(batch):
            out = predict(batch)
            self.release(name, windows=batch.shape[0])
            self.acquire(name)
            return out
        return turn


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


def run_interleaved(variants: dict, image, label, args) -> tuple[dict, dict]:
    """One inference of the volume per variant, in lock-step (:class:`Baton`). Returns each
    variant's seconds and ``(logits, trimmed label)``."""
    baton = Baton(variants, verbose=args.progress)
    results, errors = {}, {}

    def body(name):
        predict, sw, grad_mode = variants[name]
        baton.acquire(name)
        try:
            with grad_mode():
                logits = sliding_window_inference(baton.wrap(name, predict), image, (args.roi,) * 3,
                                                  args.overlap, sw)
                results[name] = (logits, trim_like_window(label, (args.roi,) * 3, args.overlap))
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors[name] = err
        finally:
            baton.release(name, finished=True)

    threads = [threading.Thread(target=body, args=(n,), daemon=True) for n in variants]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        name, err = next(iter(errors.items()))
        raise RuntimeError(f"variant {name} failed: {err}") from err
    return baton.elapsed, results


def measure(variants: dict, image, label, args) -> tuple[dict, dict, dict]:
    """Seconds of every variant per repeat (lock-step, see :class:`Baton`) and, from the first
    repeat, each variant's agreement with the reference and its ``(logits, trimmed label)``."""
    times = {n: [] for n in variants}
    quality, first = {}, {}
    for r in range(args.repeats):
        load = os.getloadavg()[0]
        elapsed, results = run_interleaved(variants, image, label, args)
        print(f"repeat {r} (load {load:.1f} -> {os.getloadavg()[0]:.1f}): "
              + ", ".join(f"{n} {elapsed[n]:.2f} s" for n in variants), flush=True)
        for name in variants:
            times[name].append(elapsed[name])
        if r == 0:
            reference, trimmed = results.get("reference", next(iter(results.values())))
            quality = {n: agreement(lg, reference, trimmed.long()) for n, (lg, _) in results.items()}
            first = dict(results)
        results.clear()
    return times, quality, first


def child_command(args, name: str, memory: str, out: str) -> list[str]:
    """This script for one variant, one repeat, in a process of its own."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--variants", name, "--repeats", "1",
           "--memory", memory, "--child_out", out, "--shape", *map(str, args.shape),
           "--roi", str(args.roi), "--overlap", str(args.overlap), "--filters", *map(str, args.filters),
           "--sw_batch_size", str(args.sw_batch_size), "--threads", str(args.threads),
           "--seed", str(args.seed)]
    if args.ckpt:
        cmd += ["--ckpt", args.ckpt]
    if args.data:
        cmd += ["--data", *args.data]
    return cmd


def run_isolated(args, names: list[str]) -> None:
    """Each variant ``NAME[+MEMORY]`` in its own process per repeat, the starting variant
    rotating; quality from the first repeat, against the first variant named ``reference*``
    (else the first)."""
    import subprocess

    for name in names:
        base, _, memory = name.partition("+")
        if base not in VARIANTS or (memory or args.memory) not in MEMORY:
            raise SystemExit(f"bench_inference: unknown variant {name!r}; choose from {VARIANTS}"
                             f", optionally +{'/+'.join(MEMORY)}")
    times, setup, outputs = {n: [] for n in names}, {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_inference_") as folder:
        for r in range(args.repeats):
            load = os.getloadavg()[0]
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                base, _, memory = name.partition("+")
                out = os.path.join(folder, f"{len(outputs)}.pt")
                subprocess.run(child_command(args, base, memory or args.memory, out), check=True,
                               stdout=subprocess.DEVNULL if not args.progress else None)
                result = torch.load(out, weights_only=True)
                times[name].append(result["seconds"])
                setup[name] = result["setup"]
                if r == 0:
                    outputs[name] = (result["logits"], result["label"])
                os.remove(out)
            print(f"repeat {r} (load {load:.1f} -> {os.getloadavg()[0]:.1f}): "
                  + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names), flush=True)
    ref_name = next((n for n in names if n.startswith("reference")), names[0])
    reference, trimmed = outputs[ref_name]
    quality = {n: agreement(lg, reference, trimmed.long()) for n, (lg, _) in outputs.items()}
    report(args, times, quality, setup, result["window_flops"], result["n_windows"], ref_name)


def table(args, times: dict, quality: dict, window_flops: int, n_windows: int,
          ref_name: str = "reference") -> str:
    ref = times.get(ref_name)
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
        rows.append(f"| {name} | {med:.2f} | {ratio:.2f}x | {tflops:.3g} | "
                    f"{100 * tflops / args.ceiling_fp32:.0f}% | {100 * tflops / args.ceiling_bf16:.0f}% | "
                    f"{100 * q['agree']:.3f}% | {q['dice_vs_ref'][0]:.4f}, {q['dice_vs_ref'][1]:.4f}; "
                    f"{q['mean_dice_vs_ref']:.4f} | {q['rel_err']:.2e} | {q['dice_vs_label']:.4f} |")
    return "\n".join(rows)


def volume_shape(args) -> tuple[int, ...]:
    return tuple(np.load(args.data[0], mmap_mode="r").shape[-3:]) if args.data else tuple(args.shape)


def describe(args, n_windows: int, window_flops: int) -> str:
    return (f"{isa_line()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, Python {platform.python_version()} · volume "
            f"{tuple(args.shape) if not args.data else args.data[0] + ' ' + str(volume_shape(args))}, {n_windows} windows of {args.roi}³ at overlap {args.overlap}, "
            f"filters {tuple(args.filters)}, {window_flops / 1e9:.1f} GFLOP per window, "
            f"{window_flops * n_windows / 1e12:.2f} TFLOP per volume · sw_batch_size "
            f"{args.sw_batch_size} (amp_cl, fast*), {args.repeats} repeats"
            f"{', each variant in its own process' if args.isolate else ', lock-step'}, host memory "
            f"{args.memory if not args.isolate else 'per variant (+system/+reuse; default ' + args.memory + ')'} · "
            f"{'weights ' + args.ckpt if args.ckpt else 'random weights, seed ' + str(args.seed)}")


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.roi, args.filters = [32, 48, 40], 32, [2, 4, 8, 8]
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n for n in args.variants.split(",") if n]
    if int8_available() is not None and any(n.partition("+")[0] == "fast_int8" for n in names):
        print(f"skipping fast_int8: {int8_available()}")
        names = [n for n in names if n.partition("+")[0] != "fast_int8"]
    if args.isolate:
        return run_isolated(args, names)
    if any("+" in n for n in names):
        raise SystemExit("bench_inference: a +system/+reuse variant needs --isolate")
    if args.memory == "reuse" and reuse_freed_memory() is not None:
        raise SystemExit(f"bench_inference: --memory reuse: {reuse_freed_memory()}")
    image, label = load_volume(args)
    model = load_model(args)
    roi = (args.roi,) * 3
    geo = window_geometry(image.shape[2:], roi, args.overlap)
    window_flops = flop_count_per_sample(model, roi)[0]
    setup, variants = {}, {}
    for name in names:
        start = time.perf_counter()
        variants[name] = make_variant(name, model, args)
        setup[name] = time.perf_counter() - start
    times, quality, first = measure(variants, image, label, args)
    if args.child_out:
        name = names[0]
        torch.save({"seconds": times[name][0], "setup": setup[name], "n_windows": geo.n_windows,
                    "window_flops": window_flops,
                    "logits": first[name][0], "label": first[name][1]},
                   args.child_out)
        return None
    report(args, times, quality, setup, window_flops, geo.n_windows)
    return None


def report(args, times, quality, setup, window_flops, n_windows, ref_name="reference") -> None:
    header = describe(args, n_windows, window_flops)
    text = header + "\n\n" + table(args, times, quality, window_flops, n_windows, ref_name)
    text += "\n\nsetup s (not timed above): " + ", ".join(f"{n} {s:.2f}" for n, s in setup.items())
    text += "\nper-repeat s: " + "; ".join(f"{n} " + " ".join(f"{v:.1f}" for v in vs)
                                          for n, vs in times.items())
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
