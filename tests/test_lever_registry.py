"""The CPU levers as registered objects (``runtime.levers.cpu.convert``): a lever is one class
whose ``decide`` reads the run's inputs and whose ``convert`` changes the network; the decision
is made once (``choose_levers``, in ``resolve``) and ``apply_levers`` converts what was decided.
What each lever computes is tested in ``tests/test_train_cpu_levers.py``."""

from types import SimpleNamespace

import pytest
import torch

from model.layers import ConvBlock, UpsampleBlock
from model.unet3d import DEFAULT_FILTERS, Unet3D
from runtime import build
from runtime.levers.cpu import convert
from runtime.levers.cpu.blocks import FastConvBlock
from runtime.levers.cpu.norms import FusedNormActivation
from runtime.plan import PrecisionPlan

FILTERS = (4, 8, 16, 32, 64)
CPU_CL_FP32 = dict(is_train=True, device_type="cpu", channels_last=True, amp_dtype=None,
                   normalization="instancenorm", compile=True)


@pytest.mark.parametrize("filters", [DEFAULT_FILTERS, FILTERS, (4, 8), (8, 8, 8), (4, 16, 8), (16, 8, 4)])
def test_the_reason_lines_count_the_networks_blocks(filters):
    """The counts the lines say, from the filters alone, against the network built on the meta
    device (the oracle)."""
    with torch.device("meta"):
        network = Unet3D(filters=filters)
    conv_blocks = [m for m in network.modules() if isinstance(m, ConvBlock)]
    inputs = convert.LeverInputs(**CPU_CL_FP32, filters=filters)
    assert inputs.conv_blocks == len(conv_blocks)
    assert inputs.upsample_blocks == sum(isinstance(m, UpsampleBlock) for m in network.modules())
    assert inputs.widest_blocks == sum(b[0].out_channels == max(filters) for b in conv_blocks)


def test_choosing_builds_no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a network was built to decide the levers")

    monkeypatch.setattr(Unet3D, "__init__", refuse)
    names = [c.name for c in convert.choose_levers(*CPU_CL_FP32.values(), FILTERS)]
    assert names == [convert.FUSED_NORM, convert.GEMM_TRANSPOSED, convert.SPLIT_CONCATENATION, convert.WIDEST_NCDHW]


def test_apply_converts_what_was_decided_without_probing_again(monkeypatch):
    """The fused norm decided (torch can compile when ``resolve`` asks): every block gets it,
    even where compiling would give the eager kernels by the time the network is built."""
    monkeypatch.setattr(convert, "compile_function", lambda function, **kwargs: ("compiled", function))
    inputs = dict(CPU_CL_FP32, compile=False)
    (fused,) = [c for c in convert.choose_levers(*inputs.values(), FILTERS) if c.name == convert.FUSED_NORM]
    assert fused.applied
    monkeypatch.setattr(convert, "compile_function", lambda function, **kwargs: function)
    model = Unet3D(1, 3, filters=FILTERS)
    convert.apply_levers(model, (fused.name,), compile=False)
    blocks = [m for m in model.modules() if isinstance(m, ConvBlock)]
    assert blocks and all(isinstance(m, FastConvBlock) for m in blocks)
    assert all(isinstance(m.norm_activation, FusedNormActivation) for m in blocks)


def test_a_lever_is_one_registered_class(monkeypatch):
    """A lever added with ``register`` alone is decided by ``choose_levers`` (after the others),
    converted by ``apply_levers``, warmed up by ``build`` where it compiles; an unknown name is
    refused before anything is converted; a name registered twice is refused."""
    monkeypatch.setattr(convert, "LEVERS", dict(convert.LEVERS))
    converted = []

    @convert.register
    class EvalOnly(convert.Lever):
        name = "eval_only"
        compiles = True

        def decide(self, inputs):
            return None if inputs.is_train else self.choice(f"evaluation with {max(inputs.filters)} filters")

        def convert(self, model, compile):
            converted.append((model, compile))

    evaluation = dict(CPU_CL_FP32, is_train=False)
    assert convert.choose_levers(*evaluation.values(), FILTERS)[-1] == convert.Choice("eval_only",
                                                                                      "evaluation with 64 filters")
    assert "eval_only" not in [c.name for c in convert.choose_levers(*CPU_CL_FP32.values(), FILTERS)]
    model = Unet3D(1, 3, filters=FILTERS)
    with pytest.raises(ValueError, match=r"unknown levers \['nope'\]"):
        convert.apply_levers(model, ("eval_only", "nope"), compile=False)
    assert converted == []
    convert.apply_levers(model, ("eval_only",), compile=True)
    assert converted == [(model, True)]
    # what compiles_lazily reads of a plan: its precision, and no training section (no CUDA graph)
    plan = SimpleNamespace(precision=PrecisionPlan(False, "auto", levers=("eval_only",)), training=None)
    assert build.compiles_lazily(plan)
    assert not build.compiles_lazily(SimpleNamespace(precision=PrecisionPlan(False, "auto",
                                                                             levers=(convert.GEMM_TRANSPOSED,)),
                                                     training=None))
    with pytest.raises(ValueError, match="registered twice"):
        convert.register(EvalOnly)
