"""The training step through the command users run, lock-step against the real MLCommons code.

Every variant is ``main.py --exec_mode train --benchmark --benchmark_steps N`` on the same
preprocessed data (the real data pipeline, ``--num_workers 0``), one process each, alternating
in every round (the order reversed every other round) so that a shared machine's load falls on
all alike; the ratio of each round is taken, then the median of the rounds. The ``mlcommons``
variant is the same command with the reference's own ``Unet3D``, ``DiceCELoss`` and
``get_optimizer`` (SGD, Nesterov) imported from ``--reference_code`` (the
``image_segmentation/pytorch`` folder of a mlcommons/training checkout; none of it is in this
repository) and its step as its ``runtime/training.py`` runs it on a CPU: float32, eager, NCDHW,
``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()`` (its ``--amp`` is CUDA
autocast: nothing on a CPU).

Beside each figure: the achieved GFLOP/s (forward + backward FLOPs of the default network,
``benchmarks/flops.py``) and its fraction of the convolution rate measured in the same run with
PyTorch's own kernels (a 3x3x3 convolution of 64 channels at 64³, forward + backward, in the
variant's type and layout). ``--isa AVX2`` runs a group under ``ONEDNN_MAX_CPU_ISA=AVX2`` (an
imitation of an AVX2-only CPU: oneDNN's AVX2 kernels, no bf16 dot products).

    .venv/bin/python benchmarks/bench_train_lockstep.py --reference_code REF --data_dir DATA \\
        --shapes 64x2 128x1 --isa native AVX2 --rounds 3 --steps 3 --warmup_steps 2

``DATA``: preprocessed training cases without evaluation cases (the benchmark then times no
evaluation pass), e.g. from ``python -m data_loading.synthetic --size medium`` and
``preprocess_dataset.py``, with ids outside ``evaluation_cases.txt``.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# name -> main.py flags beyond the common ones; "mlcommons" runs through run_mlcommons_child
VARIANTS = {
    "mlcommons": [],
    "fp32": [],
    "bf16": ["--amp", "--amp_dtype", "bf16"],
    "fast": ["--amp", "--channels_last"],
}
TIMED = re.compile(r"timed step \d+: ([0-9.]+) ms")
PRECISION = re.compile(r"^bf16: .*$", re.M)


def run_mlcommons_child(argv: list[str]) -> int:
    """The ``mlcommons`` variant's process (``argv``: the reference code's folder, then main.py's
    flags): training with the reference's network, loss, optimizer and step."""
    import torch

    import runtime.app as app
    import runtime.build as build
    from benchmarks.mlcommons import load_reference_training
    from runtime.arguments import parse_args

    code_dir, flags = argv[0], argv[1:]
    unet3d, dice_ce_loss, get_optimizer = load_reference_training(code_dir)

    def build_model(config, device, distributed=False):
        return unet3d(1, 3, config.normalization, config.activation).to(device)

    def make_optimizer(name, params, lr, momentum=0.9, weight_decay=0.0, betas=(0.9, 0.999), fused=False):
        return get_optimizer(params, SimpleNamespace(optimizer=name, learning_rate=lr, momentum=momentum,
                                                     weight_decay=weight_decay, lamb_betas=betas))

    def reference_step(model, loss_fn, optimizer, scaler, autocast, ga_steps):
        def step(image, label, last_micro_batch=True):  # runtime/training.py, amp off, ga_steps 1
            output = model(image)
            loss_value = loss_fn(output, label)
            loss_value.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss_value.detach()
        return step

    build.build_model = build_model
    build.make_optimizer = make_optimizer
    build.DiceCELoss = lambda **kwargs: dice_ce_loss(to_onehot_y=True, use_softmax=True, layout="NCDHW",
                                                     include_background=False)
    build.eager_train_step = reference_step
    build.fuse_channels_last_norms = lambda *args, **kwargs: 0
    build.guard_bf16_training = lambda *args, **kwargs: None
    torch.backends.mkldnn.enabled = True
    return app.run(parse_args(flags))


