"""Training and evaluation throughput: the plain configuration and the optimised ones, in one run.

Training rows time this application's own training step (built as ``runtime.app`` builds it) on
the real data pipeline over synthetic volumes: ``plain`` (fp32, NCDHW, memory cache, eager), the
levers added one after another, some alone on top of plain, all with ``--loader synthetic``, and
all at larger batches. Columns: samples/s, median step (CUDA events on a GPU), TFLOP/s
(:func:`benchmarks.harness.flop_count_per_sample`), its share of ``--ceiling_tflops`` (790: dense
bf16 on an H200), peak GPU memory, the largest batch that trains (GPU only). Evaluation rows:
``runtime.evaluation.evaluate`` plain (fp32, one window per forward) against bf16 + several
windows per forward + channels-last (+ compile on a GPU).

    python -m benchmarks.bench_throughput --out throughput.md            # GPU: the full table
    python -m benchmarks.bench_throughput --rows ladder --out ladder.md  # a subset (gpu_check)
    python -m benchmarks.bench_throughput --smoke --out smoke.md         # CPU smoke run, tiny shapes
"""
from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from benchmarks.harness import flop_count_per_sample, write_blob_case
from data_loading.data_loader import data_source
from data_loading.dataset import read_evaluation_ids
from data_loading.windows import window_geometry
from runtime import distributed as D
from runtime.arguments import parse_args
from runtime.build import Components, build_components, build_model
from runtime.compiling import OUT_OF_MEMORY
from runtime.evaluation import evaluate
from runtime.graphs import cuda_graphs_supported
from runtime.inference.predictor import build_predictor, options_from
from runtime.inference.sliding_window import sliding_window_inference
from runtime.resolve import resolve
from runtime.training.loop import set_learning_rate, step_inputs

LEVERS = {
    "bf16": ["--amp", "--amp_dtype", "bf16"],
    "channels_last": ["--channels_last"],
    "device_cache": ["--cache", "device"],
    "fused_optimizer": ["--fused_optimizer"],
    "cudnn_benchmark": ["--cudnn_benchmark"],
    "compile": ["--compile"],
    "cuda_graphs": ["--cuda_graphs"],
}
LADDER = tuple(LEVERS)
SINGLES = ("channels_last", "device_cache", "compile", "cuda_graphs")   # bf16 alone is ladder row 2
LABELS = {k: k if k == "channels_last" else k.replace("_", " ") for k in LEVERS}
ROW_GROUPS = ("ladder", "single", "synthetic", "sweep")


@dataclass(frozen=True)
class TrainRow:
    name: str
    levers: tuple[str, ...]
    loader: str = "pytorch"
    batch_size: int | str | None = None     # None: --batch_size; "max": the largest that fits


@dataclass
class TrainResult:
    row: TrainRow
    batch_size: int | None = None
    samples_per_s: float | None = None
    ms_per_step: float | None = None
    peak_gib: float | None = None
    largest_batch: str = "n/a"
    notes: list[str] = field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes for a CPU smoke test")
    p.add_argument("--out", default="", help="also write the tables as markdown to this file")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--rows", default=",".join(ROW_GROUPS), help="row groups besides plain, comma-separated")
    p.add_argument("--no_eval", action="store_true", help="skip the evaluation timing")
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--patch", type=int, nargs="+", default=[128], help="patch and window: 1 size (cubic) or 3")
    p.add_argument("--filters", type=int, nargs=5, default=None, help="model widths (default: the benchmark's)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per row (compilation, autotuning)")
    p.add_argument("--plain_workers", type=int, default=8, help="CPU data workers of the plain row")
    p.add_argument("--cases", type=int, default=64, help="training case ids (links to --distinct volumes)")
    p.add_argument("--distinct", type=int, default=4, help="distinct synthetic training volumes written")
    p.add_argument("--case_shape", type=int, nargs=3, default=[190, 250, 250])
    p.add_argument("--eval_volumes", type=int, default=42)
    p.add_argument("--eval_shape", type=int, nargs=3, default=[190, 250, 250])
    p.add_argument("--eval_sw_batch", type=int, default=4, help="windows per forward in the optimised evaluation")
    p.add_argument("--sweep_batches", type=int, nargs="*", default=[4, 8], help="all levers at these batches too")
    p.add_argument("--max_batch_limit", type=int, default=64, help="upper bound of the largest-batch search")
    p.add_argument("--ceiling_tflops", type=float, default=790.0, help="dense bf16 H200: 790")
    p.add_argument("--smoke_compile", action="store_true", help="keep the compile rows in --smoke (minutes on a CPU)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: its default)")
    p.add_argument("--data_dir", default="", help="write/keep the synthetic volumes here (default: a temp dir)")
    return p


