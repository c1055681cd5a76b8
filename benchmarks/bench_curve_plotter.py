"""Does drawing curves.png in CurvePlotter's background thread slow the training step?

Two step kinds, each timed with no plotter, with the plotter drawing in its thread
(``write_curves``) and with it drawing in a child process (``write_curves_in_subprocess``), the
plotter drawing without pause (a feeder thread requests a new picture every 10 ms, so a drawing
is always under way: the worst case; training asks once per evaluation), in blocks whose order
rotates so that load from elsewhere on the machine falls on all three alike:

* ``model``: forward + backward + SGD step of a small UNet3D (filters 4 8 16, one 32³
  sample, one torch thread: the other core is left for the plotter, as a GPU run's host is);
* ``python``: 300 small tensor operations, a step bound by Python and the GIL (what a GPU
  step's host side looks like: kernel launches).

Also: how long ``request()`` takes while a drawing is under way, and one drawing's duration.

    python benchmarks/bench_curve_plotter.py [--log_dir RUN_DIR] [--blocks 6] [--steps 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from model.unet3d import Unet3D  # noqa: E402
from runtime.report.plotter import CurvePlotter, write_curves, write_curves_in_subprocess  # noqa: E402


def model_step_fn():
    model = Unet3D(filters=(4, 8, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    image = torch.randn(1, 1, 32, 32, 32)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(image).float().mean().backward()
        optimizer.step()
    return step


def python_step_fn():
    a = torch.ones(8)

    def step():
        b = a
        for _ in range(300):
            b = b * 1.0001 + 0.0
        return b
    return step


def time_steps(step, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        step()
        times.append(time.perf_counter() - begin)
    return times


CONDITIONS = {"idle": None, "thread": write_curves, "process": write_curves_in_subprocess}


def measure(log_dir: str, blocks: int, steps: int) -> None:
    torch.set_num_threads(1)
    current = {"plotter": None}
    stop = threading.Event()

    def feed():
        while not stop.is_set():
            if current["plotter"] is not None:
                current["plotter"].request()
            time.sleep(0.01)
    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    for name, step in (("model", model_step_fn()), ("python", python_step_fn())):
        time_steps(step, 3)  # warm-up
        results = {condition: [] for condition in CONDITIONS}
        for block in range(blocks):
            order = list(CONDITIONS)[block % 3:] + list(CONDITIONS)[:block % 3]  # rotate the order
            for condition in order:
                write = CONDITIONS[condition]
                plotter = CurvePlotter(log_dir, write=write, say=print) if write else None
                current["plotter"] = plotter
                if plotter:
                    time.sleep(1.0)  # let a drawing get under way
                results[condition] += time_steps(step, steps)
                current["plotter"] = None
                if plotter:
                    plotter.close()
        idle = statistics.median(results["idle"])
        line = f"{name:7s} step median: idle {idle * 1e3:.2f} ms"
        for condition in ("thread", "process"):
            busy = statistics.median(results[condition])
            line += f", drawing in a {condition} {busy * 1e3:.2f} ms ({busy / idle:.2f}x)"
        print(line + f"; {len(results['idle'])} steps each")
    stop.set()
    feeder.join()
    report_request_latency(log_dir)


def report_request_latency(log_dir: str) -> None:
    plotter = CurvePlotter(log_dir, say=print)
    plotter.request()
    time.sleep(0.2)  # a drawing is under way now
    latencies = []
    for _ in range(1000):
        begin = time.perf_counter()
        plotter.request()
        latencies.append(time.perf_counter() - begin)
    plotter.close()
    latencies.sort()
    print(f"request() while drawing: median {latencies[500] * 1e6:.1f} us, max {latencies[-1] * 1e6:.1f} us")
    draws = []
    for _ in range(3):
        begin = time.perf_counter()
        write_curves(log_dir)
        draws.append(time.perf_counter() - begin)
    print(f"one drawing (write_curves): median {statistics.median(draws):.2f} s of 3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log_dir", help="a run folder to draw (default: a synthetic 40-epoch run)")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        log_dir = args.log_dir or synthetic_run(work)
        measure(log_dir, args.blocks, args.steps)


def synthetic_run(folder: str) -> str:
    import json
    t0 = time.time()
    with open(os.path.join(folder, "log.json"), "w") as handle:
        for epoch in range(1, 41):
            handle.write(json.dumps({"time": t0 + epoch, "kind": "train", "epoch": epoch, "loss": 1 / epoch,
                                     "lr": 0.1, "throughput": 2.0}) + "\n")
            if epoch % 2 == 0:
                handle.write(json.dumps({"time": t0 + epoch, "kind": "eval", "epoch": epoch, "mean_dice": epoch / 50,
                                         "l1_dice": epoch / 45, "l2_dice": epoch / 55, "eval_loss": 0.5}) + "\n")
    return folder


if __name__ == "__main__":
    main()
