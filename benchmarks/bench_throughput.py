"""Training and evaluation throughput (GPU; ``--smoke``: tiny CPU shapes): this application's training step on
the real data pipeline over synthetic volumes, ``plain`` (fp32, NCDHW, memory cache, eager) against the speed
levers one after another (``--rows ladder``), alone, with ``--loader synthetic`` and at larger batches;
evaluation plain against bf16 + several windows per forward + channels-last (+ compile on a GPU)."""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from benchmarks.harness import flop_count_per_sample, header, report, table, training_ids, write_blob_cases
from data_loading.data_loader import data_source
from data_loading.dataset import read_evaluation_ids
from data_loading.windows import window_geometry
from runtime import distributed as D
from runtime.arguments import parse_args, used_in
from runtime.build import build_components, build_model
from runtime.clocked.evaluation import evaluate
from runtime.compiling import OUT_OF_MEMORY
from runtime.levers.gpu.graphs import cuda_graphs_supported
from runtime.inference.predictor import build_predictor, options_from
from runtime.inference.sliding_window import sliding_window_inference
from runtime.report.run_summary import number_text
from runtime.resolve import network_of_flags, resolve
from runtime.training.loop import set_learning_rate, step_inputs

LEVERS = {"bf16": ["--amp", "--amp_dtype", "bf16"], "channels_last": ["--channels_last"],
          "device_cache": ["--cache", "device"], "fused_optimizer": ["--fused_optimizer"],
          "cudnn_benchmark": ["--cudnn_benchmark"], "compile": ["--compile"], "cuda_graphs": ["--cuda_graphs"]}
LADDER = tuple(LEVERS)
SINGLES = ("channels_last", "device_cache", "compile", "cuda_graphs")   # bf16 alone is ladder row 2
LABELS = {k: k if k == "channels_last" else k.replace("_", " ") for k in LEVERS}
ROW_GROUPS = ("ladder", "single", "synthetic", "sweep")
SMOKE = dict(filters=[4, 8, 16, 32, 32], patch=[64], batch_size=1, steps=2, warmup=1, plain_workers=0,
             cases=4, distinct=2, case_shape=[72, 80, 80], eval_volumes=1, eval_shape=[64, 96, 96],
             sweep_batches=[2], max_batch_limit=4)


@dataclass(frozen=True)
class TrainRow:
    name: str
    levers: tuple[str, ...]
    loader: str = "pytorch"
    batch_size: int | str | None = None     # None: --batch_size; "max": the largest that fits


@dataclass
class Result:
    """A training row (``row``, ``batch_size``) or an evaluation row (``name``, ``volumes``...)."""
    row: TrainRow | None = None
    name: str = ""
    batch_size: int | None = None
    samples_per_s: float | None = None
    ms_per_step: float | None = None
    volumes: int = 0
    windows: int = 0
    seconds: float | None = None
    tflops: float | None = None
    peak_gib: float | None = None
    largest_batch: str = "n/a"
    notes: list[str] = field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--smoke", action="store_true", help="tiny shapes for a CPU smoke test")
    p.add_argument("--out", default="", help="also write the tables as markdown to this file")
    p.add_argument("--rows", default=",".join(ROW_GROUPS), help="row groups besides plain, comma-separated")
    p.add_argument("--levers", nargs="*", default=[], metavar="LEVER+LEVER[@BATCH]",
                   help=f"rows of exactly these levers, after the groups' rows (levers: {', '.join(LEVERS)}), "
                        "e.g. bf16+compile or bf16+compile+cuda_graphs@7")
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
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: its default)")
    p.add_argument("--data_dir", default="", help="write/keep the synthetic volumes here (default: a temp dir)")
    return p


def lever_unavailable(lever: str, device: torch.device, args, plain_config) -> str | None:
    """Why ``lever`` is not measured on this device/run (None: it is)."""
    if device.type != "cuda" and lever in ("fused_optimizer", "cudnn_benchmark"):
        return f"no effect on {device.type} (CUDA-only kernels)"
    if lever == "cuda_graphs":
        ok, reason = cuda_graphs_supported(device, plain_config)
        return None if ok else reason
    if lever == "compile" and args.smoke:
        return "skipped in --smoke (compiling takes minutes on a CPU)"
    return None


