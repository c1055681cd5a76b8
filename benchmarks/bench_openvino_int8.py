"""What the OpenVINO int8 quantisation costs per window: the project's NNCF settings against NNCF's
defaults, with fp32 as the yardstick, side by side in one process.

The network (``--filters``, default the benchmark's 32..320) with random weights (seed 0; the
time does not depend on them) is converted once for ``--roi`` windows, then quantised twice on
the same calibration windows (random CT-like values; the speed does not depend on them either):

* ``nncf_defaults``: ``nncf.quantize`` as it comes (every activation quantised, the norms' inputs
  included; ranges averaged over windows), the project's way before 2026-11-24;
* ``project``: :func:`runtime.openvino.calibration.quantize` (the norms' inputs float, ranges
  from the extremes), what ``--backend openvino --int8`` runs.

The three compiled models then run the same window in lock-step rounds (each round runs every
variant once, the first variant rotating); per variant the median seconds per window and the
median of the per-round ratios to ``nncf_defaults``. Accuracy is not measured here (random
weights): see ``bench_backends.py`` and docs/performance.md.

Usage: ``python benchmarks/bench_openvino_int8.py [--rounds 5] [--roi 128] [--out table.md]``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cpu_isa import isa_line  # noqa: E402
from model.unet3d import Unet3D  # noqa: E402
from runtime.openvino.calibration import int8_pairs_saturate, quantize  # noqa: E402
from runtime.openvino.compiled import compile_for_cpu, convert  # noqa: E402

VARIANTS = ("fp32", "nncf_defaults", "project")


class Windows:
    """The duck-typed calibration set :func:`quantize` reads: ``arrays()`` and ``overflow_fix``."""

    def __init__(self, arrays, overflow_fix: str):
        self._arrays = arrays
        self.overflow_fix = overflow_fix

    def arrays(self):
        return iter(self._arrays)


def nncf_defaults(ov_model, calibration: Windows):
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix

    fix = OverflowFix.ENABLE if calibration.overflow_fix == "enable" else OverflowFix.FIRST_LAYER
    data = list(calibration.arrays())
    return nncf.quantize(ov_model, nncf.Dataset(data), subset_size=len(data),
                         advanced_parameters=AdvancedQuantizationParameters(overflow_fix=fix))


def build(args) -> dict:
    torch.manual_seed(0)
    model = Unet3D(filters=args.filters).eval()
    roi = (args.roi,) * 3
    rng = np.random.default_rng(0)
    windows = [rng.normal(0.0, 1.0, (1, 1, *roi)).astype(np.float32) for _ in range(args.calibration_windows)]
    calibration = Windows(windows, "enable" if int8_pairs_saturate() else "first_layer")
    converted = convert(model, roi)
    models, seconds = {"fp32": converted}, {}
    for name, how in (("nncf_defaults", nncf_defaults), ("project", quantize)):
        start = time.perf_counter()
        models[name] = how(convert(model, roi), calibration)
        seconds[name] = time.perf_counter() - start
    compiled = {name: compile_for_cpu(m) for name, m in models.items()}
    return {"compiled": compiled, "window": windows[0], "quantise_seconds": seconds,
            "overflow_fix": calibration.overflow_fix}


def run(args) -> str:
    built = build(args)
    requests = {name: c.create_infer_request() for name, c in built["compiled"].items()}
    window = built["window"]
    for request in requests.values():  # warm-up: the first inference allocates
        request.infer({0: window})
    times = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for name in order:
            start = time.perf_counter()
            requests[name].infer({0: window})
            times[name].append(time.perf_counter() - start)
    base = times["nncf_defaults"]
    lines = [f"# {isa_line()}",
             f"# filters {' '.join(map(str, args.filters))}, {args.roi}³ windows, {args.rounds} lock-step rounds, "
             f"{args.calibration_windows} calibration windows, overflow fix: {built['overflow_fix']}, "
             f"torch threads {torch.get_num_threads()}", "",
             "| variant | median s per window | vs nncf_defaults (median of per-round ratios) | quantise s |",
             "|---|---:|---:|---:|"]
    for name in VARIANTS:
        ratio = statistics.median(b / t for b, t in zip(base, times[name]))
        quantise = built["quantise_seconds"].get(name)
        lines.append(f"| {name} | {statistics.median(times[name]):.3f} | {ratio:.2f}x | "
                     f"{'' if quantise is None else f'{quantise:.1f}'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--filters", type=int, nargs="+", default=[32, 64, 128, 256, 320])
    parser.add_argument("--roi", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calibration_windows", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    text = run(args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
