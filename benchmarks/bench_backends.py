"""Predict through its command line, one process per variant, in lock-step rounds: the reference's
way against PyTorch and OpenVINO, fp32 and int8, on the same scans and windows.

Variants (``--variants``; default all, ``mlcommons`` only with ``--reference_code``):

* ``mlcommons``: **the real reference**: the MLCommons code's own ``Unet3D`` and
  ``sliding_window_inference`` (``benchmarks/mlcommons.py``), from the checkout that
  ``--reference_code`` names, called as its evaluation calls them (fp32, NCDHW, one window per
  forward, no memory reuse), inside the predict command line (reading, preprocessing, restoring
  to the scan's grid and writing are the project's, as for every variant); its windows are
  counted as its network is called, as predict counts every variant's. With it, it is the
  baseline of the speed-ups;
* ``reference``: **the project's copy of the reference's way**: PyTorch fp32, NCDHW, one window
  per forward under ``torch.no_grad``, glibc's allocator (no memory reuse), through the predict
  code (``runtime.app.run`` with the memory reuse switched off), ``--backend torch
  --sw_batch_size 1``; the baseline when ``mlcommons`` is not run;
* ``torch_fp32``: ``main.py --exec_mode predict --backend torch --channels_last`` (PyTorch's
  fastest exact path: layout-preserving norms, memory reuse, 2 windows per forward);
* ``torch_int8``: ``--backend torch --int8`` (oneDNN int8 convolutions, dynamic ranges);
* ``openvino_fp32``: ``--backend openvino``;
* ``openvino_int8``: ``--backend openvino --int8 --data_dir CALIBRATION`` (NNCF, static ranges,
  accuracy control). Give it trained weights (``--ckpt``): accuracy control keeps in fp32 the
  convolutions whose int8 changes fp32's labels most, and with random weights (near-ties between
  classes everywhere) that is an arbitrary set, so the row's time says nothing about a trained
  network's (and its search can take most of an hour);
* ``openvino_int8_kept:SET``: ``openvino_int8`` with the convolutions that accuracy control kept
  in fp32 on a trained network (``SET``: a name of ``bench_openvino_int8.DEFAULT_KEEP``, e.g.
  ``A_vnni``) kept in fp32 and no accuracy control: what a trained network's int8 costs, timed
  with any weights. Its conversion is cached beside a copy of the checkpoint of its own.

Each round runs every variant once, each in a new process, the starting variant rotating from
round to round, so that load from other jobs on a shared machine falls on all of them alike.
The OpenVINO conversions (and int8 calibration) are built once before the rounds and timed
apart: the rounds read them from the cache beside the checkpoint, as a user's second run does.
Times: the summary's seconds of each scan (read, preprocess, infer, restore, write) summed,
and the process's wall time; the speed-up is the median over rounds of reference / variant.
Peak RSS of each process from ``wait4``. Quality, from the first round: the share of voxels
whose label equals the reference's, and each variant's mean Dice against the scans' labels
(meaningful with trained weights only).

Scans: ``--input`` (scans with ``segmentation.nii.gz`` beside them, e.g. a synthetic KiTS19
tree) or one synthetic KiTS-like scan written here (``--shape`` raw, ``--resampled`` after
preprocessing; default 300 x 512 x 512 -> 190 x 250 x 250, 18 windows of 128³). Weights:
``--ckpt``, or random (``--filters``; time does not depend on the weights).

Usage::

    python benchmarks/bench_backends.py --rounds 2 --out table.md
    python benchmarks/bench_backends.py --input RAW_CASES --ckpt trained.pt --calibration DATA --rounds 1
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_backends.py --resampled 128 192 192   # AVX2 imitation
"""
from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runtime.isa import isa_line  # noqa: E402

VARIANTS = {
    "mlcommons": ["--backend", "torch", "--sw_batch_size", "1"],
    "reference": ["--backend", "torch", "--sw_batch_size", "1"],
    "torch_fp32": ["--backend", "torch", "--channels_last"],
    "torch_int8": ["--backend", "torch", "--int8"],
    "openvino_fp32": ["--backend", "openvino"],
    "openvino_int8": ["--backend", "openvino", "--int8"],
    "openvino_int8_kept": ["--backend", "openvino", "--int8"],
}


