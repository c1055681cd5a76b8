"""Which ONE int8 engine for CPU inference: the project's two (PyTorch/oneDNN, OpenVINO+NNCF) and
PyTorch's maintained PT2E path, side by side against fp32 PyTorch, natively and under an ISA cap.

Engines (each in a process of its own, all built from the same weights):

* ``torch_fp32`` (the baseline): the project's ``--backend torch --channels_last`` predictor
  (:func:`runtime.predictor.build_predictor` on the inference copy);
* ``torch_int8``: ``--backend torch --int8``: :class:`model.inference_copy.Int8Conv3d`
  (``torch.ops.onednn.qconv_pointwise``), per-window dynamic ranges, equalized inputs;
* ``openvino_int8``: ``--backend openvino --int8``: NNCF post-training quantisation with static
  ranges calibrated on training windows. **Speed** (random weights): the project's static
  quantisation with a fixed set of convolutions kept in fp32 and NO accuracy control (the
  ``openvino_int8_kept`` way of ``bench_backends.py``; accuracy control on random weights keeps
  an arbitrary set): ``A_vnni`` (3 kept) natively, ``A_avx2`` (12 kept) under an AVX2 cap, the
  sets accuracy control kept on a trained network on each ISA (``bench_openvino_int8.DEFAULT_KEEP``);
  calibrated on ``--calibration_windows`` random windows. **Accuracy** (trained weights): the
  predict command line as users run it, accuracy control included;
* ``pt2e_x86inductor``: ``torch.export`` + ``prepare_pt2e`` with ``X86InductorQuantizer`` (its
  default static config) + calibration + ``convert_pt2e`` + ``torch.compile`` (inductor), from
  ``torchao.quantization.pt2e`` (torch 2.13 no longer has ``torch.ao.quantization.quantizer``;
  older torch: from there). The table says how many of the network's convolutions it made int8.

Speed (``--filters``, default the benchmark's 32 64 128 256 320, random weights seed 0, one
``--roi``³ window per forward, the same random window for every engine): per ISA setting, one
long-lived worker process per engine, built one after the other (setup seconds: build,
quantisation, compilation, two warm-up forwards), then ``--rounds`` lock-step rounds, each round
one forward of every engine, the starting engine rotating; the parent tells one worker at a time
to run, so the engines never share the CPU. Per engine: median seconds per window, the median of
the per-round ratios fp32 / engine, the worker's peak RSS (``ru_maxrss``: build and quantisation
included).

Accuracy (``--ckpt``, default the demo's trained checkpoint, on ``--scans``, default held-out
synthetic scans written here with another seed and ids the demo never saw): each engine once per
ISA setting through the predict command line (``main.py --exec_mode predict``; PT2E through a
child that puts its model in place of the inference copy, ``--sw_batch_size 1``); per engine the
share of all voxels whose label equals ``torch_fp32``'s (under the same ISA setting) and the mean
Dice against the ground truth (predict's summary, on the scan's own grid).

ISA settings (``--isa``): ``native``, and ``AVX2`` = ``ONEDNN_MAX_CPU_ISA=AVX2`` in the workers'
environment, as ``bench_backends.py`` and ``bench_int8_agreement.py`` cap: oneDNN in PyTorch
and OpenVINO's CPU plugin run the kernels of an AVX2-only CPU (int8 without VNNI: saturating
16-bit pair sums, so the torch path picks 7-bit weights and NNCF's overflow fix goes on every
layer). Inductor's generated C++ and ATen's own kernels are not capped by it.

Cost of ownership: whether it runs on the sites' torch 2.3 (probed in ``--compat_python`` with
``-B``, read-only, when it exists), whether predict needs training cases, peak RSS (speed), and
the lines of project code it needs (physical lines, docstrings included, of the definitions and
files listed in :data:`PROJECT_CODE`).

Usage (OpenVINO, NNCF and torchao importable, e.g. a venv made as ``make test-openvino`` makes
``.venv-openvino``, plus ``pip install torchao``)::

    .venv-openvino/bin/python benchmarks/bench_int8_engines.py --rounds 4 --out table.md
    .venv-openvino/bin/python benchmarks/bench_int8_engines.py --phase speed --isa native --rounds 3
"""
from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_backends import agreement, labels_of, summary_of, versions  # noqa: E402
from benchmarks.cpu_isa import isa_line  # noqa: E402

