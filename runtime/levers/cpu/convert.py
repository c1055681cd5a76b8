"""The CPU's speed levers as registered objects (torchtitan's ``ModelConverter`` shape): one
class a lever, its :meth:`Lever.decide` reading the run's :class:`LeverInputs` (once, in
``runtime.resolve``, through :func:`choose_levers`) and its :meth:`Lever.convert` changing the
network (in ``runtime.build``, through :func:`apply_levers`, which converts what was decided and
decides nothing). :func:`register` puts a lever in :data:`LEVERS`: adding one is one class here.
Also the PyTorch backend's inference copy (:func:`prepare_for_inference`).

Every lever is a swap of modules for subclasses that keep the parameters and state_dict keys
(:func:`runtime.levers.cpu.blocks.adopt`); a run with no lever runs ``model/``'s plain network,
the reference's bit for bit.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from model.unet3d import DEFAULT_FILTERS
from runtime.compiling import compile_function
from runtime.levers.cpu import blocks
from runtime.levers.cpu.bf16_guard import bf16_weight_grad_ok, protect_shallow_convolutions
from runtime.levers.cpu.norms import (NORM_ACTIVATION_KERNELS, FusedNormActivation, LayoutPreservingInstanceNorm3d,
                                      instance_norm_activation)

FUSED_NORM_RECOMPILE_LIMIT = 64  # variants per kernel: every layer's shapes, training and evaluation


@dataclass(frozen=True)
class LeverInputs:
    """What the levers' decisions read (the plan's inputs): ``amp_dtype`` is the autocast type
    the run really uses (None: float32, also after the CPU's bf16 fallback); ``filters`` the
    network's (the reason lines count its blocks)."""

    is_train: bool
    device_type: str
    channels_last: bool
    amp_dtype: str | None
    normalization: str
    compile: bool
    filters: tuple[int, ...] = DEFAULT_FILTERS

    @property
    def cpu_channels_last(self) -> bool:
        return self.channels_last and self.device_type == "cpu"

    @property
    def conv_blocks(self) -> int:
        """The network's convolution blocks: two in the input block and in each of the
        ``len(filters) - 1`` down blocks, the bottleneck and the ``len(filters)`` up blocks."""
        return 2 * (2 * len(self.filters) + 1)

    @property
    def upsample_blocks(self) -> int:
        return len(self.filters)

    @property
    def widest_blocks(self) -> int:
        """The convolution blocks with ``max(filters)`` output channels: two per block, whose
        widths are the input block's and the down blocks' (``filters``), the bottleneck's (the
        last) and the up blocks' (``filters`` reversed)."""
        widths = (*self.filters, self.filters[-1], *self.filters)
        return 2 * widths.count(max(self.filters))


@dataclass(frozen=True)
class Choice:
    """One lever decision: ``name`` (a lever of :data:`LEVERS`) and the line that says it;
    ``applied`` False: a lever that would apply but cannot run here (``why`` says why)."""

    name: str
    why: str
    applied: bool = True


class Lever:
    """A speed lever: :meth:`decide` whether it applies to a run (None: not relevant, nothing to
    say), :meth:`convert` the network in place as decided (``compile``: the whole model is
    compiled); ``compiles``: its first steps compile (``runtime.build`` warms them up)."""

    name: ClassVar[str]
    compiles: ClassVar[bool] = False

    def decide(self, inputs: LeverInputs) -> Choice | None:
        raise NotImplementedError

    def convert(self, model: nn.Module, compile: bool) -> None:
        raise NotImplementedError

    def choice(self, why: str, applied: bool = True) -> Choice:
        return Choice(self.name, why, applied)


# The levers by name, in the order they are decided and applied.
LEVERS: dict[str, Lever] = {}


def register(cls: type[Lever]) -> type[Lever]:
    """Class decorator: one instance of the lever ``cls`` in :data:`LEVERS` under ``cls.name``
    (after the levers registered before it)."""
    if cls.name in LEVERS:
        raise ValueError(f"lever {cls.name!r} is registered twice")
    LEVERS[cls.name] = cls()
    return cls


def _can_compile() -> bool:
    return compile_function(NORM_ACTIVATION_KERNELS[0]) is not NORM_ACTIVATION_KERNELS[0]


@register
class FusedNorm(Lever):
    """Channels-last CPU instance norm, any mode: norm + activation fused, where torch can
    compile (or the whole model is compiled: the eager function is slower than the modules)."""

    name = "fused_norm"
    compiles = True

    def decide(self, inputs):
        if not (inputs.cpu_channels_last and inputs.normalization == "instancenorm"):
            return None
        if not (inputs.compile or _can_compile()):
            return self.choice("channels-last: torch.compile is unavailable, instance norm and activation stay "
                               "modules", applied=False)
        when = "" if inputs.compile else " (compiled once: tens of seconds in the first steps)"
        return self.choice(f"channels-last: instance norm + activation fused in {inputs.conv_blocks} blocks, no "
                           f"layout conversion{when}")

    def convert(self, model, compile):
        """With ``compile`` the plain :func:`~runtime.levers.cpu.norms.instance_norm_activation`,
        fused in the model's graph; else :class:`~runtime.levers.cpu.norms.FusedNormActivation`,
        its forward and three backward kernels each compiled on their own (one graph each for all
        shapes; tens of seconds at the first steps)."""
        function = instance_norm_activation if compile else FusedNormActivation(
            [compile_function(k, dynamic=True, recompile_limit=FUSED_NORM_RECOMPILE_LIMIT)
             for k in NORM_ACTIVATION_KERNELS])
        blocks.fuse_norms(model, function)


@register
class GemmTransposed(Lever):
    """Channels-last CPU, any mode: each transposed convolution as one matrix product."""

    name = "gemm_transposed"

    def decide(self, inputs):
        if inputs.cpu_channels_last:
            return self.choice(f"channels-last: the {inputs.upsample_blocks} transposed convolutions as one matrix "
                               "product each")
        return None

    def convert(self, model, compile):
        blocks.gemm_transposed_convolutions(model)


@register
class SplitConcatenation(Lever):
    """Float32 channels-last CPU training (bf16 gains nothing; split, it would round the two
    parts' sums to bf16): the convolution after a concatenation as one per part, summed."""

    name = "split_concatenation"

    def decide(self, inputs):
        if inputs.is_train and inputs.cpu_channels_last and inputs.amp_dtype is None:
            return self.choice(f"channels-last float32: the convolution after each of the {inputs.upsample_blocks} "
                               "concatenations as one convolution per part, summed")
        return None

    def convert(self, model, compile):
        blocks.split_concatenations(model)


@register
class WidestNcdhw(Lever):
    """Float32 channels-last CPU training: the convolutions with the most filters in NCDHW."""

    name = "widest_ncdhw"

    def decide(self, inputs):
        if inputs.is_train and inputs.cpu_channels_last and inputs.amp_dtype is None:
            return self.choice(f"channels-last float32: the {inputs.widest_blocks} convolutions with "
                               f"{max(inputs.filters)} filters (the deepest levels) in NCDHW")
        return None

    def convert(self, model, compile):
        blocks.widest_blocks_in_ncdhw(model)


@register
class Bf16Guard(Lever):
    """bf16 CPU training where this CPU's oneDNN gets 2-deep convolutions' weight gradients
    wrong (:mod:`runtime.levers.cpu.bf16_guard`): those convolutions in float32."""

    name = "bf16_guard"

    def decide(self, inputs):
        if inputs.is_train and inputs.device_type == "cpu" and inputs.amp_dtype == "bf16" \
                and not bf16_weight_grad_ok():
            return self.choice("bf16: this CPU's oneDNN computes wrong weight gradients for convolutions over "
                               "2-voxel-deep inputs; those run in float32")
        return None

    def convert(self, model, compile):
        protect_shallow_convolutions(model)


FUSED_NORM, GEMM_TRANSPOSED, SPLIT_CONCATENATION = FusedNorm.name, GemmTransposed.name, SplitConcatenation.name
WIDEST_NCDHW, BF16_GUARD = WidestNcdhw.name, Bf16Guard.name


def choose_levers(is_train: bool, device_type: str, channels_last: bool, amp_dtype: str | None,
                  normalization: str, compile: bool, filters: tuple[int, ...] = DEFAULT_FILTERS) -> tuple[Choice, ...]:
    """Each registered lever's decision for a run (:class:`LeverInputs`' fields), in the order
    :func:`apply_levers` applies them; a lever that does not concern the run says nothing."""
    return decide_levers(LeverInputs(is_train, device_type, channels_last, amp_dtype, normalization, compile,
                                     tuple(filters)))


def decide_levers(inputs: LeverInputs) -> tuple[Choice, ...]:
    """:func:`choose_levers` from its inputs as one value."""
    return tuple(choice for lever in LEVERS.values() if (choice := lever.decide(inputs)) is not None)


def apply_levers(model: nn.Module, levers: tuple[str, ...], compile: bool) -> None:
    """Convert ``model`` in place with the named ``levers`` (:func:`choose_levers`' applied
    names, or a checkpoint's) in :data:`LEVERS`' order; an unknown name is refused before any
    conversion. ``compile``: the whole model is compiled (the fused norm is then traced into its
    graph)."""
    unknown = set(levers) - set(LEVERS)
    if unknown:
        raise ValueError(f"unknown levers {sorted(unknown)}")
    for name, lever in LEVERS.items():
        if name in levers:
            lever.convert(model, compile)


def levers_compile(levers: tuple[str, ...]) -> bool:
    """Whether any of the named ``levers`` compiles in the run's first steps."""
    return any(LEVERS[name].compiles for name in levers if name in LEVERS)


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