def train_rows(groups: set[str], args) -> list[TrainRow]:
    rows = [TrainRow("plain", ())]
    if "ladder" in groups:
        rows += [TrainRow(f"+ {LABELS[lever]}", LADDER[:i + 1]) for i, lever in enumerate(LADDER)]
    if "single" in groups:
        rows += [TrainRow(f"plain + {LABELS[lever]} only", (lever,)) for lever in SINGLES]
    if "synthetic" in groups:
        rows.append(TrainRow("all levers, --loader synthetic", LADDER, loader="synthetic"))
    if "sweep" in groups:
        rows += [TrainRow(f"all levers, batch {b}", LADDER, batch_size=b)
                 for b in args.sweep_batches if b != args.batch_size]
        rows.append(TrainRow("all levers, largest batch", LADDER, batch_size="max"))
    return rows


def lever_row(text: str) -> TrainRow:
    """A ``--levers`` row: ``bf16+compile`` or ``bf16+compile@7`` (a batch size of its own); ValueError: why not."""
    names, _, batch = text.partition("@")
    levers = tuple(name for name in names.split("+") if name)
    unknown = [name for name in levers if name not in LEVERS]
    if unknown or (batch and not batch.isdigit()):
        raise ValueError(f"--levers {text!r}: " + (f"unknown lever(s) {unknown}; choose from {', '.join(LEVERS)}"
                                                   if unknown else "the batch after @ is a whole number"))
    levers = tuple(lever for lever in LADDER if lever in levers)   # the ladder's order, whatever the text's
    return TrainRow(" + ".join(LABELS[lever] for lever in levers) + (f", batch {batch}" if batch else ""),
                    levers, batch_size=int(batch) if batch else None)


def check(args) -> list[str]:
    """Every refusal of the command line, one line each ([]: none): before any device, volume or row."""
    problems = [f"--patch takes 1 or 3 sizes, got {args.patch}"] if len(args.patch) not in (1, 3) else []
    for text in args.levers:
        try:
            lever_row(text)
        except ValueError as error:
            problems.append(str(error))
    unknown = {g for g in args.rows.split(",") if g} - set(ROW_GROUPS)
    return problems + ([f"unknown --rows {sorted(unknown)}; choose from {ROW_GROUPS}"] if unknown else [])


def plan_ladder(args, cuda: bool) -> tuple[list[TrainRow], list[tuple[str, list[str]]]]:
    """The rows to measure, in order: training (the groups', then ``--levers``') and evaluation (name, flags)."""
    optimised = LEVERS["bf16"] + LEVERS["channels_last"] + ["--sw_batch_size", str(args.eval_sw_batch)]
    evaluation = [("plain: fp32, 1 window per forward", ["--sw_batch_size", "1"]),
                  (f"bf16 + {args.eval_sw_batch} windows per forward + channels_last", optimised)]
    evaluation += [("+ cudnn benchmark + compile", optimised + ["--cudnn_benchmark", "--compile"])] if cuda else []
    return (train_rows({g for g in args.rows.split(",") if g}, args) + list(map(lever_row, args.levers)),
            [] if args.no_eval else evaluation)


def row_runs(rows, unavailable: dict, batch_size: int, largest: dict) -> tuple[list, set[str]]:
    """(row, the row run here: its levers measured here and its batch, or None, why not) of each row, and the levers
    left out. ``unavailable``: lever -> why not here (None: it is); ``largest``: per (bf16, channels_last)."""
    runs, dropped = [], set()
    for row in rows:
        why = unavailable[row.levers[-1]] if row.levers else None
        if why and (len(row.levers) == 1 or row.name.startswith("+")):
            runs.append((row, None, f"n/a: {why}"))
            continue
        active = tuple(lever for lever in row.levers if not unavailable[lever])
        dropped |= set(row.levers) - set(active)
        key, batch = ("bf16" in active, "channels_last" in active), row.batch_size or batch_size
        if batch == "max" and key not in largest:
            runs.append((row, None, "n/a: the largest-batch search runs on a GPU only"))
        else:
            runs.append((row, TrainRow(row.name, active, row.loader, largest[key][0] if batch == "max" else batch), ""))
    return runs, dropped


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


def bench_components(config, device: torch.device, data):
    """The components exactly as ``runtime.app.run`` builds them (no logging; training's at --learning_rate)."""
    dist_info = D.DistInfo(rank=0, local_rank=0, world_size=1, device=device)
    components = build_components(resolve(config, dist_info, data), dist_info, data)
    if components.optimizer is not None:  # training (an evaluation row builds none)
        set_learning_rate(components.optimizer, config.learning_rate)
    return components


def make_step(components):
    """``step(image, label) -> loss``: what the training loop does with a batch."""
    return lambda image, label: components.step(*step_inputs(components, image, label))