def in_process(args, side: int, batch: int) -> None:
    """One process, the two steps alternating step by step on one batch (the same weights to
    start with): the reference's (its network, loss, optimizer; float32 eager NCDHW) and the
    project's with ``--amp --channels_last`` as ``runtime.build`` builds it (precision by the
    CPU's feature, fused norms, the bf16 guard). Each pair's ratio, then the median: robust to a
    shared machine's load changing between processes."""
    import dataclasses

    import torch

    from benchmarks.mlcommons import load_reference_training
    from model.losses import DiceCELoss
    from runtime import build
    from runtime.arguments import Config
    from runtime.optimizers import make_optimizer

    unet3d, dice_ce_loss, get_optimizer = load_reference_training(args.reference_code)
    cpu = torch.device("cpu")
    cfg = dataclasses.replace(Config(loader="synthetic"), exec_mode="train", amp=True, amp_dtype="bf16",
                              channels_last=True, input_shape=(side,) * 3, batch_size=batch)
    torch.manual_seed(0)
    cfg = build.cpu_training_precision(cfg, cpu, say=True)
    ours = build.build_model(cfg, cpu)
    build.fuse_channels_last_norms(ours, cfg, cpu, say=True)
    build.guard_bf16_training(ours, cfg, cpu, say=True)
    autocast, scaler = build.autocast_factory(cfg, cpu)
    optimizer = make_optimizer("sgd", ours.parameters(), 1e-4, 0.9)
    fast = build.eager_train_step(ours, DiceCELoss(), optimizer, scaler, autocast, 1)
    theirs = unet3d(1, 3, "instancenorm", "relu")
    theirs.load_state_dict({k: v.contiguous() for k, v in ours.state_dict().items()})
    flags = SimpleNamespace(optimizer="sgd", learning_rate=1e-4, momentum=0.9, weight_decay=0.0)
    ref_optimizer = get_optimizer(theirs.parameters(), flags)
    ref_loss = dice_ce_loss(to_onehot_y=True, use_softmax=True, layout="NCDHW", include_background=False)

    def reference(image, label):
        loss = ref_loss(theirs(image), label)
        loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        return loss.detach()

    g = torch.Generator().manual_seed(1)
    image = torch.randn(batch, 1, side, side, side, generator=g)
    label = torch.randint(0, 3, (batch, 1, side, side, side), generator=g, dtype=torch.uint8)
    image_cl = image.contiguous(memory_format=torch.channels_last_3d) if cfg.channels_last else image
    steps = {"mlcommons": lambda: reference(image, label), "fast": lambda: fast(image_cl, label)}
    for name, step in steps.items():
        for _ in range(args.warmup_steps):
            tick = time.perf_counter()
            step()
            print(f"  warm-up {name}: {time.perf_counter() - tick:.2f} s", flush=True)
    times = {name: [] for name in steps}
    loads = []
    for r in range(args.steps):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            loads.append(os.getloadavg()[0])
            tick = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - tick)
        print(f"  pair {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items())
              + f" (load {loads[-1]:.2f})", flush=True)
    ratios = [a / b for a, b in zip(times["mlcommons"], times["fast"])]
    print(f"in-process {side}x{batch}: mlcommons median {statistics.median(times['mlcommons']):.2f} s, fast median "
          f"{statistics.median(times['fast']):.2f} s, ratio median {statistics.median(ratios):.2f}x "
          f"(pairs {', '.join(f'{r:.2f}' for r in ratios)}), load {min(loads):.2f}-{max(loads):.2f}")
    return times, "bfloat16_cl" if cfg.amp else "float32_cl"


def conv_rates(env: dict) -> dict[str, float]:
    """GFLOP/s of a 3x3x3 convolution of 64 channels at 64³ (batch 1), forward + backward, in
    fp32 and bf16 (bf16 only without an ISA cap: capped, training runs float32 and oneDNN's
    emulated bf16 takes minutes), NCDHW and channels-last, measured in a child process under ``env``."""
    types = ("float32",) if env.get("ONEDNN_MAX_CPU_ISA") else ("float32", "bfloat16")
    code = r"""
import json, torch, torch.nn.functional as F
from torch.utils import benchmark as B
out = {}
for dt in TYPES:
    for cl in (False, True):
        mf = torch.channels_last_3d if cl else torch.contiguous_format
        x = torch.randn(1, 64, 64, 64, 64, dtype=getattr(torch, dt)).contiguous(memory_format=mf).requires_grad_()
        w = torch.randn(64, 64, 3, 3, 3, dtype=x.dtype).contiguous(memory_format=mf).requires_grad_()
        g = torch.randn_like(F.conv3d(x, w, padding=1))
        f = lambda: torch.autograd.grad(F.conv3d(x, w, padding=1), (x, w), g)
        f()
        t = B.Timer(stmt="f()", globals={"f": f}).timeit(3).median
        out[dt + ("_cl" if cl else "")] = 3 * 2 * 64 * 64 * 27 * 64 ** 3 / t / 1e9
print(json.dumps(out))
"""
    import json

    code = code.replace("TYPES", repr(types))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"conv rate measurement failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def command(variant: str, args, shape: int, batch: int, log_dir: str) -> list[str]:
    flags = ["--exec_mode", "train", "--benchmark", "--benchmark_steps", str(args.steps),
             "--warmup_steps", str(args.warmup_steps), "--data_dir", args.data_dir, "--log_dir", log_dir,
             "--input_shape", str(shape), str(shape), str(shape), "--batch_size", str(batch),
             "--num_workers", "0", "--seed", "1", *VARIANTS[variant]]
    if variant == "mlcommons":
        return [sys.executable, str(Path(__file__).resolve()), "--child_mlcommons", args.reference_code, *flags]
    return [sys.executable, str(ROOT / "main.py"), *flags]


