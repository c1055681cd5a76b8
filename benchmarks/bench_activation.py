"""In-place vs plain activation after instance norm: the cause of a slower training step.

``nn.InstanceNorm3d`` returns a view of its internal batch-norm output; an in-place ReLU on that
view makes autograd record the write as ``CopySlices`` / ``AsStridedBackward`` nodes, whose
backward clones the full-size gradient. Measured side by side in one run on the same weights
and batch: the number of such copy nodes in the backward graph, the median time of a training
step (forward + backward), and that the loss and every gradient are bit-identical.

Usage: ``python benchmarks/bench_activation.py [--shape 64] [--batch 1] [--reps 5]``
(``--filters`` to shrink the model; the default is the benchmark's model).
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.losses import DiceCELoss  # noqa: E402
from model.unet3d import DEFAULT_FILTERS, N_CLASSES, Unet3D  # noqa: E402

COPY_NODES = ("CopySlices", "AsStridedBackward0", "CloneBackward0")


def set_inplace(model: torch.nn.Module, inplace: bool) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, (torch.nn.ReLU, torch.nn.LeakyReLU)):
            module.inplace = inplace
    return model


def backward_nodes(root) -> dict[str, int]:
    """Node type -> count in the autograd graph reachable from ``root`` (a ``grad_fn``)."""
    counts, seen, stack = {}, set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        counts[name] = counts.get(name, 0) + 1
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return counts


def copy_node_count(model: torch.nn.Module, image: torch.Tensor, label: torch.Tensor) -> int:
    loss = DiceCELoss()(model(image), label)
    counts = backward_nodes(loss.grad_fn)
    return sum(counts.get(name, 0) for name in COPY_NODES)


def step(model: torch.nn.Module, image: torch.Tensor, label: torch.Tensor):
    """Forward + backward; returns (seconds, loss, gradients)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = DiceCELoss()(model(image), label)
    loss.backward()
    seconds = time.perf_counter() - start
    return seconds, loss.detach(), [p.grad for p in model.parameters()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--filters", type=int, nargs=5, default=list(DEFAULT_FILTERS))
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = Unet3D(filters=tuple(args.filters))
    image = torch.randn(args.batch, 1, *[args.shape] * 3)
    label = torch.randint(0, N_CLASSES, (args.batch, 1, *[args.shape] * 3), dtype=torch.uint8)
    nodes = {flag: copy_node_count(set_inplace(model, flag), image, label) for flag in (True, False)}
    times = {True: [], False: []}
    identical = True
    for _ in range(args.reps):  # interleaved: both variants see the same machine load
        results = {}
        for flag in (True, False):
            seconds, loss, grads = step(set_inplace(model, flag), image, label)
            times[flag].append(seconds)
            results[flag] = (loss, grads)
        identical &= torch.equal(results[True][0], results[False][0]) and all(
            torch.equal(a, b) for a, b in zip(results[True][1], results[False][1]))
    median = {flag: statistics.median(values) for flag, values in times.items()}
    print(f"# bench_activation {datetime.date.today()} | {platform.processor() or platform.machine()} | "
          f"torch {torch.__version__} | {torch.get_num_threads()} threads | filters {args.filters} | "
          f"batch {args.batch} x {args.shape}^3 | {args.reps} interleaved reps")
    print("| activation | copy nodes in backward | median fwd+bwd s |")
    print("|---|---:|---:|")
    for flag, name in ((True, "ReLU(inplace=True) (before)"), (False, "ReLU() (now)")):
        print(f"| {name} | {nodes[flag]} | {median[flag]:.3f} |")
    print(f"speed-up plain / in-place: {median[True] / median[False]:.3f}x; loss and all gradients "
          f"bit-identical: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