def time_steps(step, batches, warmup: int, steps: int, device: torch.device) -> tuple[float, float, float]:
    """``(wall seconds, median ms per step, last loss)`` of the timed steps, one host sync before
    and after them (as in training); on a GPU per-step CUDA events (launch to launch)."""
    cuda = device.type == "cuda"

    def mark():
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    for _ in range(warmup):
        step(*next(batches))
    synchronize(device)
    marks, loss, start = [], None, time.perf_counter()
    for _ in range(steps):
        marks.append(mark())
        loss = step(*next(batches))
    marks.append(mark())
    synchronize(device)
    wall = time.perf_counter() - start
    per_step = [a.elapsed_time(b) if cuda else 1e3 * (b - a) for a, b in zip(marks, marks[1:])]
    return wall, statistics.median(per_step), float(loss) if loss is not None else float("nan")


def _error_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160] if text else ''}"


def largest_batch(config, device: torch.device, limit: int) -> tuple[int, str]:
    """The largest batch (<= ``limit``) for which two eager training steps of ``config`` run on
    ``device`` (the second also holds the optimizer state), and what stopped the next size."""
    c = bench_components(config, device, data_source(config))
    step = make_step(c)

    def runs(batch: int) -> tuple[bool, str]:
        try:
            image = torch.randn(batch, 1, *config.input_shape, device=device)
            label = torch.randint(0, 3, (batch, 1, *config.input_shape), dtype=torch.uint8, device=device)
            for _ in range(2):
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

    found = search_largest(runs, limit)
    c = step = None  # drop the model and optimizer state before the next row
    free_memory(device)
    return found


def search_largest(runs, limit: int) -> tuple[int, str]:
    """The largest ``b <= limit`` with ``runs(b)[0]`` (assumed monotone), and the reason the next
    size failed (or ``"limit N"``): doubling from 1, then bisection. 0 if even 1 fails."""
    good, bad, why, batch = 0, None, f"limit {limit}", 1
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
        good, bad, why = (middle, bad, why) if ok else (good, middle, reason)
    return good, why


class LoaderCache:
    """A data source keeping the last loaders for the next row with the same data settings; one alive at most."""
    key, loaders_, flags = None, None, None  # flags: the row's (its --loader and --data_dir choose the source)
    description = staticmethod(lambda: None)  # the benchmark's own synthetic KiTS19 volumes: no description

    def summary(self, use):
        return data_source(self.flags).summary(use)

    def loaders(self, settings, num_shards, rank, device=None):
        key = (self.flags.loader, settings.cache, settings.num_workers, settings.batch_size, settings.trains)
        if key != self.key:
            self.key, self.loaders_ = None, None
            gc.collect()
            self.loaders_ = data_source(self.flags).loaders(settings, num_shards, rank, device)
            self.key = key
        return self.loaders_


def guarded(result: Result, device: torch.device, work) -> Result:
    """``work()``, its peak GPU memory in ``result``; out of memory or a failure is a note (not hiding other rows)."""
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        work()
    except OUT_OF_MEMORY:
        result.notes.append("out of memory")
    except Exception as err:  # noqa: BLE001
        result.notes.append(f"failed: {_error_line(err)}")
    if device.type == "cuda":
        result.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
    free_memory(device)
    return result


def run_train_row(row: TrainRow, args, argv0: list[str], device: torch.device, batch_size: int,
                  loaders: LoaderCache) -> Result:
    result = Result(row, batch_size=batch_size)
    config = parse_args(argv0 + ["--cache", "memory", "--num_workers", str(args.plain_workers), "--loader", row.loader,
                                 "--batch_size", str(batch_size), "--warmup_steps", str(args.warmup),
                                 *[flag for lever in row.levers for flag in LEVERS[lever]]], prog="bench_throughput")

    def work():
        loaders.flags = config
        c = bench_components(config, device, loaders)
        with contextlib.closing(endless(c.train_loader)) as batches:
            wall, result.ms_per_step, loss = time_steps(make_step(c), batches, args.warmup, args.steps, device)
        result.samples_per_s = args.steps * batch_size / wall
        if not math.isfinite(loss):
            result.notes.append(f"loss {loss}")
        if getattr(c.train_loader, "cache", None) not in (None, config.cache) and config.loader == "pytorch":
            result.notes.append(f"cache {c.train_loader.cache}")
    return guarded(result, device, work)