def run_variant(variant: str, args, shape: int, batch: int, env: dict, work: Path, tag: str) -> tuple[float, str]:
    """``(median seconds of the timed steps, the precision line)`` of one process."""
    log = work / f"{tag}-{variant}.log"
    with open(log, "w") as handle:
        done = subprocess.run(command(variant, args, shape, batch, str(work / f"logs-{tag}-{variant}")),
                              env=env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)
    text = log.read_text()
    steps = [float(ms) / 1e3 for ms in TIMED.findall(text)]
    if done.returncode or not steps:
        raise SystemExit(f"{variant} failed (exit {done.returncode}); see {log}")
    precision = PRECISION.search(text)
    return statistics.median(steps), precision.group(0) if precision else ""


def layout_key(variant: str, precision_line: str) -> str:
    bf16 = variant in ("bf16", "fast") and "training in bf16" in precision_line
    return ("bfloat16" if bf16 else "float32") + ("_cl" if variant == "fast" else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference_code", default=os.environ.get("UNET3D_REFERENCE_CODE", ""))
    p.add_argument("--data_dir")
    p.add_argument("--shapes", nargs="+", default=["64x2", "128x1"], help="SIDExBATCH")
    p.add_argument("--isa", nargs="+", default=["native"], help="native and/or a ONEDNN_MAX_CPU_ISA value")
    p.add_argument("--variants", default="mlcommons,fast")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup_steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=0,
                   help="OMP_NUM_THREADS of every process (0: torch's default, one per core). On a machine "
                        "shared with other jobs one thread avoids OpenMP threads waiting for a descheduled sibling")
    p.add_argument("--work", default="/tmp/bench_train_lockstep")
    p.add_argument("--in_process", action="store_true",
                   help="time the reference's step and the fast step alternating in one process on one "
                        "synthetic batch (--steps pairs after --warmup_steps each) instead of main.py processes")
    p.add_argument("--child_mlcommons", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_mlcommons:
        return run_mlcommons_child(args.child_mlcommons)
    from runtime.isa import isa_line
    from benchmarks.flops import flop_count_per_sample
    from benchmarks.mlcommons import check_reference_code

    import torch

    from model.unet3d import Unet3D

    variants = args.variants.split(",")
    if "mlcommons" in variants:
        if not args.reference_code:
            raise SystemExit("the mlcommons variant needs --reference_code (or UNET3D_REFERENCE_CODE)")
        check_reference_code(args.reference_code)
    if not args.data_dir and not args.in_process:
        raise SystemExit("--data_dir: a folder of preprocessed training cases is needed")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = Unet3D()
    print(f"# bench_train_lockstep · {time.strftime('%Y-%m-%d %H:%M')} · torch {torch.__version__}")
    print(f"command: {' '.join(sys.argv)}")
    for isa in args.isa:
        env = dict(os.environ)
        env.pop("ONEDNN_MAX_CPU_ISA", None)
        if isa != "native":
            env["ONEDNN_MAX_CPU_ISA"] = isa
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        os.environ.pop("ONEDNN_MAX_CPU_ISA", None)
        if isa != "native":
            os.environ["ONEDNN_MAX_CPU_ISA"] = isa
        print(f"\n## {isa_line()} · threads {args.threads or 'default'}")
        rates = conv_rates(env)
        print("convolution rate (3x3x3, 64 ch, 64³, fwd+bwd), GFLOP/s: "
              + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()) + f" · load {os.getloadavg()[0]:.2f}")
        for spec in args.shapes:
            side, batch = (int(v) for v in spec.split("x"))
            flops = flop_count_per_sample(model, (side,) * 3)[1] * batch
            if args.in_process:
                if args.threads:
                    torch.set_num_threads(args.threads)
                times, fast_key = in_process(args, side, batch)
                for name, key in (("mlcommons", "float32"), ("fast", fast_key)):
                    med = statistics.median(times[name])
                    print(f"  {name}: {flops / med / 1e9:.0f} GFLOP/s, {flops / med / 1e9 / rates[key]:.0%} of "
                          f"the {key} convolution rate {rates[key]:.0f}")
                continue
            times = {v: [] for v in variants}
            lines = {}
            loads = []
            for r in range(args.rounds):
                order = variants if r % 2 == 0 else variants[::-1]
                for v in order:
                    loads.append(os.getloadavg()[0])
                    seconds, lines[v] = run_variant(v, args, side, batch, env, work, f"{isa}-{spec}-{r}")
                    times[v].append(seconds)
                    print(f"  round {r} {spec} {v}: {seconds:.2f} s/step (load {loads[-1]:.2f})", flush=True)
            base = variants[0]
            print(f"\n| {spec}, {isa} | s/step (median) | vs {base} (median of rounds) | GFLOP/s | "
                  "of the conv rate | precision |")
            print("|---|---:|---:|---:|---:|---|")
            for v in variants:
                ratio = statistics.median(b / t for b, t in zip(times[base], times[v]))
                med = statistics.median(times[v])
                key = "float32" if v in ("mlcommons", "fp32") else layout_key(v, lines.get(v, ""))
                gflops = flops / med / 1e9
                print(f"| {v} | {med:.2f} | {ratio:.2f}x | {gflops:.0f} | {gflops / rates[key]:.0%} of {key} "
                      f"{rates[key]:.0f} | {lines.get(v, '') or 'float32'} |")
            print(f"load average during the group: {min(loads):.2f}-{max(loads):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