ENGINES = ("torch_fp32", "torch_int8", "openvino_int8", "pt2e_x86inductor")
BASELINE = "torch_fp32"
KEEP_SET = {"native": "A_vnni", "AVX2": "A_avx2"}  # the OpenVINO speed variant's fp32 convolutions
PREDICT_FLAGS = {"torch_fp32": ["--backend", "torch", "--channels_last"],
                 "torch_int8": ["--backend", "torch", "--int8"],
                 "openvino_int8": ["--backend", "openvino", "--int8"],
                 "pt2e_x86inductor": ["--backend", "torch", "--channels_last", "--sw_batch_size", "1"]}
NEEDS_TRAINING_CASES = {"torch_fp32": "no", "torch_int8": "no",
                        "openvino_int8": "yes (--data_dir; once per checkpoint, cached)",
                        "pt2e_x86inductor": "yes (static ranges: calibration windows)"}
# What each engine needs of the project's code: (file, top-level names or None for the whole file).
PROJECT_CODE = {
    "torch_int8": [("model/inference_copy.py", (
        "channel_divisors", "int8_available", "Int8Grid", "bits", "FULL_GRID", "SEVEN_BIT_WEIGHTS",
        "SEVEN_BIT_ACTIVATIONS", "int8_grid", "int8_path", "quantize_weight", "Int8Conv3d", "uint8_range",
        "quantize_uint8", "uint8_codes", "_flat", "equalize_int8_inputs"))],
    "openvino_int8": [("runtime/openvino/calibration.py", None),
                      ("model/inference_copy.py", ("HalvesConv3d", "SplitUpsampleBlock", "split_decoder_inputs"))],
    "openvino_backend": [("runtime/openvino/backend.py", None), ("runtime/openvino/cache.py", None),
                         ("runtime/openvino/compiled.py", None)],
}
COMPAT_PROBE = r"""
import json, torch
out = {"torch": torch.__version__}
try:
    out["qconv_pointwise"] = hasattr(torch.ops.onednn, "qconv_pointwise")
    out["onednn_qconv_ops"] = sorted(o for o in dir(torch.ops.onednn) if o.startswith("qconv"))
except Exception as err:
    out["qconv_pointwise"] = False; out["onednn_qconv_ops"] = [repr(err)]
try:
    import inspect
    import torch.ao.quantization.quantizer.x86_inductor_quantizer as x
    source = inspect.getsource(x)
    out["x86_inductor_quantizer"] = True
    out["quantizer_names_conv3d"] = "conv3d" in source
except Exception as err:
    out["x86_inductor_quantizer"] = False; out["quantizer_names_conv3d"] = False
print(json.dumps(out))
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=("all", "speed", "accuracy"), default="all")
    p.add_argument("--isa", nargs="+", default=["native", "AVX2"], help="native and/or ONEDNN_MAX_CPU_ISA values")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {list(ENGINES)} (fp32 always)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--filters", type=int, nargs=5, default=[32, 64, 128, 256, 320])
    p.add_argument("--roi", type=int, default=128)
    p.add_argument("--calibration_windows", type=int, default=2, help="random windows (speed only)")
    p.add_argument("--ckpt", default=str(ROOT / "demo_work/results/checkpoint.pt"), help="trained checkpoint")
    p.add_argument("--data_dir", default=str(ROOT / "demo_work/data"),
                   help="preprocessed training cases (OpenVINO / PT2E calibration for accuracy)")
    p.add_argument("--scans", default="", help="held-out raw scans with labels (default: written here)")
    p.add_argument("--held_out", type=int, default=2, help="synthetic held-out scans to write (small preset)")
    p.add_argument("--compat_python", default="/work/main/.venv-compat/bin/python",
                   help="a torch 2.3 interpreter to probe read-only (skipped when missing)")
    p.add_argument("--workdir", default="")
    p.add_argument("--out", default="")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--keep", default="", help=argparse.SUPPRESS)
    p.add_argument("--child_pt2e", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


# --------------------------------------------------------------------------- engines

def conv_count(model) -> int:
    import torch

    return sum(isinstance(m, (torch.nn.Conv3d, torch.nn.ConvTranspose3d)) for m in model.modules())


def pt2e_model(model, example, windows):
    """``model`` quantised by PT2E's X86InductorQuantizer (calibrated on ``windows``), compiled
    by inductor; returns ``(callable, int8 convolutions, convolutions in the graph)``."""
    import torch

    try:  # torch 2.13: only in torchao
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq
    except ImportError:  # older torch
        from torch.ao.quantization.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torch.ao.quantization.quantizer import x86_inductor_quantizer as xiq

    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
    with torch.no_grad():
        exported = torch.export.export(model.eval(), (example,)).module()
        prepared = prepare_pt2e(exported, quantizer)
        for window in windows:
            prepared(window)
        converted = convert_pt2e(prepared)
    convs = [n for n in converted.graph.nodes if n.op == "call_function" and "conv" in str(n.target)]
    int8 = sum(1 for n in convs if "dequantize" in str(getattr(n.args[0], "target", "")))
    return torch.compile(converted), int8, len(convs)


class _Callable:
    """A plain ``torch.nn.Module`` around a compiled PT2E graph (whose ``eval()`` refuses)."""

    def __new__(cls, function):
        import torch

        class Wrapped(torch.nn.Module):
            def forward(self, x):
                return function(x)

        return Wrapped()


def build_engine(name: str, filters, roi: int, calibration_windows: int, keep_name: str):
    """``(forward(window) -> logits, info)`` for the speed worker, random weights (seed 0)."""
    import numpy as np
    import torch

    from model.unet3d import Unet3D
    from runtime.predictor import PredictorOptions, build_predictor

    torch.manual_seed(0)
    model = Unet3D(filters=list(filters)).eval()
    shape = (1, 1, roi, roi, roi)
    rng = np.random.default_rng(0)
    windows = [rng.normal(0.0, 1.0, shape).astype(np.float32) for _ in range(calibration_windows)]
    info = {"convs": conv_count(model)}
    if name in ("torch_fp32", "torch_int8"):
        options = PredictorOptions(channels_last=True, int8=name == "torch_int8")
        forward = build_predictor(model, torch.device("cpu"), options, inference_copy=True)
        if name == "torch_int8":
            from model.inference_copy import Int8Conv3d, int8_path, prepare_for_inference

            probe = prepare_for_inference(model, channels_last=True, int8=True)
            info.update(int8=sum(isinstance(m, Int8Conv3d) for m in probe.modules()), path=int8_path())
        else:
            info["int8"] = 0
        return forward, info
    if name == "openvino_int8":
        from benchmarks.bench_openvino_int8 import keep_sets, static_int8, DEFAULT_KEEP
        from model.inference_copy import split_decoder_inputs
        from runtime.openvino.calibration import float_convolutions, int8_pairs_saturate
        from runtime.openvino.compiled import OpenVINOWindows, compile_for_cpu, convert

        keep = keep_sets(DEFAULT_KEEP)[keep_name]
        fix = "enable" if int8_pairs_saturate() else "first_layer"
        quantized = static_int8(convert(split_decoder_inputs(model), (roi,) * 3), windows, fix, keep)
        kept, total = float_convolutions(quantized)
        info.update(int8=total - kept, convs=total, path=f"kept in fp32: {keep_name} ({len(keep)}), overflow fix {fix}")
        module = OpenVINOWindows(compile_for_cpu(quantized), (roi,) * 3)
        return (lambda x: module(x)), info
    if name == "pt2e_x86inductor":
        compiled, int8, total = pt2e_model(model, torch.from_numpy(windows[0]), [torch.from_numpy(w) for w in windows])
        info.update(int8=int8, convs=total)

        def forward(x):
            with torch.no_grad():
                return compiled(x)

        return forward, info
    raise SystemExit(f"bench_int8_engines: unknown engine {name!r}")


def run_worker(args) -> int:
    """A speed worker: builds its engine, says READY on the protocol pipe (the real stdout; its
    own prints go to stderr), then runs one window per ``run`` line until ``quit``."""
    import resource

    import numpy as np
    import torch

    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    start = time.perf_counter()
    forward, info = build_engine(args.worker, args.filters, args.roi, args.calibration_windows, args.keep)
    window = torch.from_numpy(np.random.default_rng(1).normal(0.0, 1.0, (1, 1, *(args.roi,) * 3)).astype(np.float32))
    for _ in range(2):  # the first forward allocates (and compiles, for inductor)
        out = forward(window)
    info.update(setup_s=time.perf_counter() - start, out_shape=list(out.shape), threads=torch.get_num_threads())
    protocol.write("READY " + json.dumps(info) + "\n")
    for line in sys.stdin:
        if line.strip() == "run":
            t = time.perf_counter()
            forward(window)
            protocol.write(json.dumps({"s": time.perf_counter() - t}) + "\n")
        elif line.strip() == "quit":
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
            protocol.write(json.dumps({"rss_gb": peak}) + "\n")
            break
    return 0


# --------------------------------------------------------------------------- speed

def isa_env(isa: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    if isa != "native":
        env["ONEDNN_MAX_CPU_ISA"] = isa
    return env


def speed(args, isa: str, engines: list[str], work: Path) -> dict:
    env = isa_env(isa)
    workers, info = {}, {}
    try:
        for name in engines:
            command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--roi", str(args.roi),
                       "--calibration_windows", str(args.calibration_windows), "--keep", KEEP_SET.get(isa, "A_avx2"),
                       "--filters", *map(str, args.filters)]
            log = open(work / f"speed-{isa}-{name}.log", "w")
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=log, text=True, bufsize=1)
            line = proc.stdout.readline()
            if not line.startswith("READY "):
                raise SystemExit(f"bench_int8_engines: {name} ({isa}) failed to start, see {log.name}")
            workers[name], info[name] = proc, json.loads(line[6:])
            print(f"[{isa}] {name} ready: {info[name]}", flush=True)
        times = {n: [] for n in engines}
        loads = []
        for r in range(args.rounds):
            order = engines[r % len(engines):] + engines[:r % len(engines)]
            loads.append(os.getloadavg()[0])
            for name in order:
                workers[name].stdin.write("run\n")
                workers[name].stdin.flush()
                times[name].append(json.loads(workers[name].stdout.readline())["s"])
            print(f"[{isa}] round {r + 1}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in engines)
                  + f" (load {loads[-1]:.2f})", flush=True)
        for name in engines:
            workers[name].stdin.write("quit\n")
            workers[name].stdin.flush()
            info[name]["rss_gb"] = json.loads(workers[name].stdout.readline())["rss_gb"]
            workers[name].wait(timeout=60)
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.kill()
    result = {"times": times, "info": info, "loads": loads}
    with open(work / "speed.jsonl", "a") as record:
        record.write(json.dumps({"isa": isa, **result}) + "\n")
    return result


# --------------------------------------------------------------------------- accuracy

def run_pt2e_child(argv: list[str]) -> int:
    """Predict (``argv``: the calibration data_dir, then predict's flags) with the PT2E model in
    place of the inference copy, calibrated on the windows ``--int8`` of OpenVINO calibrates on."""
    import numpy as np
    import torch

    import runtime.app as app
    import runtime.predictor as predictor
    from runtime.arguments import Config, parse_args, replace
    from runtime.openvino.calibration import calibration_set

    data_dir, flags = argv[0], argv[1:]
    config = parse_args(flags)

    def prepare(model, channels_last=True, int8=False, **_):
        built = {}

        def forward(x):  # built at the first batch: predict takes the window from the checkpoint
            if "model" not in built:
                roi = tuple(x.shape[2:])
                windows = [torch.from_numpy(np.array(w)) for w in calibration_set(
                    replace(Config(), data_dir=data_dir, val_input_shape=roi)).arrays()]
                built["model"], int8_convs, total = pt2e_model(model, torch.zeros(1, 1, *roi), windows)
                print(f"bench_int8_engines: PT2E X86InductorQuantizer made {int8_convs} of {total} convolutions "
                      f"int8 ({len(windows)} calibration windows of {'x'.join(map(str, roi))})", flush=True)
            return built["model"](x)

        return _Callable(forward)

    predictor.prepare_for_inference = prepare
    return app.run(config)


def held_out_scans(args, work: Path) -> str:
    if args.scans:
        return args.scans
    from data_loading import synthetic

    folder = work / "held_out"
    if not folder.is_dir():  # seed 1 and ids 100..: neither the demo's cases (seed 0, ids 0..23) nor its draws
        synthetic.generate(str(folder), args.held_out, seed=1, size="small", start_id=100)
    return str(folder)


def accuracy(args, isa: str, engines: list[str], scans: str, work: Path) -> dict:
    env = isa_env(isa)
    results = {}
    for name in engines:
        out = work / f"acc-{isa}-{name}"
        flags = ["--exec_mode", "predict", "--input", scans, "--output_dir", str(out), "--load_ckpt_path",
                 args.ckpt, "--device", "cpu", "--force", *PREDICT_FLAGS[name]]
        if name == "openvino_int8":
            flags += ["--data_dir", args.data_dir]
        if name == "pt2e_x86inductor":
            command = [sys.executable, str(Path(__file__).resolve()), "--child_pt2e", args.data_dir, *flags]
        else:
            command = [sys.executable, str(ROOT / "main.py"), *flags]
        log = work / f"acc-{isa}-{name}.log"
        start = time.perf_counter()
        with open(log, "w") as handle:
            code = subprocess.run(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT).returncode
        wall = time.perf_counter() - start
        if code != 0:
            raise SystemExit(f"bench_int8_engines: accuracy {name} ({isa}) exited {code}, see {log}")
        summary = summary_of(str(out))
        results[name] = {"labels": labels_of(str(out), summary["cases"]), "dice": summary["mean_dice"], "wall": wall,
                         "note": next((line.strip() for line in open(log) if "convolutions" in line
                                       and ("openvino: int8 on" in line or "PT2E" in line)), "")}
        print(f"[{isa}] accuracy {name}: mean Dice {summary['mean_dice']}, {wall:.1f} s; {results[name]['note']}",
              flush=True)
    base = results[BASELINE]["labels"]
    for name in engines:
        results[name]["agreement"] = agreement(results[name]["labels"], base)
        del results[name]["labels"]
    with open(work / "accuracy.jsonl", "a") as record:
        record.write(json.dumps({"isa": isa, **results}) + "\n")
    return results


# --------------------------------------------------------------------------- cost of ownership

def definition_lines(path: Path, names) -> int:
    """Physical lines of ``path`` (all) or of its top-level definitions / assignments ``names``."""
    text = path.read_text()
    if names is None:
        return len(text.splitlines())
    total = 0
    for node in ast.parse(text).body:
        name = getattr(node, "name", None)
        if name is None and isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        if name in names:
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            total += node.end_lineno - start + 1
    return total


def project_lines(key: str) -> int:
    return sum(definition_lines(ROOT / f, names) for f, names in PROJECT_CODE[key])


def own_lines(function) -> int:
    import inspect

    return len(inspect.getsource(function).splitlines())


def compat_probe(python: str) -> dict | None:
    if not os.path.exists(python):
        return None
    proc = subprocess.run([python, "-B", "-c", COMPAT_PROBE], capture_output=True, text=True,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "CUDA_VISIBLE_DEVICES": ""})
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": proc.stderr[-300:]}


def torch23_column(compat: dict | None) -> dict:
    if compat is None:
        return {n: "not probed" for n in ENGINES}
    t = compat.get("torch", "?")
    qconv = "yes" if compat.get("qconv_pointwise") else f"NO (torch {t}: onednn ops {compat.get('onednn_qconv_ops')})"
    pt2e = (f"runs (torch.ao quantizer), Conv3d {'named' if compat.get('quantizer_names_conv3d') else 'not covered'}"
            if compat.get("x86_inductor_quantizer") else "no quantizer")
    return {"torch_fp32": "yes", "torch_int8": qconv,
            "openvino_int8": "yes (separate packages; per requirements-openvino.txt, not re-run here)",
            "pt2e_x86inductor": pt2e}


# --------------------------------------------------------------------------- report

def load_text() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def report(args, engines, speeds, accs, compat, header) -> str:
    t23 = torch23_column(compat)
    lines = [*header, ""]
    if speeds:
        f = " ".join(map(str, args.filters))
        lines += [f"### Speed: filters {f}, one {args.roi}³ window per forward, random weights, "
                  f"{args.rounds} lock-step rounds",
                  "", "| ISA | engine | int8 convs / convs | median s / window | speed-up vs torch_fp32 "
                  "(median of per-round ratios) | setup s | peak RSS GB | notes |",
                  "|---|---|---:|---:|---:|---:|---:|---|"]
        for isa, result in speeds.items():
            base = result["times"][BASELINE]
            for name in engines:
                times, info = result["times"][name], result["info"][name]
                ratio = statistics.median(b / t for b, t in zip(base, times))
                lines.append(f"| {isa} | {name} | {info.get('int8', '?')} / {info.get('convs', '?')} | "
                             f"{statistics.median(times):.2f} | {ratio:.2f}x | {info['setup_s']:.0f} | "
                             f"{info['rss_gb']:.2f} | {info.get('path', '')} |")
            lines.append("")
        for isa, result in speeds.items():
            lines.append(f"per round s ({isa}): " + "; ".join(
                f"{n} " + " / ".join(f"{t:.2f}" for t in result['times'][n]) for n in engines)
                + " · load before each round " + " / ".join(f"{x:.2f}" for x in result["loads"]))
        lines.append("")
    if accs:
        lines += [f"### Accuracy: trained network {args.ckpt}, held-out scans {accs.get('_scans', '')}",
                  "", "| ISA | engine | voxels = torch_fp32 (same ISA) | mean Dice vs ground truth | "
                  "predict wall s (small net) | engine's own line |", "|---|---|---:|---:|---:|---|"]
        for isa, result in accs.items():
            if isa.startswith("_"):
                continue
            for name in engines:
                r = result[name]
                dice = "" if r["dice"] is None else f"{r['dice']:.4f}"
                lines.append(f"| {isa} | {name} | {100 * r['agreement']:.3f}% | {dice} | {r['wall']:.0f} | "
                             f"{r['note']} |")
        lines.append("")
    backend = project_lines("openvino_backend")
    rss = {n: max(s["info"][n]["rss_gb"] for s in speeds.values()) for n in engines} if speeds else {}
    lines += ["### Cost of ownership", "",
              "| engine | runs on torch 2.3 | needs training cases at predict time | peak RSS GB (speed, max over ISA) "
              "| project lines it needs | extra packages |", "|---|---|---|---:|---|---|"]
    code = {"torch_fp32": "0 (the baseline)",
            "torch_int8": f"{project_lines('torch_int8')} (model/inference_copy.py int8 definitions)",
            "openvino_int8": f"{project_lines('openvino_int8')} int8 (calibration.py, decoder split) "
                             f"+ {backend} OpenVINO backend (backend, cache, compiled)",
            "pt2e_x86inductor": f"0 in the project; {own_lines(pt2e_model) + own_lines(_Callable)} in this benchmark"}
    extra = {"torch_fp32": "none", "torch_int8": "none", "openvino_int8": "openvino, nncf",
             "pt2e_x86inductor": "torchao (torch >= 2.10 has no torch.ao...quantizer), a C++ compiler (inductor)"}
    for name in engines:
        lines.append(f"| {name} | {t23[name]} | {NEEDS_TRAINING_CASES[name]} | "
                     f"{rss.get(name, float('nan')):.2f} | {code[name]} | {extra[name]} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.child_pt2e is not None:
        return run_pt2e_child(args.child_pt2e)
    engines = [BASELINE] + [e for e in args.engines.split(",") if e and e != BASELINE]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"bench_int8_engines: unknown engine {unknown[0]!r}; choose from {list(ENGINES)}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_int8_engines_"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    header = [f"{isa_line()} · {versions()}",
              f"command: {' '.join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable, *sys.argv])}",
              f"started {datetime.datetime.now():%Y-%m-%d %H:%M} UTC, load average (1/5/15 min) {load_text()}"]
    print("\n".join(header) + f"\nwork in {work}", flush=True)
    speeds, accs = {}, {}
    if args.phase in ("all", "accuracy"):
        if not os.path.exists(args.ckpt):
            raise SystemExit(f"bench_int8_engines: no trained checkpoint {args.ckpt} (run scripts/demo.sh)")
        scans = held_out_scans(args, work)
        accs["_scans"] = scans
        for isa in args.isa:
            accs[isa] = accuracy(args, isa, engines, scans, work)
    if args.phase in ("all", "speed"):
        for isa in args.isa:
            speeds[isa] = speed(args, isa, engines, work)
    header.append(f"ended {datetime.datetime.now():%H:%M} UTC ({(time.time() - started) / 60:.0f} min), "
                  f"load average (1/5/15 min) {load_text()}")
    text = report(args, engines, speeds, accs, compat_probe(args.compat_python), header)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