def run_eval_row(name: str, flags: list[str], argv0: list[str], device: torch.device) -> Result:
    result = Result(name=name)
    config = parse_args(used_in("evaluate --benchmark", argv0) + ["--exec_mode", "evaluate", *flags], prog="bench_throughput")

    def work():
        c = bench_components(config, device, data_source(config))
        roi, model = config.val_input_shape, c.eval_model
        flops_per_window = flop_count_per_sample(model, roi)[0]
        with contextlib.closing(iter(c.val_loader)) as first:
            image = next(first)[0]
        windows_per_volume = window_geometry(image.shape[2:], roi, config.overlap).n_windows
        model.eval()
        predict = build_predictor(model, device, options_from(c.plan.precision, c.plan.inference))
        with torch.no_grad():      # warm-up: every window-batch shape once (autotuning, compiling)
            sliding_window_inference(predict, image.to(device), roi, config.overlap, config.sw_batch_size)
        image = None
        synchronize(device)
        start = time.perf_counter()
        metrics = evaluate(predict, c.val_loader, c.loss_fn, c.score_fn, roi, config.overlap,
                           config.sw_batch_size, device)
        synchronize(device)
        result.seconds = time.perf_counter() - start
        result.volumes = int(metrics["eval_cases"])
        result.windows = windows_per_volume * result.volumes
        result.tflops = flops_per_window * result.windows / result.seconds / 1e12
    return guarded(result, device, work)


def flops_text(flops: float) -> str:
    return f"{flops / 1e12:.3f} TFLOP" if flops >= 1e11 else f"{flops / 1e9:.3f} GFLOP"


def train_table(results: list[Result], flops: int, ceiling: float, cuda: bool) -> str:
    plain = next((r.samples_per_s for r in results if r.row.name == "plain"), None)
    rows = []
    for r in results:
        tflops = r.samples_per_s * flops / 1e12 if r.samples_per_s else None
        ratio = r.samples_per_s / plain if (r.samples_per_s and plain) else None
        rows.append([r.row.name, r.batch_size or "-", number_text(r.samples_per_s, ".2f"), number_text(r.ms_per_step, ".1f"),
                     number_text(tflops, ".1f" if cuda else ".3g"),
                     f"{tflops / ceiling * 100:.1f}%" if (tflops and cuda) else "-",  # a GPU's ceiling
                     number_text(r.peak_gib, ".1f") if cuda else "n/a", r.largest_batch,
                     f"{ratio:.2f}x" if ratio else "-", "; ".join(r.notes)])
    return table(["configuration", "batch", "samples/s", "ms/step (median)", "TFLOP/s", "of ceiling", "peak GiB",
                  "largest batch", "vs plain", "notes"], rows)


def eval_table(results: list[Result], cuda: bool) -> str:
    return table(["evaluation", "volumes", "windows", "total s", "s/volume", "TFLOP/s", "peak GiB", "notes"], [
        [r.name, r.volumes, r.windows, number_text(r.seconds, ".2f"),
         number_text(r.seconds / r.volumes if (r.seconds and r.volumes) else None, ".3f"),
         number_text(r.tflops, ".1f" if cuda else ".3g"), number_text(r.peak_gib, ".1f") if cuda else "n/a", "; ".join(r.notes)]
        for r in results])


def measure(rows: list[TrainRow], evaluation: list, args, argv0: list[str], device: torch.device) -> tuple:
    """The rows measured in order on ``device``: (training results, evaluation results, levers left out)."""
    plain_config = parse_args(argv0, prog="bench_throughput")
    largest: dict[tuple[bool, bool], tuple[int, str]] = {}
    for key in [(False, False), (True, True)] if device.type == "cuda" else []:
        flags = (LEVERS["bf16"] if key[0] else []) + (LEVERS["channels_last"] if key[1] else [])
        config = parse_args(argv0 + flags + ["--batch_size", "1"], prog="bench_throughput")
        largest[key] = largest_batch(config, device, min(args.max_batch_limit, args.cases))
        print(f"largest batch (bf16={key[0]}, channels_last={key[1]}): {largest[key][0]} "
              f"(next size: {largest[key][1]})", flush=True)
    results, loaders = [], LoaderCache()
    # untimed: process-wide first-use costs (allocator, kernel caches, first DataLoader) would land on plain
    run_train_row(TrainRow("process warm-up", ()), argparse.Namespace(**{**vars(args), "steps": 1}),
                  argv0, device, args.batch_size, loaders)
    unavailable = {lever: lever_unavailable(lever, device, args, plain_config) for lever in LEVERS}
    runs, dropped = row_runs(rows, unavailable, args.batch_size, largest)
    for row, run, why in runs:
        if run is None:
            results.append(Result(row, notes=[why]))
            print(f"{row.name}: {why}", flush=True)
            continue
        result = run_train_row(run, args, argv0, device, run.batch_size, loaders)
        key = ("bf16" in run.levers, "channels_last" in run.levers)
        result.row, result.largest_batch = row, str(largest[key][0]) if key in largest else "n/a"
        results.append(result)
        print(f"{row.name}: {number_text(result.samples_per_s, '.2f')} samples/s, "
              f"{number_text(result.ms_per_step, '.1f')} ms/step {'; '.join(result.notes)}", flush=True)
    loaders, eval_results = None, []
    for name, flags in evaluation:
        eval_results.append(run_eval_row(name, flags, argv0, device))
        print(f"eval {name}: {number_text(eval_results[-1].seconds, '.2f')} s for {eval_results[-1].volumes} volumes "
              f"{'; '.join(eval_results[-1].notes)}", flush=True)
    return results, eval_results, dropped


