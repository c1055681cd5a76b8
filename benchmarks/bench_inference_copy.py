"""Two choices of the inference copy, each against its baseline in one process, lock-step rounds.

* ``norm``: the channels-last instance norm's statistics, PyTorch's channels-last batch norm
  (batch statistics of one sample: the way before) against ``channels_last_moments`` (now):
  time of a float window and the logits' largest difference from the plain model
  (``nn.InstanceNorm3d``, NCDHW).
* ``equalize``: ``--int8`` with one activation grid per convolution input (before) against the
  per-window channel equalization (now): time of an int8 window and the logits' relative RMS
  difference from the float model.
* ``overheads``: the first convolution (one input channel) by PyTorch's own choice, im2col with
  an NCDHW output, and int8 codes copied out by ``int_repr`` (before) against
  ``ChannelsLastConv3d`` and the codes shared with the quantized tensor (now), float and int8:
  time of a window and the logits' difference from the plain model (float: max abs; int8:
  relative RMS, as ``equalize``).

Random weights unless ``--ckpt`` (a checkpoint; ``--filters`` must then match it). Every round
runs each variant once on a new random window (the equalization factors change per window), so a
load change on a shared machine falls on both alike; medians over the rounds after the first.

Usage: ``python benchmarks/bench_inference_copy.py [--compare norm equalize overheads] [--rounds 7]
[--edge 128] [--filters 32 64 128 256 320] [--ckpt CKPT]``. Prints the CPU's ISA.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runtime.isa import isa_line  # noqa: E402
from model import inference_copy as ic  # noqa: E402
from model.unet3d import DEFAULT_FILTERS, Unet3D  # noqa: E402
from runtime.inference.host_memory import reuse_freed_memory  # noqa: E402

CL = torch.channels_last_3d


class BatchNormStatistics(ic.LayoutPreservingInstanceNorm3d):
    """The way before: a channels-last input's statistics from PyTorch's batch norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.batch_norm(x[i:i + 1], None, None, self.weight, self.bias, True, 0.0, self.eps)
                          for i in range(x.shape[0])])


def with_batch_norm_statistics(prepared: torch.nn.Module) -> torch.nn.Module:
    for module in list(prepared.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, ic.LayoutPreservingInstanceNorm3d):
                old = BatchNormStatistics.__new__(BatchNormStatistics)
                old.__dict__.update(child.__dict__)
                setattr(module, name, old)
    return prepared


class Before(torch.nn.Module):
    """A prepared copy run the way before ``overheads``: its ``ChannelsLastConv3d`` back to
    ``nn.Conv3d``, and int8 codes copied by ``int_repr`` while it runs."""

    def __init__(self, prepared: torch.nn.Module):
        super().__init__()
        for module in list(prepared.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, ic.ChannelsLastConv3d):
                    plain = torch.nn.Conv3d.__new__(torch.nn.Conv3d)
                    plain.__dict__.update(child.__dict__)
                    setattr(module, name, plain)
        self.prepared = prepared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = ic.uint8_codes
        ic.uint8_codes = lambda q: q.int_repr()
        try:
            return self.prepared(x)
        finally:
            ic.uint8_codes = shared


def lock_step(variants: dict, reference: torch.nn.Module, rounds: int, edge: int, error) -> None:
    times = {name: [] for name in variants}
    errors = {name: [] for name in variants}
    with torch.inference_mode():
        for r in range(rounds):
            x = torch.randn(1, 1, edge, edge, edge)
            expected = reference(x)
            for name, net in variants.items():
                start = time.perf_counter()
                out = net(x.contiguous(memory_format=CL))
                seconds = time.perf_counter() - start
                if r:  # the first round warms up (weight packing, allocator)
                    times[name].append(seconds)
                errors[name].append(error(out, expected))
    base = statistics.median(times[next(iter(variants))])
    for name in variants:
        median = statistics.median(times[name])
        print(f"| {name} | {median:.3f} | {median / base:.3f}x | {max(errors[name]):.2e} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", nargs="+", default=["norm", "equalize"], choices=["norm", "equalize", "overheads"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--edge", type=int, default=128)
    parser.add_argument("--filters", type=int, nargs="+", default=list(DEFAULT_FILTERS))
    parser.add_argument("--ckpt", default=None)
    args = parser.parse_args()
    reuse_freed_memory()
    torch.manual_seed(0)
    model = Unet3D(filters=args.filters).eval()
    if args.ckpt:
        from runtime.checkpoint import load_checkpoint, model_state_from
        model.load_state_dict(model_state_from(load_checkpoint(args.ckpt)))
    print(f"# {isa_line()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"# filters {args.filters}, one {args.edge}³ window per variant per round, {args.rounds} rounds")
    if "norm" in args.compare:
        print("\n| float, channels-last norm statistics | median s | vs before "
              "| max abs logit diff from nn.InstanceNorm3d |")
        print("|---|---|---|---|")
        lock_step({"batch norm (before)": with_batch_norm_statistics(ic.prepare_for_inference(model)),
                   "channels_last_moments (now)": ic.prepare_for_inference(model)},
                  model, args.rounds, args.edge, lambda out, ref: float((out - ref).abs().max()))
    if "overheads" in args.compare:
        print("\n| float, first convolution | median s | vs before | max abs logit diff from the plain model |")
        print("|---|---|---|---|")
        lock_step({"im2col first convolution (before)": Before(ic.prepare_for_inference(model)),
                   "ChannelsLastConv3d (now)": ic.prepare_for_inference(model)},
                  model, args.rounds, args.edge, lambda out, ref: float((out - ref).abs().max()))
    int8_compares = [c for c in args.compare if c in ("equalize", "overheads")]
    if int8_compares and ic.int8_available() is not None:
        print(f"\n{', '.join(int8_compares)} (int8): skipped: {ic.int8_available()}")
        return
    if int8_compares:
        print(f"\n{ic.int8_path()}")
    if "overheads" in args.compare:
        print("\n| int8, first convolution and codes | median s | vs before | relative RMS logit diff from float (worst round) |")
        print("|---|---|---|---|")
        lock_step({"im2col first convolution, int_repr (before)": Before(ic.prepare_for_inference(model, int8=True)),
                   "ChannelsLastConv3d, shared codes (now)": ic.prepare_for_inference(model, int8=True)},
                  model, args.rounds, args.edge, relative_rms)
    if "equalize" in args.compare:
        print("\n| int8 | median s | vs before | relative RMS logit diff from float (worst round) |")
        print("|---|---|---|---|")
        lock_step({"one grid (before)": ic.prepare_for_inference(model, int8=True, equalize=False),
                   "equalized (now)": ic.prepare_for_inference(model, int8=True)},
                  model, args.rounds, args.edge, relative_rms)


def relative_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


if __name__ == "__main__":
    main()
