"""The reference's training code that ``python -m benchmarks.bench_train_lockstep`` times, loaded
beside the project's (stand-in tree; the real one with UNET3D_REFERENCE_CODE). The benchmark's
own smoke run: tests/test_benchmarks.py."""
import os
import sys

import pytest
import torch

from oracles.mlcommons_reference import ReferenceCodeError, load_reference_training
from test_mlcommons_reference import REAL, needs_real, write_stand_in

TRAINING_STAND_IN = {
    "model/losses.py": "class DiceCELoss:\n    def __init__(self, to_onehot_y, use_softmax, layout, include_background):\n"
                       "        self.layout = layout\n",
    "runtime/training.py": "import torch\nfrom runtime.distributed_utils import get_rank\n\n"
                           "def get_optimizer(params, flags):\n"
                           "    return torch.optim.SGD(params, lr=flags.learning_rate, momentum=flags.momentum, nesterov=True)\n",
}


def write_training_stand_in(folder):
    write_stand_in(folder)
    for name, text in TRAINING_STAND_IN.items():
        with open(os.path.join(folder, name), "w") as handle:
            handle.write(text)
    return str(folder)


def test_load_reference_training_imports_the_tree_and_puts_the_project_back(tmp_path):
    import model.losses

    before = {k: v for k, v in sys.modules.items() if k.split(".")[0] in ("model", "runtime")}
    unet3d, loss, get_optimizer = load_reference_training(write_training_stand_in(tmp_path / "ref"))
    assert loss(True, True, "NCDHW", False).layout == "NCDHW"
    from types import SimpleNamespace
    opt = get_optimizer([torch.zeros(2, requires_grad=True)], SimpleNamespace(learning_rate=0.5, momentum=0.9))
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["nesterov"]
    assert {k: v for k, v in sys.modules.items() if k.split(".")[0] in ("model", "runtime")} == before
    assert sys.modules["model.losses"] is model.losses


def test_a_tree_without_the_training_code_is_one_line(tmp_path):
    folder = write_stand_in(tmp_path / "ref")
    with pytest.raises(ReferenceCodeError) as error:
        load_reference_training(folder)
    assert "model/losses.py" in str(error.value) and "\n" not in str(error.value)


@needs_real
def test_reference_loss_is_the_project_loss():
    """The loss the mlcommons variant trains with (the real code's) and the project's: equal."""
    from model.losses import DiceCELoss

    _, reference_loss, _ = load_reference_training(REAL)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 8, 8, 8, generator=g)
    label = torch.randint(0, 3, (2, 1, 8, 8, 8), generator=g)
    theirs = reference_loss(to_onehot_y=True, use_softmax=True, layout="NCDHW", include_background=False)
    torch.testing.assert_close(DiceCELoss()(logits, label), theirs(logits, label), rtol=1e-6, atol=1e-6)


@needs_real
def test_project_fp32_training_step_against_the_reference_step():
    """The default (float32, NCDHW) network of runtime.build, with its ConvBlocks, and the real
    code's network and loss, the same weights and batch: the loss bit for bit (the logits are:
    tests/test_mlcommons_reference.py); the gradients as close as float32 summation order allows
    (the two losses differ in op order, so their backward passes are not bit-identical; the same
    before the ConvBlocks, which the last part checks bit for bit against nn.Sequential blocks)."""
    import dataclasses

    from torch import nn

    from model.layers import ConvBlock
    from model.losses import DiceCELoss
    from runtime.arguments import Config
    from runtime.build import build_model
    from runtime.resolve import network_of_flags

    torch.set_num_threads(1)
    reference_unet, reference_loss, _ = load_reference_training(REAL)
    torch.manual_seed(0)
    ours = build_model(network_of_flags(dataclasses.replace(Config(loader="synthetic"), exec_mode="train")),
                       torch.device("cpu"))
    theirs = reference_unet(1, 3, "instancenorm", "relu")
    theirs.load_state_dict(ours.state_dict())
    sequential = type(ours)(filters=ours.filters)
    sequential.load_state_dict(ours.state_dict())
    for module in sequential.modules():
        if isinstance(module, ConvBlock):
            module.__class__ = nn.Sequential  # the blocks as they were
    g = torch.Generator().manual_seed(1)
    image = torch.randn(1, 1, 64, 64, 32, generator=g)
    label = torch.randint(0, 3, (1, 1, 64, 64, 32), generator=g, dtype=torch.uint8)
    results = []
    for model, loss_fn in ((ours, DiceCELoss()), (sequential, DiceCELoss()),
                           (theirs, reference_loss(to_onehot_y=True, use_softmax=True, layout="NCDHW",
                                                   include_background=False))):
        loss = loss_fn(model(image), label)
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (loss0, grads0), (loss1, grads1), (loss2, grads2) = results
    assert torch.equal(loss0, loss1) and torch.equal(grads0, grads1)
    assert torch.equal(loss0, loss2)
    assert float((grads0 - grads2).norm() / grads2.norm()) < 1e-5
