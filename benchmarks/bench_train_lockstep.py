"""The CPU training step through the command users run, lock-step against the real MLCommons code.

``main.py --exec_mode train --benchmark`` per variant and round on ``--data_dir``'s training cases: ``fp32``,
``bf16``, ``fast`` (``--amp --channels_last --fused_optimizer``) against ``mlcommons``, the reference's network,
loss, optimizer and step (``--reference_code``) on the project's step timer and loader. Beside each: GFLOP/s, its
share of the convolution rate measured in the run, and the convolution floor (the network's convolutions timed
alone in the variant's type and layout: the most a step on these kernels can gain), with the floor if every layer
ran at the best one's rate (``--per_layer``: layer by layer). ``--isa AVX2``: under ``ONEDNN_MAX_CPU_ISA``."""
from __future__ import annotations

import argparse
import collections
import copy
import functools
import json
import os
import re
import statistics
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from benchmarks.harness import (ROOT, checked_variants, flop_count_per_sample, header, lockstep, loads,
                                parse_with_reference, ratios, table, timed)
from model.unet3d import Unet3D
from runtime.levers.cpu.blocks import FastConvBlock, FastUpsampleBlock, conv_of_concatenation, transposed_conv_as_gemm
from runtime.levers.cpu.convert import SPLIT_CONCATENATION, WIDEST_NCDHW, apply_levers
from runtime.levers.cpu.host_memory import reuse_freed_memory

VARIANTS = {"mlcommons": [], "fp32": [], "bf16": ["--amp", "--amp_dtype", "bf16"], "fast": ["--amp", "--channels_last", "--fused_optimizer"]}
TIMED = re.compile(r"timed step \d+: ([0-9.]+) ms")
PRECISION = re.compile(r"^bf16: .*$", re.M)


def run_mlcommons_child(code_dir: str, flags: list[str]) -> int:
    """The ``mlcommons`` process: the reference's network, loss, optimizer (SGD, Nesterov, lr 1e-4) and step as its
    runtime/training.py runs them on a CPU (amp off, ga_steps 1), on the project's step timer and loader."""
    from data_loading.data_loader import data_source
    from runtime.arguments import parse_args
    from runtime.build import Components, loader_settings
    from runtime.distributed import DistInfo
    from oracles.mlcommons_reference import load_reference_training
    from runtime.resolve import resolve
    from runtime.training.benchmark import Budget, time_training

    cpu = torch.device("cpu")
    dist = DistInfo(rank=0, local_rank=0, world_size=1, device=cpu)
    config = parse_args(flags)
    data = data_source(config)
    plan = resolve(config, dist, data)
    torch.manual_seed(plan.seed)
    unet3d, dice_ce_loss, get_optimizer = load_reference_training(code_dir)
    model = unet3d(1, 3, "instancenorm", "relu")
    optimizer = get_optimizer(model.parameters(), SimpleNamespace(optimizer="sgd", learning_rate=1e-4, momentum=0.9,
                                                                  weight_decay=0.0, lamb_betas=(0.9, 0.999)))
    loss_fn = dice_ce_loss(to_onehot_y=True, use_softmax=True, layout="NCDHW", include_background=False)

    def step(image, label, last_micro_batch=True):
        loss = loss_fn(model(image), label)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    train_loader, val_loader = data.loaders(loader_settings(plan), 1, 0, cpu)
    parts = Components(plan=plan, dist=dist, model=model, optimizer=optimizer, scaler=None, loss_fn=loss_fn,
                       score_fn=None, autocast=nullcontext, step=step,
                       train_loader=train_loader, val_loader=val_loader, eval_model=model)
    time_training(parts, SimpleNamespace(say=print), Budget.of(plan))
    return 0


