"""What the benchmarks share: timing, lock-step rounds of child processes (each variant once per round, the
first rotating, so that a shared machine's load falls on all alike), the header line, markdown tables, FLOP
counting, synthetic volumes. ``python -m benchmarks.harness flops 128 128 128``: the network's FLOPs per sample."""
from __future__ import annotations

import argparse
import itertools
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def header(name: str, argv: Sequence[str] | None = None) -> str:
    """``# NAME · date · CPU · ISA · cores · torch · load`` and the command that ran."""
    from runtime.levers.cpu.isa import isa_line

    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    argv = sys.argv[1:] if argv is None else argv
    return (f"# {name} · {isa_line()}" + (f" · IMITATION: ONEDNN_MAX_CPU_ISA={cap}" if cap else "")
            + f" · torch {torch.__version__} · load {os.getloadavg()[0]:.2f}\n"
            + f"command: python -m benchmarks.{name} {' '.join(argv)}")


def table(columns: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A markdown table; floats with 2 decimals, None empty."""
    def cell(value) -> str:
        return "" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def timed(fn: Callable[[], object], number: int = 1) -> float:
    """Seconds per call of ``fn`` over ``number`` calls, on the process's threads (the Timer's default: one)."""
    from torch.utils import benchmark

    return benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()).timeit(number).median


@dataclass
class Run:
    """One child process: its measured ``value``, wall seconds, peak RSS GB, load before, output."""
    value: float
    wall: float
    rss_gb: float
    load: float
    text: str


def run_child(command: Sequence[str], log: Path, env: dict | None = None,
              timeout: float | None = None) -> tuple[float, float, int, str]:
    """``(wall seconds, peak RSS GB, exit code, output)`` of ``command`` run from the repository root, its output
    in ``log``; with ``timeout``: in a session of its own, killed with its processes after that, exit code 124."""
    start = time.perf_counter()
    with open(log, "w") as handle:
        process = subprocess.Popen(list(command), cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                   start_new_session=timeout is not None)
        timer = threading.Timer(timeout or 0, os.killpg, (process.pid, signal.SIGKILL))
        if timeout:
            timer.start()
        _, status, usage = os.wait4(process.pid, 0)
        timer.cancel()
    wall, code = time.perf_counter() - start, os.waitstatus_to_exitcode(status)
    return (wall, usage.ru_maxrss * 1024 / 1e9, 124 if timeout and code and wall >= timeout else code,
            log.read_text(errors="replace"))


def lockstep(names: Sequence[str], command: Callable[[str, int], Sequence[str]], rounds: int, work: Path,
             measure: Callable[[str, int, str], float] | None = None, env: dict | None = None) -> dict[str, list[Run]]:
    """Each of ``names`` once per round, ``command(name, round)`` in a child process, the first rotating;
    ``measure(name, round, output)``: a run's value (default: wall time); a failed child stops it, naming its log."""
    runs = {name: [] for name in names}
    work.mkdir(parents=True, exist_ok=True)
    for r in range(rounds):
        for name in list(names[r % len(names):]) + list(names[:r % len(names)]):
            log = work / f"{name.replace(':', '_')}-{r}.log"
            load = os.getloadavg()[0]
            wall, rss, code, text = run_child(command(name, r), log, env)
            value = measure(name, r, text) if measure and code == 0 else wall
            if code != 0 or value is None:
                raise SystemExit(f"{name} failed (exit {code}); see {log}")
            runs[name].append(Run(value, wall, rss, load, text))
            print(f"round {r + 1} {name}: {value:.2f} s, process {wall:.1f} s, peak RSS {rss:.2f} GB, load {load:.1f}")
    return runs


def ratios(values: dict[str, list[float]], baseline: str) -> dict[str, float]:
    """Per variant: the median over rounds of ``baseline / variant`` (above 1: faster)."""
    return {name: statistics.median(b / v for b, v in zip(values[baseline], times))
            for name, times in values.items()}


def checked_variants(prog: str, text: str, known: Sequence[str], reference_code: str) -> tuple[list[str], str]:
    """The variants of a comma list, one line naming the choices for an unknown one; with
    ``mlcommons``, the reference folder checked (:mod:`oracles.mlcommons_reference`)."""
    names = [name for name in text.split(",") if name]
    if not names or set(names) - set(known) or ("mlcommons" in names and not reference_code):
        raise SystemExit(f"{prog}: --variants {text}: choose from {list(known)}; mlcommons needs --reference_code "
                         "(image_segmentation/pytorch of a mlcommons/training checkout; or UNET3D_REFERENCE_CODE)")
    if "mlcommons" in names:
        from oracles.mlcommons_reference import check_reference_code

        reference_code = check_reference_code(reference_code)
    return names, reference_code


