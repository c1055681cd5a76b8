"""What the OpenVINO int8 quantisation costs per window: the project's NNCF settings against NNCF's
defaults, with fp32 as the yardstick, side by side in one process.

The network (``--filters``, default the benchmark's 32..320) with random weights (seed 0; the
time does not depend on them) is converted once for ``--roi`` windows, then quantised twice on
the same calibration windows (random CT-like values; the speed does not depend on them either):

* ``nncf_defaults``: ``nncf.quantize`` as it comes (every activation quantised, the norms' inputs
  included, each decoder's input one tensor; ranges averaged over windows), the project's way
  before 2026-11-24;
* ``project``: what ``--backend openvino --int8`` runs before its accuracy control: the decoder
  inputs' halves split (:func:`runtime.inference.torch_copy.split_decoder_inputs`) and
  :func:`runtime.inference.openvino.calibration.static_quantization` (the norms' inputs float, ranges from
  the extremes), every convolution int8;
* ``keep:NAME``: ``project`` with the convolutions ``--keep NAME=conv,conv`` names in fp32: the
  accuracy control keeps some in fp32 on trained weights (which ones depends on the weights;
  random weights say nothing about it), and this measures what a given set costs.

The three compiled models then run the same window in lock-step rounds (each round runs every
variant once, the first variant rotating); per variant the median seconds per window and the
median of the per-round ratios to ``nncf_defaults``. Accuracy is not measured here (random
weights): see ``bench_backends.py`` and docs/performance.md.

Usage: ``python benchmarks/bench_openvino_int8.py [--rounds 5] [--roi 128] [--keep NAME=conv,conv ...]
[--out table.md]``.
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

from runtime.isa import isa_line  # noqa: E402
from runtime.inference.torch_copy import split_decoder_inputs  # noqa: E402
from model.unet3d import Unet3D  # noqa: E402
from runtime.inference.openvino.calibration import nncf_overflow_fix, static_quantization  # noqa: E402
from runtime.isa import int8_pairs_saturate  # noqa: E402
from runtime.inference.openvino.compiled import compile_for_cpu, convert  # noqa: E402

# The convolutions the accuracy control kept in fp32 on the trained networks of docs/performance.md
# (64³ windows): the fewest (network A, VNNI: 3), B on VNNI (7), and the most (A, AVX2 cap: 12).
DEFAULT_KEEP = ("A_vnni=output.conv,input_block.conv1.0,upsample.4.upsample_conv.0",
                "B_vnni=output.conv,upsample.4.conv2.0,upsample.4.conv1.0.skip,input_block.conv1.0,"
                "upsample.4.conv1.0.upsampled,downsample.0.conv1.0,downsample.1.conv2.0",
                "A_avx2=output.conv,upsample.4.conv2.0,upsample.4.conv1.0.skip,input_block.conv2.0,"
                "input_block.conv1.0,upsample.4.upsample_conv.0,downsample.0.conv1.0,upsample.3.conv1.0.upsampled,"
                "upsample.2.conv1.0.skip,downsample.2.conv2.0,downsample.2.conv1.0,downsample.3.conv2.0")


def quantised(model, roi, windows, overflow_fix: str, project: bool, keep=()):
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters

    if not project:
        return nncf.quantize(convert(model, roi), nncf.Dataset(windows), subset_size=len(windows),
                             advanced_parameters=AdvancedQuantizationParameters(
                                 overflow_fix=nncf_overflow_fix(overflow_fix)))
    return static_int8(convert(split_decoder_inputs(model), roi), windows, overflow_fix, keep)


def keep_sets(items) -> dict[str, tuple[str, ...]]:
    """``NAME=conv,conv,...`` items (``--keep``, :data:`DEFAULT_KEEP`) as ``{NAME: convs}``."""
    sets = {}
    for item in items:
        name, _, convs = item.partition("=")
        sets[name] = tuple(c for c in convs.split(",") if c)
    return sets


def static_int8(ov_model, windows, overflow_fix: str, keep=()):
    """``ov_model`` (decoder inputs split) quantised as ``--int8`` quantises before its accuracy
    control, with the convolutions ``keep`` names in fp32: no search."""
    import nncf

    ignored, advanced = static_quantization(overflow_fix, keep)
    return nncf.quantize(ov_model, nncf.Dataset(windows), subset_size=len(windows), ignored_scope=ignored,
                         advanced_parameters=advanced)


def build(args) -> dict:
    torch.manual_seed(0)
    model = Unet3D(filters=args.filters).eval()
    roi = (args.roi,) * 3
    rng = np.random.default_rng(0)
    windows = [rng.normal(0.0, 1.0, (1, 1, *roi)).astype(np.float32) for _ in range(args.calibration_windows)]
    fix = "enable" if int8_pairs_saturate() else "first_layer"
    plans = {"nncf_defaults": (False, ()), "project": (True, ())}
    for name, convs in keep_sets(args.keep).items():
        plans[f"keep:{name}"] = (True, convs)
    models, seconds = {"fp32": convert(model, roi)}, {}
    for name, (project, keep) in plans.items():
        start = time.perf_counter()
        models[name] = quantised(model, roi, windows, fix, project, keep)
        seconds[name] = time.perf_counter() - start
    compiled = {name: compile_for_cpu(m) for name, m in models.items()}
    return {"compiled": compiled, "window": windows[0], "quantise_seconds": seconds, "overflow_fix": fix}


def run(args) -> str:
    built = build(args)
    requests = {name: c.create_infer_request() for name, c in built["compiled"].items()}
    window = built["window"]
    for request in requests.values():  # warm-up: the first inference allocates
        request.infer({0: window})
    variants = list(requests)
    times = {name: [] for name in variants}
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for name in order:
            start = time.perf_counter()
            requests[name].infer({0: window})
            times[name].append(time.perf_counter() - start)
    base = times["nncf_defaults"]
    lines = [f"# {isa_line()}",
             f"# filters {' '.join(map(str, args.filters))}, {args.roi}³ windows, {args.rounds} lock-step rounds, "
             f"{args.calibration_windows} calibration windows, overflow fix: {built['overflow_fix']}, "
             f"torch threads {torch.get_num_threads()}", "",
             "| variant | median s per window | vs nncf_defaults (median of per-round ratios) | vs fp32 | quantise s |",
             "|---|---:|---:|---:|---:|"]
    for name in variants:
        ratio = statistics.median(b / t for b, t in zip(base, times[name]))
        over_fp32 = statistics.median(f / t for f, t in zip(times["fp32"], times[name]))
        quantise = built["quantise_seconds"].get(name)
        lines.append(f"| {name} | {statistics.median(times[name]):.3f} | {ratio:.2f}x | {over_fp32:.2f}x | "
                     f"{'' if quantise is None else f'{quantise:.1f}'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--filters", type=int, nargs="+", default=[32, 64, 128, 256, 320])
    parser.add_argument("--roi", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calibration_windows", type=int, default=2)
    parser.add_argument("--keep", nargs="*", default=list(DEFAULT_KEEP),
                        help="NAME=conv,conv: a variant with those convolutions in fp32 (none: --keep)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    text = run(args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