def tables(args, argv, device: torch.device, flops: int, results: list, eval_results: list, dropped: set[str]) -> str:
    """The report: the device, the training and the evaluation tables, as markdown."""
    cuda, patch = device.type == "cuda", "x".join(map(str, args.patch))
    if cuda:
        props = torch.cuda.get_device_properties(device)
        what = (f"{props.name}, {props.total_memory / 2**30:.0f} GiB; CUDA {torch.version.cuda}, "
                f"cuDNN {torch.backends.cudnn.version()}")
    else:
        what = f"CPU, torch threads: {torch.get_num_threads()} (peak memory and the largest-batch search: GPU only)"
    lines = ["## Training throughput", "", header("bench_throughput", argv), "", f"- device: {what}",
             f"- model filters {args.filters or 'default (32 64 128 256 320)'}; patch {patch}; "
             f"{args.steps} timed steps after {args.warmup} warm-up steps per row; training volumes "
             f"{tuple(args.case_shape)} ({args.distinct} distinct, {args.cases} case ids); learning rate 0.01",
             "", train_table(results, flops, args.ceiling_tflops, cuda), "",
             f"TFLOP/s = samples/s x {flops_text(flops)} per sample (forward + backward, FlopCounterMode); "
             f"ceiling {args.ceiling_tflops:g} TFLOP/s. Largest batch: eager steps with the row's precision "
             "and memory format."]
    if dropped:
        lines.append(f"Levers left out of the later rows on this run: {', '.join(sorted(dropped))}.")
    if eval_results:
        lines += ["", "## Evaluation", "", f"{args.eval_volumes} synthetic volumes of {tuple(args.eval_shape)}, "
                  f"window {patch}, overlap 0.5, loss and Dice included; one untimed volume first.", "",
                  eval_table(eval_results, cuda)]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Check the command line (a refusal: one line, before any work), plan the ladder, measure it, write the tables."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, value in SMOKE.items() if args.smoke else ():   # values given on the command line are kept
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)
    problems = check(args)
    if problems:
        raise SystemExit(f"bench_throughput: {problems[0]}")
    args.patch = args.patch * 3 if len(args.patch) == 1 else args.patch
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = D.select_device("cpu" if args.smoke else "auto", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows, evaluation = plan_ladder(args, device.type == "cuda")
    folder = Path(args.data_dir or tempfile.mkdtemp(prefix="bench_throughput_"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        tick, rng = time.perf_counter(), np.random.default_rng(2026)   # --distinct and 2 evaluation volumes, linked
        write_blob_cases(folder, training_ids(args.cases), args.case_shape, rng, args.distinct)
        write_blob_cases(folder, [] if args.no_eval else read_evaluation_ids()[:args.eval_volumes], args.eval_shape, rng, 2)
        print(f"volumes in {folder} ({time.perf_counter() - tick:.1f} s)", flush=True)
        argv0 = ["--data_dir", str(folder), "--device", device.type, "--seed", "0", "--benchmark", "--input_shape",
                 *map(str, args.patch), "--val_input_shape", *map(str, args.patch), "--learning_rate", "0.01",
                 "--overlap", "0.5", "--prefetch", "2", *(["--filters", *map(str, args.filters)] if args.filters else [])]
        plain_config = parse_args(argv0, prog="bench_throughput")
        with (meta := torch.device("meta")):  # shapes only: no memory, no initialisation cost
            flops = flop_count_per_sample(build_model(network_of_flags(plain_config), meta), args.patch)[1]
        print(f"model: {flops_text(flops)} per sample (forward + backward) at {'x'.join(map(str, args.patch))}",
              flush=True)
        report(tables(args, argv, device, flops, *measure(rows, evaluation, args, argv0, device)), args.out)
        return 0
    finally:
        if not args.data_dir:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