def parse_with_reference(p: argparse.ArgumentParser, argv, child: Callable[[str, list[str]], int]):
    """``p``'s arguments, ``--reference_code`` and the hidden ``--child_mlcommons CODE FLAGS...``: the ``mlcommons``
    variant's process, ``child(CODE, FLAGS)``, which exits with its code."""
    p.add_argument("--reference_code", default=os.environ.get("UNET3D_REFERENCE_CODE", ""))
    p.add_argument("--child_mlcommons", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_mlcommons:
        raise SystemExit(child(args.child_mlcommons[0], args.child_mlcommons[1:]))
    return args


def report(text: str, out: str = "") -> None:
    """Print ``text`` after a blank line and, with ``out``, write it there too."""
    print("\n" + text, flush=True)
    if out:
        Path(out).write_text(text + "\n")


def loads(runs: dict[str, list[Run]]) -> str:
    every = [run.load for rs in runs.values() for run in rs]
    return f"load average {min(every):.1f}-{max(every):.1f}"


def result_numbers(output: str) -> dict:
    """Status, seconds, best mean Dice and epochs of a training run's ``RUN_SUMMARY`` line ({}: none)."""
    match = re.search(r"RUN_SUMMARY,image_segmentation,\d+,([\d.]+),(\w+),best_mean_dice=(-?[\d.nan]+),epochs=(\d+)",
                      output)
    if not match:
        return {}
    seconds, status, dice, epochs = match.groups()
    return {"status": status, "seconds": float(seconds), "best_mean_dice": float(dice), "epochs": int(epochs)}


def flop_count_per_sample(model: torch.nn.Module, input_shape: Sequence[int], in_channels: int = 1) -> tuple[int, int]:
    """``(forward, forward + backward)`` FLOPs of one ``(1, in_channels, *input_shape)`` sample
    (``FlopCounterMode`` on ``meta`` weights: 2 per multiply-add, as the spec counts; no input
    gradient for the first layer). The default network at 128³: 954.6 GFLOP, 2.860 TFLOP."""
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    from runtime.checkpoint import unwrap

    module = unwrap(model)
    tensors = {name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
               for name, t in itertools.chain(module.named_parameters(), module.named_buffers())}
    with FlopCounterMode(display=False) as forward:
        logits = functional_call(module, tensors, (torch.empty((1, in_channels, *input_shape), device="meta"),))
    with FlopCounterMode(display=False) as backward:
        logits.float().sum().backward()
    return int(forward.get_total_flops()), int(forward.get_total_flops() + backward.get_total_flops())


def training_ids(count: int) -> list[str]:
    """The first ``count`` case ids that are no evaluation case."""
    from data_loading.dataset import read_evaluation_ids

    evaluation = set(read_evaluation_ids())
    return [f"{i:05d}" for i in range(1000) if f"{i:05d}" not in evaluation][:count]


def write_blob_cases(folder: Path, ids: Sequence[str], shape, rng: np.random.Generator,
                     distinct: int | None = None) -> None:
    """Preprocessed-looking cases for the first ``distinct`` of ``ids`` (default: all): a noise image, two kidney
    ellipsoids (class 1), a tumour (class 2) in one, a few small spurious components of each class; the other ids
    link to them in turn (the pipeline treats every id as a case; the page cache holds one copy)."""
    sources, shape = list(ids[:len(ids) if distinct is None else min(distinct, len(ids))]), tuple(shape)
    d, h, w = shape
    z, y, x = np.ogrid[:d, :h, :w]
    for case_id in sources:
        label = np.zeros(shape, np.uint8)
        for side in (0.27, 0.73):
            c = (d * rng.uniform(0.4, 0.6), h * rng.uniform(0.4, 0.6), w * side)
            r = rng.uniform(25, 45, 3)
            label[((z - c[0]) / r[0]) ** 2 + ((y - c[1]) / r[1]) ** 2 + ((x - c[2]) / r[2]) ** 2 < 1] = 1
        c, r = (d * 0.5, h * 0.5, w * 0.27), rng.uniform(8, 20)
        label[((z - c[0]) ** 2 + (y - c[1]) ** 2 + (x - c[2]) ** 2) < r ** 2] = 2
        for cls in (1, 2):
            for _ in range(6):
                p = [int(rng.integers(0, s - 4)) for s in shape]
                label[p[0]:p[0] + 3, p[1]:p[1] + 3, p[2]:p[2] + 3] = cls
        image = rng.standard_normal(shape, dtype=np.float32) + label.astype(np.float32)
        np.save(folder / f"case_{case_id}_x.npy", image[None])
        np.save(folder / f"case_{case_id}_y.npy", label[None])
    for i, case_id in enumerate(ids[len(sources):]):
        for suffix in ("x", "y"):
            if not (folder / f"case_{case_id}_{suffix}.npy").exists():
                os.symlink(f"case_{sources[i % len(sources)]}_{suffix}.npy", folder / f"case_{case_id}_{suffix}.npy")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="FLOPs per sample of the network (forward, forward + backward)")
    p.add_argument("what", choices=["flops"])
    p.add_argument("shape", type=int, nargs=3)
    args = p.parse_args(argv)
    from model.unet3d import Unet3D

    with torch.device("meta"):
        forward, total = flop_count_per_sample(Unet3D(), args.shape)
    print(f"forward {forward} FLOP, forward + backward {total} FLOP per sample of {'x'.join(map(str, args.shape))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
