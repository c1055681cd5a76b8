"""Which CPU levers a run takes (:func:`choose_levers`, called once by ``runtime.resolve``), how
they convert the training network (:func:`apply_levers`, called once by ``runtime.build``), and
the PyTorch backend's inference copy (:func:`prepare_for_inference`).

Every lever is a swap of modules for subclasses that keep the parameters and state_dict keys
(:func:`runtime.levers.cpu.blocks.adopt`); a run with no lever runs ``model/``'s plain network,
the reference's bit for bit.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from model.layers import ConvBlock, UpsampleBlock
from model.unet3d import DEFAULT_FILTERS, Unet3D
from runtime.compiling import compile_function
from runtime.levers.cpu import blocks
from runtime.levers.cpu.bf16_guard import bf16_weight_grad_ok, protect_shallow_convolutions
from runtime.levers.cpu.norms import (NORM_ACTIVATION_KERNELS, FusedNormActivation, LayoutPreservingInstanceNorm3d,
                                      instance_norm_activation)

FUSED_NORM = "fused_norm"
GEMM_TRANSPOSED = "gemm_transposed"
SPLIT_CONCATENATION = "split_concatenation"
WIDEST_NCDHW = "widest_ncdhw"
BF16_GUARD = "bf16_guard"
FUSED_NORM_RECOMPILE_LIMIT = 64  # variants per kernel: every layer's shapes, training and evaluation


@dataclass(frozen=True)
class Lever:
    """One lever decision: ``name`` (a lever :func:`apply_levers` applies) and the line that
    says it; ``applied`` False: a lever that would apply but cannot run here (``why`` says why)."""

    name: str
    why: str
    applied: bool = True


def fused_norm_function(compile: bool):
    """The fused norm + activation a run computes with: with ``--compile`` the plain
    :func:`~runtime.levers.cpu.norms.instance_norm_activation`, fused in the model's graph; else
    :class:`~runtime.levers.cpu.norms.FusedNormActivation`, its forward and three backward
    kernels each compiled on their own (one graph each for all shapes; tens of seconds at the
    first steps), or None where this torch cannot compile (the eager function is slower than the
    modules)."""
    if compile:
        return instance_norm_activation
    kernels = [compile_function(k, dynamic=True, recompile_limit=FUSED_NORM_RECOMPILE_LIMIT)
               for k in NORM_ACTIVATION_KERNELS]
    return None if kernels[0] is NORM_ACTIVATION_KERNELS[0] else FusedNormActivation(kernels)


def _can_compile() -> bool:
    return compile_function(NORM_ACTIVATION_KERNELS[0]) is not NORM_ACTIVATION_KERNELS[0]


def choose_levers(is_train: bool, device_type: str, channels_last: bool, amp_dtype: str | None,
                  normalization: str, compile: bool, filters: tuple[int, ...] = DEFAULT_FILTERS) -> tuple[Lever, ...]:
    """The CPU levers of a run, in the order :func:`apply_levers` applies them. ``amp_dtype``:
    the autocast type the run really uses (None: float32, also after the CPU's bf16 fallback);
    ``filters``: the network's, for the lines' counts.

    - fused norms: channels-last CPU instance norm, any mode, where torch can compile (or the
      whole model is compiled);
    - GEMM transposed convolutions: channels-last CPU, any mode;
    - split concatenations and the widest blocks in NCDHW: float32 channels-last CPU training
      (bf16 gains nothing from them; split, it would round the two parts' sums to bf16);
    - the bf16 guard: bf16 CPU training where this CPU's oneDNN gets 2-deep convolutions' weight
      gradients wrong (:mod:`runtime.levers.cpu.bf16_guard`).
    """
    cpu_cl = channels_last and device_type == "cpu"
    with torch.device("meta"):  # the blocks each lever changes, counted on the network's shape
        network = Unet3D(filters=filters)
    conv_blocks = sum(isinstance(m, ConvBlock) for m in network.modules())
    upsample_blocks = sum(isinstance(m, UpsampleBlock) for m in network.modules())
    levers = []
    if cpu_cl and normalization == "instancenorm":
        if compile or _can_compile():
            when = "" if compile else " (compiled once: tens of seconds in the first steps)"
            levers.append(Lever(FUSED_NORM, f"channels-last: instance norm + activation fused in {conv_blocks} "
                                            f"blocks, no layout conversion{when}"))
        else:
            levers.append(Lever(FUSED_NORM, "channels-last: torch.compile is unavailable, instance norm and activation "
                                            "stay modules", applied=False))
    if cpu_cl:
        levers.append(Lever(GEMM_TRANSPOSED, f"channels-last: the {upsample_blocks} transposed convolutions as one "
                                             "matrix product each"))
    if is_train and cpu_cl and amp_dtype is None:
        widest = len(blocks.widest_blocks_in_ncdhw(network))
        levers.append(Lever(SPLIT_CONCATENATION, "channels-last float32: the convolution after each of the "
                                                 f"{upsample_blocks} concatenations as one convolution per part, "
                                                 "summed"))
        levers.append(Lever(WIDEST_NCDHW, f"channels-last float32: the {widest} convolutions with {max(filters)} "
                                          "filters (the deepest levels) in NCDHW"))
    if is_train and device_type == "cpu" and amp_dtype == "bf16" and not bf16_weight_grad_ok():
        levers.append(Lever(BF16_GUARD, "bf16: this CPU's oneDNN computes wrong weight gradients for convolutions "
                                        "over 2-voxel-deep inputs; those run in float32"))
    return tuple(levers)


def apply_levers(model: nn.Module, levers: tuple[str, ...], compile: bool) -> None:
    """Convert ``model`` in place with the named ``levers`` (:func:`choose_levers`' names) in
    their order; ``compile``: the whole model is compiled (the fused norm is then traced into
    its graph)."""
    unknown = set(levers) - {FUSED_NORM, GEMM_TRANSPOSED, SPLIT_CONCATENATION, WIDEST_NCDHW, BF16_GUARD}
    if unknown:
        raise ValueError(f"unknown levers {sorted(unknown)}")
    if FUSED_NORM in levers:
        blocks.fuse_norms(model, fused_norm_function(compile))
    if GEMM_TRANSPOSED in levers:
        blocks.gemm_transposed_convolutions(model)
    if SPLIT_CONCATENATION in levers:
        blocks.split_concatenations(model)
    if WIDEST_NCDHW in levers:
        blocks.widest_blocks_in_ncdhw(model)
    if BF16_GUARD in levers:
        protect_shallow_convolutions(model)


def prepare_for_inference(model: nn.Module, channels_last: bool = True) -> nn.Module:
    """The PyTorch backend's inference copy of ``model``: the same function, laid out for a fast
    CPU forward, eval mode (``model`` itself is not changed, so training can go on), with

    * every ``ReLU`` in place (no autograd here, so the norm's output can be overwritten);
    * with ``channels_last``, weights NDHWC and the convolution of the one-channel image run by
      oneDNN (:class:`~runtime.levers.cpu.blocks.ChannelsLastConv3d`), so the network is
      channels-last from its first output (feed channels-last inputs);
    * every ``InstanceNorm3d`` a :class:`~runtime.levers.cpu.norms.LayoutPreservingInstanceNorm3d`:
      the same statistics and affine map, but a channels-last input gives a channels-last output
      (``nn.InstanceNorm3d`` pays two full-size layout copies per norm in a channels-last network:
      docs/performance.md, "What each lever gave").

    The state_dict keys stay the reference's, so a prepared model loads the same checkpoints; it
    computes the same prediction up to float32 rounding (the norms' statistics to about 1e-7, as
    ``nn.InstanceNorm3d``). int8 is the OpenVINO backend's (:mod:`runtime.inference.openvino`).
    """
    prepared = copy.deepcopy(model).eval()

    def inference_module(m: nn.Module) -> nn.Module | None:
        if isinstance(m, nn.InstanceNorm3d):
            return blocks.adopt(m, LayoutPreservingInstanceNorm3d)
        if type(m) is nn.ReLU:
            return blocks.adopt(m, nn.ReLU, inplace=True)
        if channels_last and type(m) is nn.Conv3d and m.in_channels == 1:
            return blocks.adopt(m, blocks.ChannelsLastConv3d)
        return None

    blocks.swap(prepared, inference_module)
    if channels_last:
        prepared = prepared.to(memory_format=torch.channels_last_3d)
    for p in prepared.parameters():
        p.requires_grad_(False)
    return prepared