SMOKE = dict(filters=[4, 8, 16, 32, 32], patch=[64], batch_size=1, steps=2, warmup=1, plain_workers=0,
             cases=4, distinct=2, case_shape=[72, 80, 80], eval_volumes=1, eval_shape=[64, 96, 96],
             sweep_batches=[2], max_batch_limit=4, device="cpu")


def apply_smoke(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Tiny shapes that run in about a minute on two CPU cores; values given on the command
    line are kept."""
    for name, value in SMOKE.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)
    return args


def patch_shape(args) -> tuple[int, int, int]:
    if len(args.patch) not in (1, 3):
        raise SystemExit(f"bench_throughput: --patch takes 1 or 3 sizes, got {args.patch}")
    return tuple(args.patch * 3 if len(args.patch) == 1 else args.patch)


def patch_text(args) -> str:
    return "x".join(map(str, patch_shape(args)))


def write_volumes(folder: Path, args: argparse.Namespace) -> None:
    """``--distinct`` training volumes and one or two evaluation volumes, linked to as many case
    ids as asked (the pipeline treats every id as a case; the page cache holds one copy)."""
    evaluation = read_evaluation_ids()
    eval_set = set(evaluation)
    train_ids = [f"{i:05d}" for i in range(1000) if f"{i:05d}" not in eval_set][:args.cases]
    eval_ids = evaluation[:args.eval_volumes] if not args.no_eval else []
    rng = np.random.default_rng(2026)
    sources = []
    for i in range(min(args.distinct, len(train_ids))):
        write_blob_case(folder, train_ids[i], tuple(args.case_shape), rng)
        sources.append(train_ids[i])
    for i, case_id in enumerate(train_ids[len(sources):]):
        _link_case(folder, sources[i % len(sources)], case_id)
    if eval_ids:
        eval_sources = eval_ids[:min(2, len(eval_ids))]
        for case_id in eval_sources:
            write_blob_case(folder, case_id, tuple(args.eval_shape), rng)
        for i, case_id in enumerate(eval_ids[len(eval_sources):]):
            _link_case(folder, eval_sources[i % len(eval_sources)], case_id)


def _link_case(folder: Path, source: str, case_id: str) -> None:
    for suffix in ("x", "y"):
        target = folder / f"case_{case_id}_{suffix}.npy"
        if not target.exists():
            os.symlink(f"case_{source}_{suffix}.npy", target)


def base_argv(args, data_dir: Path, device: torch.device) -> list[str]:
    argv = ["--data_dir", str(data_dir), "--device", device.type, "--seed", "0", "--benchmark",
            "--input_shape", *map(str, patch_shape(args)), "--val_input_shape", *map(str, patch_shape(args)),
            "--learning_rate", "0.01", "--overlap", "0.5", "--prefetch", "2"]
    if args.filters:
        argv += ["--filters", *map(str, args.filters)]
    return argv


def lever_unavailable(lever: str, device: torch.device, args, plain_config) -> str | None:
    """Why ``lever`` is not measured on this device/run (None: it is)."""
    if device.type != "cuda" and lever in ("fused_optimizer", "cudnn_benchmark"):
        return f"no effect on {device.type} (CUDA-only kernels)"
    if lever == "cuda_graphs":
        ok, reason = cuda_graphs_supported(device, plain_config)
        return None if ok else reason
    if lever == "compile" and args.smoke and not args.smoke_compile:
        return "skipped in --smoke (compiling takes minutes on a CPU; --smoke_compile keeps it)"
    return None


def train_rows(groups: set[str], args) -> list[TrainRow]:
    rows = [TrainRow("plain", ())]
    if "ladder" in groups:
        for i, lever in enumerate(LADDER):
            rows.append(TrainRow(f"+ {LABELS[lever]}", LADDER[:i + 1]))
    if "single" in groups:
        rows += [TrainRow(f"plain + {LABELS[lever]} only", (lever,)) for lever in SINGLES]
    if "synthetic" in groups:
        rows.append(TrainRow("all levers, --loader synthetic", LADDER, loader="synthetic"))
    if "sweep" in groups:
        rows += [TrainRow(f"all levers, batch {b}", LADDER, batch_size=b)
                 for b in args.sweep_batches if b != args.batch_size]
        rows.append(TrainRow("all levers, largest batch", LADDER, batch_size="max"))
    return rows


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def endless(loader):
    """Batches across epochs, as training sees them (``set_epoch`` before each)."""
    epoch = 1
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def bench_components(config, device: torch.device, data) -> Components:
    """The training components exactly as ``runtime.app.run`` builds them (no logging)."""
    dist_info = D.DistInfo(rank=0, local_rank=0, world_size=1, device=device)
    config = resolve(config, dist_info, data)
    components = build_components(config, dist_info, data)
    set_learning_rate(components.optimizer, config.learning_rate)
    return components


def make_step(components: Components):
    """``step(image, label) -> loss``: what the training loop does with a batch."""

    def step(image, label):
        image, label = step_inputs(components, image, label)
        return components.step(image, label)
    return step


def time_steps(step, batches, warmup: int, steps: int, device: torch.device) -> tuple[float, float, float]:
    """``(wall seconds of the timed steps, median ms per step, last loss)``.

    One host sync before and one after the timed steps, none in between (as in training). On the
    GPU the per-step times come from CUDA events recorded at each loop start, i.e. the GPU-side
    time from one step's launch to the next, data waits included.
    """
    for _ in range(warmup):
        step(*next(batches))
    synchronize(device)
    cuda = device.type == "cuda"
    marks = []
    loss = None
    start = time.perf_counter()
    for _ in range(steps):
        marks.append(_mark(cuda))
        loss = step(*next(batches))
    marks.append(_mark(cuda))
    synchronize(device)
    wall = time.perf_counter() - start
    if cuda:
        per_step = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    else:
        per_step = [1e3 * (b - a) for a, b in zip(marks, marks[1:])]
    return wall, statistics.median(per_step), float(loss) if loss is not None else float("nan")


def _mark(cuda: bool):
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _error_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160] if text else ''}"


def largest_batch(config, device: torch.device, limit: int) -> tuple[int, str]:
    """The largest batch (<= ``limit``) for which two eager training steps of ``config`` run on
    ``device``, and what stopped the next size; doubling from 1, then bisection."""
    c = bench_components(config, device, data_source(config))
    patch = config.input_shape
    step = make_step(c)

    def runs(batch: int) -> tuple[bool, str]:
        try:
            image = torch.randn(batch, 1, *patch, device=device)
            label = torch.randint(0, 3, (batch, 1, *patch), dtype=torch.uint8, device=device)
            for _ in range(2):      # the second step also holds the optimizer state
                step(image, label)
            synchronize(device)
            return True, ""
        except OUT_OF_MEMORY:
            return False, "out of memory"
        except RuntimeError as err:
            return False, _error_line(err)
        finally:
            image = label = None
            c.optimizer.zero_grad(set_to_none=True)
            free_memory(device)

    good, why = search_largest(runs, limit)
    c = step = None  # drop the model and optimizer state before the next row
    free_memory(device)
    return good, why


def search_largest(runs, limit: int) -> tuple[int, str]:
    """The largest ``b <= limit`` with ``runs(b)[0]`` (assumed monotone), and the reason the next
    size failed (or ``"limit N"``): doubling from 1, then bisection. 0 if even 1 fails."""
    good, bad, why = 0, None, f"limit {limit}"
    batch = 1
    while batch <= limit:
        ok, reason = runs(batch)
        if not ok:
            bad, why = batch, reason
            break
        good, batch = batch, batch * 2
    if bad is None and good < limit:
        ok, reason = runs(limit)
        if ok:
            return limit, why
        bad, why = limit, reason
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        ok, reason = runs(middle)
        if ok:
            good = middle
        else:
            bad, why = middle, reason
    return good, why


class LoaderCache:
    """A data source that keeps the last loaders, reused by the next row when its data settings
    are the same (building one labels every case's components); never more than one alive, so a
    device cache does not count towards another row's peak memory."""

    def __init__(self):
        self.key, self.loaders_ = None, None

    def summary(self, config):
        return data_source(config).summary(config)

    def loaders(self, config, num_shards, rank, device=None):
        key = (config.loader, config.cache, config.num_workers, config.batch_size, config.exec_mode)
        if key != self.key:
            self.key, self.loaders_ = None, None
            gc.collect()
            self.loaders_ = data_source(config).loaders(config, num_shards, rank, device)
            self.key = key
        return self.loaders_


def run_train_row(row: TrainRow, args, argv0: list[str], device: torch.device, batch_size: int,
                  loaders: LoaderCache) -> TrainResult:
    result = TrainResult(row, batch_size=batch_size)
    argv = argv0 + ["--cache", "memory", "--num_workers", str(args.plain_workers),
                    "--loader", row.loader, "--batch_size", str(batch_size),
                    "--warmup_steps", str(args.warmup)]
    for lever in row.levers:
        argv += LEVERS[lever]
    config = parse_args(argv, prog="bench_throughput")
    if config.cuda_graphs:
        ok, reason = cuda_graphs_supported(device, config)
        if not ok:
            result.notes.append(f"n/a: {reason}")
            return result
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    batches = None
    try:
        c = bench_components(config, device, loaders)
        loader = c.train_loader
        batches = endless(loader)
        step = make_step(c)
        wall, median_ms, loss = time_steps(step, batches, args.warmup, args.steps, device)
        result.samples_per_s = args.steps * batch_size / wall
        result.ms_per_step = median_ms
        if not math.isfinite(loss):
            result.notes.append(f"loss {loss}")
        if getattr(loader, "cache", None) not in (None, config.cache) and config.loader == "pytorch":
            result.notes.append(f"cache {loader.cache}")
    except OUT_OF_MEMORY:
        result.notes.append("out of memory")
    except Exception as err:  # noqa: BLE001 - one failing lever must not hide the others' rows
        result.notes.append(f"failed: {_error_line(err)}")
    finally:
        if batches is not None:
            batches.close()
        c = step = None
    if device.type == "cuda":
        result.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
    free_memory(device)
    return result


@dataclass
class EvalResult:
    name: str
    volumes: int = 0
    windows: int = 0
    seconds: float | None = None
    peak_gib: float | None = None
    tflops: float | None = None
    notes: list[str] = field(default_factory=list)


def run_eval_row(name: str, flags: list[str], args, argv0: list[str], device: torch.device) -> EvalResult:
    result = EvalResult(name)
    config = parse_args(argv0 + ["--exec_mode", "evaluate", "--num_workers", "0", *flags],
                        prog="bench_throughput")
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        c = bench_components(config, device, data_source(config))
        model, val_loader = c.eval_model, c.val_loader
        roi = config.val_input_shape
        flops_per_window = flop_count_per_sample(model, roi)[0]
        first = iter(val_loader)
        image, label, _ = next(first)
        first.close()
        windows_per_volume = window_geometry(image.shape[2:], roi, config.overlap).n_windows
        model.eval()
        predict = build_predictor(model, device, options_from(c.config))
        with torch.no_grad():      # warm-up: every window-batch shape once (autotuning, compiling)
            sliding_window_inference(predict, image.to(device), roi, config.overlap, config.sw_batch_size)
        image = label = None
        synchronize(device)
        start = time.perf_counter()
        metrics = evaluate(predict, val_loader, c.loss_fn, c.score_fn, roi, config.overlap,
                           config.sw_batch_size, device)
        synchronize(device)
        result.seconds = time.perf_counter() - start
        result.volumes = int(metrics["eval_cases"])
        result.windows = windows_per_volume * result.volumes
        result.tflops = flops_per_window * result.windows / result.seconds / 1e12
    except OUT_OF_MEMORY:
        result.notes.append("out of memory")
    except Exception as err:  # noqa: BLE001
        result.notes.append(f"failed: {_error_line(err)}")
    finally:
        c = model = None
    if device.type == "cuda":
        result.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
    free_memory(device)
    return result


def flops_text(flops: float) -> str:
    return f"{flops / 1e12:.3f} TFLOP" if flops >= 1e11 else f"{flops / 1e9:.3f} GFLOP"


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def environment_lines(args, device: torch.device, command: str) -> list[str]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        what = (f"{props.name}, {props.total_memory / 2**30:.0f} GiB; CUDA {torch.version.cuda}, "
                f"cuDNN {torch.backends.cudnn.version()}")
    else:
        what = f"CPU ({platform.processor() or platform.machine()}), torch threads: {torch.get_num_threads()}"
    filters = args.filters or "default (32 64 128 256 320)"
    return [f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
            f"- device: {what}; torch {torch.__version__}, Python {platform.python_version()}",
            f"- command: `{command}`",
            f"- model filters {filters}; patch {patch_text(args)}; {args.steps} timed steps after "
            f"{args.warmup} warm-up steps per row; training volumes {tuple(args.case_shape)} "
            f"({args.distinct} distinct, {args.cases} case ids); learning rate 0.01"]


def train_table(results: list[TrainResult], flops: int, ceiling: float, device: torch.device) -> list[str]:
    plain = next((r.samples_per_s for r in results if r.row.name == "plain"), None)
    lines = ["| configuration | batch | samples/s | ms/step (median) | TFLOP/s | of ceiling | "
             "peak GiB | largest batch | vs plain | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        tflops = r.samples_per_s * flops / 1e12 if r.samples_per_s else None
        ratio = r.samples_per_s / plain if (r.samples_per_s and plain) else None
        # the ceiling is a GPU's: a fraction of it means nothing for a CPU run
        of_ceiling = f"{tflops / ceiling * 100:.1f}%" if (tflops and device.type == "cuda") else "-"
        peak = _fmt(r.peak_gib, ".1f") if device.type == "cuda" else "n/a"
        lines.append(f"| {r.row.name} | {r.batch_size or '-'} | {_fmt(r.samples_per_s, '.2f')} | "
                     f"{_fmt(r.ms_per_step, '.1f')} | {_fmt(tflops, '.3g' if device.type != 'cuda' else '.1f')} | "
                     f"{of_ceiling} | "
                     f"{peak} | {r.largest_batch} | {_fmt(ratio, '.2f')}{'x' if ratio else ''} | "
                     f"{'; '.join(r.notes)} |")
    return lines


def eval_table(results: list[EvalResult], device: torch.device) -> list[str]:
    lines = ["| evaluation | volumes | windows | total s | s/volume | TFLOP/s | peak GiB | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        per_volume = r.seconds / r.volumes if (r.seconds and r.volumes) else None
        peak = _fmt(r.peak_gib, ".1f") if device.type == "cuda" else "n/a"
        lines.append(f"| {r.name} | {r.volumes} | {r.windows} | {_fmt(r.seconds, '.2f')} | "
                     f"{_fmt(per_volume, '.3f')} | {_fmt(r.tflops, '.3g' if device.type != 'cuda' else '.1f')} | "
                     f"{peak} | {'; '.join(r.notes)} |")
    return lines


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        args = apply_smoke(args, parser)
    command = "python -m benchmarks.bench_throughput " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = D.select_device(args.device, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = {g for g in args.rows.split(",") if g}
    unknown = groups - set(ROW_GROUPS)
    if unknown:
        raise SystemExit(f"bench_throughput: unknown --rows {sorted(unknown)}; choose from {ROW_GROUPS}")

    keep = bool(args.data_dir)
    folder = Path(args.data_dir or tempfile.mkdtemp(prefix="bench_throughput_"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        tick = time.perf_counter()
        write_volumes(folder, args)
        print(f"volumes in {folder} ({time.perf_counter() - tick:.1f} s)", flush=True)
        argv0 = base_argv(args, folder, device)
        plain_config = parse_args(argv0, prog="bench_throughput")
        with torch.device("meta"):         # shapes only: no memory, no initialisation cost
            flops = flop_count_per_sample(build_model(plain_config, torch.device("meta")),
                                          plain_config.input_shape)[1]
        print(f"model: {flops_text(flops)} per sample (forward + backward) at {patch_text(args)}", flush=True)

        largest: dict[tuple[bool, bool], tuple[int, str]] = {}
        if device.type == "cuda":
            for key in [(False, False), (True, True)]:
                flags = (LEVERS["bf16"] if key[0] else []) + (LEVERS["channels_last"] if key[1] else [])
                config = parse_args(argv0 + flags + ["--batch_size", "1"], prog="bench_throughput")
                largest[key] = largest_batch(config, device, min(args.max_batch_limit, args.cases))
                print(f"largest batch (bf16={key[0]}, channels_last={key[1]}): {largest[key][0]} "
                      f"(next size: {largest[key][1]})", flush=True)

        results: list[TrainResult] = []
        loaders = LoaderCache()
        # Untimed: process-wide first-use costs (allocator growth, kernel/primitive caches, the
        # first DataLoader start) would otherwise all land on the plain row.
        run_train_row(TrainRow("process warm-up", ()), argparse.Namespace(**{**vars(args), "steps": 1}),
                      argv0, device, args.batch_size, loaders)
        dropped: set[str] = set()
        for row in train_rows(groups, args):
            skipped = {lever: lever_unavailable(lever, device, args, plain_config) for lever in row.levers}
            new = row.levers[-1] if row.levers else None
            if new is not None and skipped.get(new) and (len(row.levers) == 1 or row.name.startswith("+")):
                results.append(TrainResult(row, notes=[f"n/a: {skipped[new]}"]))
                print(f"{row.name}: n/a ({skipped[new]})", flush=True)
                continue
            active = tuple(lever for lever in row.levers if not skipped[lever])
            dropped |= set(row.levers) - set(active)
            key = ("bf16" in active, "channels_last" in active)
            batch = row.batch_size or args.batch_size
            if batch == "max":
                if key not in largest:
                    results.append(TrainResult(row, notes=["n/a: the largest-batch search runs on a GPU only"]))
                    continue
                batch = largest[key][0]
            result = run_train_row(TrainRow(row.name, active, row.loader), args, argv0, device, batch, loaders)
            result.row = row
            if key in largest:
                result.largest_batch = str(largest[key][0])
            results.append(result)
            print(f"{row.name}: {_fmt(result.samples_per_s, '.2f')} samples/s, "
                  f"{_fmt(result.ms_per_step, '.1f')} ms/step {'; '.join(result.notes)}", flush=True)
        loaders = None

        eval_results: list[EvalResult] = []
        if not args.no_eval:
            optimised = LEVERS["bf16"] + LEVERS["channels_last"] + ["--sw_batch_size", str(args.eval_sw_batch)]
            eval_rows = [("plain: fp32, 1 window per forward", ["--sw_batch_size", "1"]),
                         (f"bf16 + {args.eval_sw_batch} windows per forward + channels_last", optimised)]
            if device.type == "cuda":
                eval_rows.append(("+ cudnn benchmark + compile", optimised + ["--cudnn_benchmark", "--compile"]))
            for name, flags in eval_rows:
                result = run_eval_row(name, flags, args, argv0, device)
                eval_results.append(result)
                print(f"eval {name}: {_fmt(result.seconds, '.2f')} s for {result.volumes} volumes "
                      f"{'; '.join(result.notes)}", flush=True)

        lines = ["## Training throughput", ""] + environment_lines(args, device, command)
        if device.type != "cuda":
            lines.append("- CPU run: peak memory and the largest-batch search are GPU-only")
        lines += ["", *train_table(results, flops, args.ceiling_tflops, device), ""]
        lines += [f"TFLOP/s = samples/s x {flops_text(flops)} per sample (forward + backward, "
                  f"FlopCounterMode); ceiling {args.ceiling_tflops:g} TFLOP/s. Largest batch: eager "
                  "steps with the row's precision and memory format."]
        if dropped:
            lines.append(f"Levers left out of the later rows on this run: {', '.join(sorted(dropped))}.")
        if eval_results:
            lines += ["", "## Evaluation", "",
                      f"{args.eval_volumes} synthetic volumes of {tuple(args.eval_shape)}, window "
                      f"{patch_text(args)}, overlap 0.5, loss and Dice included; one untimed volume first.", "",
                      *eval_table(eval_results, device)]
        text = "\n".join(lines) + "\n"
        print("\n" + text)
        if args.out:
            Path(args.out).write_text(text)
        return 0
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
