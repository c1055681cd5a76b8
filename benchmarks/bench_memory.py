"""Host memory reuse (runtime.inference.host_memory) on one window: wall time, CPU time in the kernel, page faults.

Each combination of model path (``reference``: fp32 NCDHW under ``no_grad``; ``fast``;
``int8``), memory setting (``system``: glibc's defaults; ``reuse``: ``reuse_freed_memory()``)
and thread (``main``, or a second ``thread``) runs in a process of its own: one warm-up
window, then ``--windows`` timed windows of ``--roi``³, one input channel, random weights. The
combinations alternate within each repeat; the table gives medians over repeats of the
per-window wall time, user and system CPU seconds, minor page faults (``getrusage``) and the
peak resident size.

Usage::

    python benchmarks/bench_memory.py --repeats 3 --out memory.md
    python benchmarks/bench_memory.py --smoke        # tiny, for tests
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PATHS = ("reference", "fast", "int8")
MEMORY = ("system", "reuse")
WHERE = ("main", "thread")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", default="reference,int8", help=f"comma list of {PATHS}")
    p.add_argument("--where", default="main,thread", help=f"comma list of {WHERE}")
    p.add_argument("--roi", type=int, default=128)
    p.add_argument("--filters", type=int, nargs="+", default=None, help="default: the model's")
    p.add_argument("--windows", type=int, default=2, help="timed windows per process")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and filters (tests)")
    p.add_argument("--out", default="", help="also write the markdown table here")
    p.add_argument("--child", nargs=3, metavar=("PATH", "MEMORY", "WHERE"), help=argparse.SUPPRESS)
    return p


def child(args) -> None:
    """One combination: print a JSON line of per-window means."""
    path, memory, where = args.child
    from runtime.inference.host_memory import reuse_freed_memory

    if memory == "reuse" and reuse_freed_memory() is not None:
        raise SystemExit(f"bench_memory: {reuse_freed_memory()}")
    import torch

    from model.unet3d import Unet3D
    from runtime.inference.predictor import PredictorOptions, build_predictor

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = (Unet3D(filters=args.filters) if args.filters else Unet3D()).eval()
    if path == "reference":
        def predict(x):
            with torch.no_grad():
                return model(x)
    else:
        predict = build_predictor(model, torch.device("cpu"), PredictorOptions(channels_last=True, int8=path == "int8"),
                                  inference_copy=True)
    x = torch.randn(1, 1, args.roi, args.roi, args.roi)
    result = {}

    def work():
        predict(x)
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(args.windows):
            predict(x)
        after, n = resource.getrusage(resource.RUSAGE_SELF), args.windows
        result.update(wall=(time.perf_counter() - start) / n, user=(after.ru_utime - before.ru_utime) / n,
                      sys=(after.ru_stime - before.ru_stime) / n, faults=(after.ru_minflt - before.ru_minflt) / n,
                      maxrss_gb=after.ru_maxrss / 2**20)

    if where == "thread":
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    else:
        work()
    print(json.dumps(result))


def run_child(args, combo: tuple[str, str, str]) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *combo, "--roi", str(args.roi),
           "--windows", str(args.windows), "--threads", str(args.threads)]
    if args.filters:
        cmd += ["--filters", *map(str, args.filters)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"bench_memory: {' '.join(combo)} failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.child:
        return child(args)
    if args.smoke:
        args.roi, args.filters, args.windows = 64, [2, 4, 8, 8, 8], 1
    combos = [(p, m, w) for p in args.paths.split(",") for w in args.where.split(",") for m in MEMORY]
    for p, _, w in combos:
        if p not in PATHS or w not in WHERE:
            raise SystemExit(f"bench_memory: choose --paths from {PATHS}, --where from {WHERE}")
    results = {c: [] for c in combos}
    for r in range(args.repeats):
        order = combos[r % len(combos):] + combos[:r % len(combos)]
        for combo in order:
            results[combo].append(run_child(args, combo))
        print(f"repeat {r}: " + ", ".join(f"{'/'.join(c)} {results[c][-1]['wall']:.2f} s" for c in combos),
              flush=True)
    rows = ["| path | thread | memory | wall s / window | speed-up vs system | user s | system s | "
            "page faults | peak RSS GB |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for combo in combos:
        med = {k: statistics.median(v[k] for v in results[combo]) for k in results[combo][0]}
        base = results[(combo[0], "system", combo[2])]
        ratio = statistics.median(b["wall"] / v["wall"] for b, v in zip(base, results[combo]))
        rows.append(f"| {combo[0]} | {combo[2]} | {combo[1]} | {med['wall']:.2f} | {ratio:.2f}x | "
                    f"{med['user']:.2f} | {med['sys']:.2f} | {med['faults']:.0f} | {med['maxrss_gb']:.2f} |")
    import torch

    from runtime.isa import isa_line

    header = (f"{isa_line()}, torch {torch.__version__}, Python {platform.python_version()} · one {args.roi}³ "
              f"window, filters {args.filters or 'default'}, {args.windows} timed windows per process "
              f"after one warm-up, {args.repeats} repeats (medians), load {os.getloadavg()[0]:.1f}")
    text = header + "\n\n" + "\n".join(rows)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return None


if __name__ == "__main__":
    main()