def base_variant(name: str) -> str:
    """``openvino_int8_kept:A_vnni`` -> ``openvino_int8_kept``."""
    return name.split(":", 1)[0]


def kept_set_name(name: str) -> str | None:
    """``openvino_int8_kept:A_vnni`` -> ``A_vnni``; None for a name without a set."""
    return name.split(":", 1)[1] if ":" in name else None


def kept_sets() -> dict[str, tuple[str, ...]]:
    """The kept-in-fp32 sets of ``bench_openvino_int8.DEFAULT_KEEP`` by name."""
    from benchmarks.bench_openvino_int8 import DEFAULT_KEEP, keep_sets

    return keep_sets(DEFAULT_KEEP)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="", help=f"comma list of {list(VARIANTS)} (default: all; "
                   "mlcommons only with --reference_code)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--input", default="", help="scans to segment (default: one synthetic KiTS-like scan)")
    p.add_argument("--shape", type=int, nargs=3, default=[300, 512, 512], help="raw synthetic scan D H W")
    p.add_argument("--resampled", type=int, nargs=3, default=[190, 250, 250],
                   help="its size after preprocessing (sets the spacing)")
    p.add_argument("--ckpt", default="", help="checkpoint (default: random weights of --filters)")
    p.add_argument("--filters", type=int, nargs=5, default=[32, 64, 128, 256, 320])
    p.add_argument("--calibration", default="", help="preprocessed cases for openvino_int8 (--data_dir); "
                   "default: the synthetic scan preprocessed here")
    p.add_argument("--roi", type=int, default=128)
    p.add_argument("--workdir", default="", help="scans, outputs, caches (default: a temporary folder)")
    p.add_argument("--out", default="", help="also write the markdown report here")
    p.add_argument("--reference_code", default="",
                   help="image_segmentation/pytorch of a mlcommons/training checkout: runs the mlcommons variant")
    p.add_argument("--child_reference", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.add_argument("--child_mlcommons", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.add_argument("--child_kept", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def run_reference_child(argv: list[str]) -> int:
    """The ``reference`` variant's process: the predict code without ``main.py``'s memory reuse."""
    import runtime.app as app
    from runtime.arguments import parse_args

    app.reuse_freed_memory = lambda: None  # the reference's process: glibc's allocator as it is
    return app.run(parse_args(argv))


def run_mlcommons_child(argv: list[str]) -> int:
    """The ``mlcommons`` variant's process (``argv``: the reference code's folder, then predict's
    flags): predict with the reference's network and sliding window in place of the project's
    window predictor, no memory reuse; the summary's ``windows`` are those the reference's
    network ran on."""
    import runtime.app as app
    import runtime.predict.folder as folder
    from benchmarks.mlcommons import reference_infer
    from runtime.arguments import parse_args
    from runtime.checkpoint import model_state_from

    code_dir, flags = argv[0], argv[1:]

    def scan_inference(config, saved, dist_info):
        return reference_infer(code_dir, model_state_from(saved.checkpoint, prefer="best"), config), config

    folder.scan_inference = scan_inference
    app.reuse_freed_memory = lambda: None
    return app.run(parse_args(flags))


def run_kept_child(argv: list[str]) -> int:
    """An ``openvino_int8_kept:SET`` process (``argv``: the set's name, then predict's flags):
    predict as ``main.py`` runs it, with the int8 quantisation keeping the set's convolutions in
    fp32 instead of searching for them (no accuracy control)."""
    import runtime.app as app
    import runtime.inference.openvino.calibration as calibration
    from runtime.arguments import parse_args

    name, flags = argv[0], argv[1:]
    keep = kept_sets()[name]

    def quantize(ov_model, calibration_set, compile_fp32, say=print):
        from benchmarks.bench_openvino_int8 import static_int8

        say(f"bench_backends: int8 with the {len(keep)} convolutions of {name} in fp32, no accuracy control")
        return static_int8(ov_model, list(calibration_set.arrays()), calibration_set.overflow_fix, keep)

    calibration.quantize = quantize
    return app.run(parse_args(flags))


def cpu_line() -> str:
    """CPU model, ISA flags (AVX2, AVX-512, VNNI, BF16, AMX) and cores, plus an
    ``ONEDNN_MAX_CPU_ISA`` limit when one is set (an imitation of a smaller CPU)."""
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return isa_line() + (f" · IMITATION: ONEDNN_MAX_CPU_ISA={limit} (oneDNN in PyTorch and OpenVINO "
                         f"limited to it)" if limit else "")


def make_inputs(args, work: Path) -> tuple[str, str, str]:
    """``(input, checkpoint, calibration data_dir)``: given, or written into ``work``."""
    import torch

    from model.unet3d import Unet3D

    scans = args.input
    if not scans:
        scans = str(work / "raw")
        if not os.path.isdir(scans):
            write_scan(scans, tuple(args.shape), tuple(args.resampled))
    ckpt = args.ckpt or str(work / "random.pt")
    if not args.ckpt and not os.path.exists(ckpt):
        torch.manual_seed(0)
        torch.save({"best_model_state_dict": Unet3D(filters=args.filters).state_dict(),
                    "config": {"filters": args.filters, "normalization": "instancenorm", "activation": "relu"}}, ckpt)
    calibration = args.calibration or str(work / "calibration")
    if not args.calibration and not os.path.isdir(calibration):
        subprocess.run([sys.executable, str(ROOT / "preprocess_dataset.py"), "--data_dir", scans,
                        "--results_dir", calibration, "--num_workers", "1"], check=True, stdout=subprocess.DEVNULL)
    return scans, ckpt, calibration


def write_scan(folder: str, shape: tuple[int, ...], resampled: tuple[int, ...]) -> None:
    """A labelled synthetic KiTS19 case (id 1: a training id) of ``shape`` that preprocesses to
    about ``resampled``."""
    from data_loading import synthetic

    target = synthetic.TARGET_SPACING
    spacing = tuple(round(t * r / s, 3) for t, r, s in zip(target, resampled, shape))
    case = synthetic.make_case(1, shape, spacing, synthetic.case_rng(0, 1))
    synthetic.save_case(case, folder, labelled=True)


def variant_command(name: str, scans: str, ckpt: str, calibration: str, out: str, roi: int,
                    reference_code: str = "") -> list[str]:
    flags = ["--exec_mode", "predict", "--input", scans, "--output_dir", out, "--load_ckpt_path", ckpt,
             "--device", "cpu", "--force", "--val_input_shape", *[str(roi)] * 3, *VARIANTS[base_variant(name)]]
    if name.startswith("openvino_int8"):
        flags += ["--data_dir", calibration]
    if base_variant(name) == "openvino_int8_kept":
        set_name = kept_set_name(name)
        flags[flags.index("--load_ckpt_path") + 1] = kept_checkpoint(ckpt, set_name, Path(out).parent)
        return [sys.executable, str(Path(__file__).resolve()), "--child_kept", set_name, *flags]
    if name == "reference":
        return [sys.executable, str(Path(__file__).resolve()), "--child_reference", *flags]
    if name == "mlcommons":
        return [sys.executable, str(Path(__file__).resolve()), "--child_mlcommons", reference_code, *flags]
    return [sys.executable, str(ROOT / "main.py"), *flags]


@functools.lru_cache(maxsize=None)
def kept_checkpoint(ckpt: str, set_name: str, work: Path) -> str:
    """A copy of ``ckpt`` in ``work`` for one kept set, so that its conversion has a cache of its
    own (the cache key does not hold the set): named by a digest of the checkpoint's bytes and the
    set's convolutions, so changed weights or an edited set get a new copy and a new cache;
    written whole or not at all. Hashed once per benchmark run, not once per round."""
    digest = hashlib.sha256(",".join(kept_sets()[set_name]).encode())
    with open(ckpt, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    copy = work / f"kept-{set_name}-{digest.hexdigest()[:12]}.pt"
    if not copy.exists():
        partial = copy.with_name(copy.name + ".partial")
        shutil.copyfile(ckpt, partial)
        os.replace(partial, copy)
    return str(copy)


def run_process(command: list[str], log: Path) -> tuple[float, float, int]:
    """``(wall seconds, peak RSS GB, exit code)`` of ``command`` (output to ``log``)."""
    start = time.perf_counter()
    with open(log, "w") as handle:
        process = subprocess.Popen(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - start, usage.ru_maxrss * 1024 / 1e9, process.returncode


def summary_of(out: str) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(out, "summary.jsonl"))]
    cases = [r for r in rows if r["case"] != "mean"]
    dice = [r["mean_dice"] for r in cases if r.get("mean_dice") is not None]
    windows = [r.get("windows") for r in cases]
    return {"seconds": sum(r["seconds"] for r in cases), "cases": [r["case"] for r in cases],
            "mean_dice": statistics.mean(dice) if dice else None,
            "windows": None if None in windows else sum(windows)}


def labels_of(out: str, cases: list[str]):
    import nibabel
    import numpy as np

    return {c: np.asarray(nibabel.load(os.path.join(out, f"{c}.nii.gz")).dataobj) for c in cases}


def agreement(labels: dict, reference: dict) -> float:
    import numpy as np

    equal = sum(int(np.sum(labels[c] == reference[c])) for c in reference)
    return equal / sum(reference[c].size for c in reference)


def window_count(scans: str, roi: int) -> tuple[int, list]:
    """Windows per run (all scans) and the preprocessed shapes, from predict's own geometry."""
    from data_loading.scans import find_scans, preprocess_scan, read_scan
    from data_loading.windows import window_geometry
    from runtime.predict.scan import cover_padding

    total, shapes = 0, []
    for scan in find_scans(scans):
        image, _ = preprocess_scan(read_scan(scan.image_path), scan.image_path)
        shape = image.shape[1:]
        padded = [s + b + a for s, (b, a) in zip(shape, cover_padding(shape, (roi,) * 3, 0.5))]
        total += window_geometry(padded, (roi,) * 3, 0.5).n_windows
        shapes.append(tuple(shape))
    return total, shapes


def prepare(names, inputs, work: Path, roi: int) -> dict:
    """One untimed run of each OpenVINO variant: converts (and calibrates) into the cache."""
    setup = {}
    for name in names:
        if name.startswith("openvino"):
            out = str(work / f"setup-{name}")
            wall, rss, code = run_process(variant_command(name, *inputs, out, roi), work / f"setup-{name}.log")
            if code != 0:
                raise SystemExit(f"bench_backends: {name} failed, see {work / f'setup-{name}.log'}")
            setup[name] = wall - summary_of(out)["seconds"]
            print(f"setup {name}: conversion and start {setup[name]:.1f} s, peak RSS {rss:.2f} GB", flush=True)
    return setup


def run_rounds(names, inputs, work: Path, rounds: int, roi: int,
               reference_code: str = "") -> tuple[dict, dict]:
    """Every variant once per round in its own process, the first variant rotating. Each run
    records the windows its network ran on (predict's summary)."""
    runs = {n: [] for n in names}
    labels = {}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            out = str(work / f"{name}-{r}")
            log = work / f"{name}-{r}.log"
            load = os.getloadavg()[0]
            wall, rss, code = run_process(variant_command(name, *inputs, out, roi, reference_code), log)
            if code != 0:
                raise SystemExit(f"bench_backends: {name} exited {code}, see {log}")
            summary = summary_of(out)
            if summary["windows"] is None:
                raise SystemExit(f"bench_backends: {name} counted no windows, see {log}")
            runs[name].append(dict(summary, wall=wall, rss=rss, load=load))
            with open(work / "runs.jsonl", "a") as record:  # kept even if the benchmark is stopped
                record.write(json.dumps(dict(runs[name][-1], variant=name, round=r + 1)) + "\n")
            print(f"round {r + 1} {name}: {summary['seconds']:.1f} s scans, {summary['windows']} windows, {wall:.1f} s "
                  f"process, peak RSS {rss:.2f} GB, load {load:.1f}", flush=True)
            if r == 0:
                labels[name] = labels_of(out, summary["cases"])
    return runs, labels


def versions() -> str:
    import torch

    text = f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    try:
        import openvino

        text += f", OpenVINO {openvino.__version__.split('-')[0]}"
        import nncf

        text += f", NNCF {nncf.__version__}"
    except ImportError:
        pass
    return text + f", Python {platform.python_version()}"


def baseline(names: list[str]) -> str:
    """The variant the speed-ups are against: the real reference when run, else the project's copy."""
    return next((n for n in ("mlcommons", "reference") if n in names), names[0])


def speed_up(base_runs: list[dict], runs: list[dict]) -> str:
    """Median over rounds of baseline / variant seconds; when the window counts differ, of the
    seconds per window (the whole scan's seconds: reading and writing are spread over its windows)."""
    def per_window(run):
        return run["seconds"] / max(run["windows"], 1)

    same = all(a["windows"] == b["windows"] for a, b in zip(base_runs, runs))
    ratio = statistics.median((a["seconds"] / b["seconds"]) if same else per_window(a) / per_window(b)
                              for a, b in zip(base_runs, runs))
    return f"{ratio:.2f}x" + ("" if same else " (per window: the window counts differ)")


def network_filters(args) -> tuple[int, ...]:
    """The filters of ``--ckpt`` (its saved config), else ``--filters``."""
    if args.ckpt:
        from runtime.checkpoint import load_checkpoint, saved_config

        filters = saved_config(load_checkpoint(args.ckpt)).get("filters")
        if filters:
            return tuple(filters)
    return tuple(args.filters)


def predict_estimate_gb(name: str, filters: tuple[int, ...], roi: int) -> float | None:
    """Predict's own peak estimate (``runtime/inference/memory_budget.py``) for a variant that runs
    predict's window predictor (not the reference's ways, which hold one window and no reuse),
    at its flags' window batch (predict lowers it only where memory is short)."""
    from runtime.arguments import Config, replace
    from runtime.inference.memory_budget import GB, estimate_bytes

    if name in ("mlcommons", "reference"):
        return None
    flags = VARIANTS[base_variant(name)]
    batch = int(flags[flags.index("--sw_batch_size") + 1]) if "--sw_batch_size" in flags else Config().sw_batch_size
    config = replace(Config(), filters=filters, val_input_shape=(roi,) * 3)
    return estimate_bytes(config, "openvino" if name.startswith("openvino") else "torch", batch) / GB


LABELS = {"mlcommons": "the real MLCommons code's Unet3D and sliding_window_inference, fp32, no memory reuse",
          "reference": "the project's copy of the reference's way (no memory reuse)"}


def report(args, names, runs, labels, setup, shapes, inputs) -> str:
    ref = baseline(names)
    filters = network_filters(args)
    lines = [f"{datetime.datetime.now():%H:%M} · {cpu_line()} · {versions()}",
             f"scans {inputs[0]} (preprocessed {', '.join('x'.join(map(str, s)) for s in shapes)}), "
             f"windows of {args.roi}³ per run in the table (counted as each variant's network ran, "
             f"predict's summary) · "
             f"weights {args.ckpt or 'random, filters ' + ' '.join(map(str, args.filters))} · "
             f"int8 calibration data {inputs[2]} · {args.rounds} lock-step rounds, each variant in its own process"
             + (f" · mlcommons: {args.reference_code}" if "mlcommons" in names else ""),
             "",
             f"| variant | flags | windows | median s (scans) | speed-up vs {ref} (median of per-round ratios) | "
             "median s (process) | peak RSS GB | predict's estimate GB | voxels = " + ref + " | mean Dice vs label |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    above = []
    for name in names:
        secs = [r["seconds"] for r in runs[name]]
        dice = runs[name][0]["mean_dice"]
        flags = LABELS.get(name, "`" + " ".join(VARIANTS[base_variant(name)]) + "`")
        if base_variant(name) == "openvino_int8_kept":
            flags += f" with {kept_set_name(name)}'s convolutions in fp32, no accuracy control"
        peak, estimate = max(r["rss"] for r in runs[name]), predict_estimate_gb(name, filters, args.roi)
        if estimate is not None and peak > estimate:
            above.append(f"{name} {peak:.2f} GB > {estimate:.2f} GB")
        lines.append(f"| {name} | {flags} | {runs[name][0]['windows']} | {statistics.median(secs):.1f} | "
                     f"{speed_up(runs[ref], runs[name])} | "
                     f"{statistics.median(r['wall'] for r in runs[name]):.1f} | "
                     f"{peak:.2f} | {'' if estimate is None else f'{estimate:.2f}'} | "
                     f"{100 * agreement(labels[name], labels[ref]):.3f}% | "
                     f"{'' if dice is None else f'{dice:.4f}'} |")
    lines.append("")
    if above:
        lines.append("PEAK ABOVE PREDICT'S ESTIMATE (raise runtime/inference/memory_budget.py's constants): "
                     + "; ".join(above))
    lines.append("per round (s, scans): " + "; ".join(
        f"{n} " + " / ".join(f"{r['seconds']:.1f}" for r in runs[n]) for n in names))
    lines.append("load average before each run: " + "; ".join(
        f"{n} " + " / ".join(f"{r['load']:.1f}" for r in runs[n]) for n in names))
    if setup:
        lines.append("conversion before the rounds (s, once per checkpoint and window; cached): "
                     + ", ".join(f"{n} {s:.1f}" for n, s in setup.items()))
    return "\n".join(lines)


def variant_names(args) -> list[str]:
    """``--variants`` (default: all, ``mlcommons`` only with ``--reference_code``), checked."""
    default = [n for n in VARIANTS if n != "openvino_int8_kept" and (n != "mlcommons" or args.reference_code)]
    names = [n for n in (args.variants or ",".join(default)).split(",") if n]
    unknown = [n for n in names if base_variant(n) not in VARIANTS
               or (base_variant(n) == "openvino_int8_kept") != (kept_set_name(n) is not None)]
    if unknown:
        raise SystemExit(f"bench_backends: unknown variant {unknown[0]!r}; choose from {list(VARIANTS)} "
                         f"(openvino_int8_kept:SET with SET one of {list(kept_sets())})")
    bad_sets = [kept_set_name(n) for n in names if kept_set_name(n) not in (None, *kept_sets())]
    if bad_sets:
        raise SystemExit(f"bench_backends: no kept set {bad_sets[0]!r}; choose from {list(kept_sets())}")
    if "mlcommons" in names:
        if not args.reference_code:
            raise SystemExit("bench_backends: the mlcommons variant needs --reference_code "
                             "(image_segmentation/pytorch of a mlcommons/training checkout)")
        from benchmarks.mlcommons import check_reference_code

        args.reference_code = check_reference_code(args.reference_code)  # the children run in ROOT
    return names


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.child_reference is not None:
        return run_reference_child(args.child_reference)
    if args.child_mlcommons is not None:
        return run_mlcommons_child(args.child_mlcommons)
    if args.child_kept is not None:
        return run_kept_child(args.child_kept)
    names = variant_names(args)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_backends_"))
    work.mkdir(parents=True, exist_ok=True)
    inputs = make_inputs(args, work)
    windows, shapes = window_count(inputs[0], args.roi)
    print(f"{cpu_line()}\n{versions()}\n{windows} windows of {args.roi}³ per run expected (predict's geometry); "
          f"work in {work}", flush=True)
    setup = prepare(names, inputs, work, args.roi)
    runs, labels = run_rounds(names, inputs, work, args.rounds, args.roi, args.reference_code)
    text = report(args, names, runs, labels, setup, shapes, inputs)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