def conv_rate(side: int, dtypes: list[str]) -> dict[str, float]:
    """GFLOP/s of a 64-channel 3³ convolution on ``side``³ (forward and both gradients) per type of ``dtypes``
    (``float32``, ``bfloat16``), NCDHW and channels-last (``<type>_cl``)."""
    out = {}
    for dt in dtypes:
        for cl in (False, True):
            mf = torch.channels_last_3d if cl else torch.contiguous_format
            x = torch.randn(1, 64, side, side, side, dtype=getattr(torch, dt)).contiguous(memory_format=mf)
            x.requires_grad_()
            w = torch.randn(64, 64, 3, 3, 3, dtype=x.dtype).contiguous(memory_format=mf).requires_grad_()
            g = torch.randn_like(F.conv3d(x, w, padding=1))
            f = lambda: torch.autograd.grad(F.conv3d(x, w, padding=1), (x, w), g)  # noqa: E731
            f()
            out[dt + ("_cl" if cl else "")] = 3 * 2 * 64 * 64 * 27 * side ** 3 / timed(f, 3) / 1e9
    return out


def step_convolutions(side: int, batch: int) -> list[tuple]:
    """The network's convolutions in a ``batch`` x ``side``³ training step, shapes only: (layer, name, input shape,
    calls per step, GFLOP per call (multiply-adds x 2, x 3 with the input's gradient), in NCDHW in float32, after a
    concatenation: one convolution per part in float32), as channels-last CPU training runs them (``convert``)."""
    layers = collections.Counter()
    with torch.device("meta"):
        model = Unet3D()
    hooks = [m.register_forward_hook(lambda m, i, o: layers.update([(m, tuple(i[0].shape))]))
             for m in model.modules() if isinstance(m, (torch.nn.Conv3d, torch.nn.ConvTranspose3d))]
    model(torch.empty(batch, 1, side, side, side, device="meta"))
    for hook in hooks:
        hook.remove()
    assert sum(layers.values()) == len(hooks), "every convolution once per step"
    names = {m: name for name, m in model.named_modules()}
    apply_levers(model, (SPLIT_CONCATENATION, WIDEST_NCDHW), compile=False)
    in_ncdhw = {block[0] for block in model.modules() if isinstance(block, FastConvBlock) and block.ncdhw}
    after_concatenation = {block.conv1[0] for block in model.modules()
                           if isinstance(block, FastUpsampleBlock) and block.split_concatenation} - in_ncdhw
    found = []
    for (m, shape), count in layers.items():
        x = torch.empty(shape, device="meta")
        per = x if isinstance(m, torch.nn.ConvTranspose3d) else m(x)   # a kernel per input / output voxel
        macs = m.in_channels * m.out_channels * m.weight[0, 0].numel() * (per.numel() // per.shape[1]) // m.groups
        found.append((m, names[m], shape, count, 2 * macs * (3 if shape[1] > 1 else 2) / 1e9, m in in_ncdhw,
                      m in after_concatenation))
    return found


def conv_floor(side: int, batch: int, keys: list[str]) -> dict[str, dict]:
    """Per key (``float32``, ``bfloat16``, ``_cl``: channels-last): ``seconds`` per step of :func:`step_convolutions`
    alone, forward and backward, and ``layers``: [name, input shape, calls per step, s per call, GFLOP per call]."""
    convolutions, out = step_convolutions(side, batch), {}
    for key in keys:
        rows = [[name, list(shape), count, _seconds(m, shape, key, ncdhw, after), gflop]
                for m, name, shape, count, gflop, ncdhw, after in convolutions]
        out[key] = {"seconds": sum(count * seconds for _, _, count, seconds, _ in rows), "layers": rows}
    return out


def _seconds(m: torch.nn.Module, shape: tuple, key: str, ncdhw: bool, after_concatenation: bool) -> float:
    """Seconds per forward and backward of a CPU copy of layer ``m`` on a random input of ``shape``, in ``key``'s
    type and layout, as CPU training computes it: channels-last transposed convolutions as one GEMM each."""
    dtype = getattr(torch, key.split("_")[0])
    mf = torch.channels_last_3d if key.endswith("_cl") else torch.contiguous_format
    layer_mf = torch.contiguous_format if (ncdhw and key == "float32_cl") else mf
    layer = copy.deepcopy(m).to_empty(device="cpu")
    for t in layer.parameters():
        torch.nn.init.normal_(t, std=0.05)
    layer = layer.to(dtype=dtype, memory_format=layer_mf)
    x = torch.randn(shape, dtype=dtype).contiguous(memory_format=layer_mf).requires_grad_(shape[1] > 1)
    wanted = ([x] if x.requires_grad else []) + list(layer.parameters())
    if isinstance(layer, torch.nn.ConvTranspose3d) and key.endswith("_cl"):
        run = lambda: transposed_conv_as_gemm(x, layer.weight, layer.bias)  # noqa: E731
    elif after_concatenation and key == "float32_cl":
        parts = [p.detach().contiguous(memory_format=mf).requires_grad_() for p in x.chunk(2, dim=1)]
        wanted = parts + list(layer.parameters())
        run = lambda: conv_of_concatenation(layer, tuple(parts))  # noqa: E731
    else:
        run = lambda: layer(x)  # noqa: E731
    g = torch.randn_like(run())
    f = lambda: torch.autograd.grad(run(), wanted, g)  # noqa: E731
    f()
    return timed(f, 2)


def run_conv_child(what: str, side: str, *rest: str) -> int:
    """``--child_conv rate SIDE DTYPE...``, ``floor SIDE BATCH KEY...`` or ``layers SIDE BATCH``: its JSON."""
    reuse_freed_memory()  # the kernels' rate, not the page faults of fresh outputs
    side, rest = int(side), list(rest)
    print(json.dumps({"rate": lambda: conv_rate(side, rest), "floor": lambda: conv_floor(side, int(rest[0]), rest[1:]),
                      "layers": lambda: [row[1:] for row in step_convolutions(side, int(rest[0]))]}[what]()))
    return 0


def child_json(args: list, env: dict, what: str):
    """The JSON that this module's ``--child_conv ARGS`` prints last, in a fresh process under ``env``."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_train_lockstep", "--child_conv", *map(str, args)],
                          env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{what} measurement failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def command(args, side: int, batch: int, variant: str, r) -> list[str]:
    """``main.py --benchmark`` for ``variant``; ``mlcommons``: this module's child with the reference."""
    flags = ["--exec_mode", "train", "--benchmark", "--benchmark_steps", str(args.steps), "--warmup_steps",
             str(args.warmup_steps), "--data_dir", args.data_dir, "--input_shape", *[str(side)] * 3, "--batch_size",
             str(batch), "--num_workers", "0", "--seed", "1", *VARIANTS[variant]]
    if variant == "mlcommons":
        return [sys.executable, "-m", "benchmarks.bench_train_lockstep", "--child_mlcommons", args.reference_code, *flags]
    return [sys.executable, "main.py", *flags]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir")
    p.add_argument("--shapes", nargs="+", default=["64x2", "128x1"], help="SIDExBATCH")
    p.add_argument("--isa", nargs="+", default=["native"], help="native and/or a ONEDNN_MAX_CPU_ISA value")
    p.add_argument("--variants", default="mlcommons,fast", help=f"comma list of {list(VARIANTS)}; the first is the baseline")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup_steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of every process (0: torch's default)")
    p.add_argument("--work", default="/tmp/bench_train_lockstep")
    p.add_argument("--conv_side", type=int, default=64, help="the convolution rate's volume side (64: 64³)")
    p.add_argument("--per_layer", action="store_true",
                   help="print the convolution floor layer by layer: seconds, GFLOP/s, share of the best layer's rate")
    p.add_argument("--child_conv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)   # run_conv_child's
    args = parse_with_reference(p, argv, run_mlcommons_child)
    if args.child_conv:
        return run_conv_child(*args.child_conv)
    variants, args.reference_code = checked_variants("bench_train_lockstep", args.variants, VARIANTS,
                                                     args.reference_code)
    if not args.data_dir:
        raise SystemExit("--data_dir: a folder of preprocessed training cases is needed")
    with torch.device("meta"):
        model = Unet3D()
    print(header("bench_train_lockstep", argv))
    for isa in args.isa:
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
        env.update({"ONEDNN_MAX_CPU_ISA": isa} if isa != "native" else {})
        env.update({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})
        # capped, training runs float32 (and oneDNN's emulated bf16 takes minutes)
        rates = child_json(["rate", args.conv_side, "float32"] + (["bfloat16"] if isa == "native" else []), env,
                           "conv rate")
        print(f"\n## {isa}, threads {args.threads or 'default'}: convolution rate (GFLOP/s) "
              + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()))
        for spec in args.shapes:
            side, batch = (int(v) for v in spec.split("x"))
            flops = flop_count_per_sample(model, (side,) * 3)[1] * batch
            runs = lockstep(variants, functools.partial(command, args, side, batch), args.rounds,
                            Path(args.work) / f"{isa}-{spec}", env=env,
                            measure=lambda v, r, text: statistics.median(float(t) / 1e3 for t in TIMED.findall(text))
                            if TIMED.search(text) else None)
            times = {v: [run.value for run in rs] for v, rs in runs.items()}
            lines = {v: (PRECISION.search(rs[0].text) or [""])[0] for v, rs in runs.items()}
            keys = {v: ("bfloat16" if v in ("bf16", "fast") and "training in bf16" in lines[v] else "float32")
                    + ("_cl" if v == "fast" else "") for v in variants}
            base = variants[0]
            print(loads(runs))
            speed = ratios(times, base)
            floors = child_json(["floor", side, batch, *sorted(set(keys.values()))], env, "conv floor")
            rows, floor_lines = [], []
            for key, floor in floors.items():
                gflop = sum(count * work for _, _, count, _, work in floor["layers"])
                best = max(work / seconds for _, _, _, seconds, work in floor["layers"])
                floor_lines.append(
                    f"convolution floor {key}: {floor['seconds']:.2f} s, {gflop / floor['seconds']:.0f} GFLOP/s; "
                    f"its layers {min(w / t for *_, t, w in floor['layers']):.0f}-{best:.0f} GFLOP/s; every layer at "
                    f"the best one's rate: {gflop / best:.2f} s ({base}'s step / that: "
                    f"{statistics.median(times[base]) / (gflop / best):.2f}x)")
                if args.per_layer:
                    floor_lines.append(table(["layer", "input", "per step", "GFLOP", "ms (forward + backward)", "GFLOP/s",
                                              "of the best layer's"],
                                             [[name, "x".join(map(str, shape)), count, f"{work:.4f}", seconds * 1e3,
                                               f"{work / seconds:.0f}", f"{work / seconds / best:.0%}"]
                                              for name, shape, count, seconds, work in floor["layers"]]))
            floors = {key: floor["seconds"] for key, floor in floors.items()}
            for v, t in times.items():
                step = statistics.median(t)
                gflops = flops / step / 1e9
                rows.append([v, step, f"{speed[v]:.2f}x", f"{gflops:.0f}",
                             f"{gflops / rates[keys[v]]:.0%} of {keys[v]} {rates[keys[v]]:.0f}",
                             f"{floors[keys[v]]:.2f} ({floors[keys[v]] / step:.0%})",
                             f"{statistics.median(times[base]) / floors[keys[v]]:.2f}x", lines[v] or keys[v]])
            print(f"\n{spec}, {isa}\n" + table(
                ["variant", "s/step (median)", f"vs {base} (median of rounds)", "GFLOP/s", "of the conv rate",
                 "conv floor s/step (of the step)", f"{base}'s step / floor", "precision"], rows) + "\n\n"
                  + "\n".join(floor_lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
