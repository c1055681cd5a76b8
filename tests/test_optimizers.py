"""Optimizers: LAMB against steps worked out by hand, and the choice of optimizer."""
import math

import pytest
import torch

from runtime.optimizers import Lamb, make_optimizer


def lamb_step(p, g, lr, wd, beta1=0.9, beta2=0.999, eps=1e-6):
    """The first LAMB step in plain Python floats: bias-corrected moments are g and g², so the
    update is g/(|g|+eps) + wd·p, scaled by ‖p‖/‖update‖ (1 when a norm is zero)."""
    update = [gi / (math.sqrt(gi * gi) + eps) + wd * pi for pi, gi in zip(p, g)]
    w_norm = math.sqrt(sum(x * x for x in p))
    u_norm = math.sqrt(sum(x * x for x in update))
    trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
    return [pi - lr * trust * ui for pi, ui in zip(p, update)]


@pytest.mark.parametrize("p,g,wd", [([3.0, 4.0], [1.0, 2.0], 0.0),        # trust 5/sqrt(2)
                                    ([3.0, -4.0], [0.5, -2.0], 0.1),
                                    ([0.0, 0.0], [1.0, -1.0], 0.0)])       # zero weights: trust 1
def test_lamb_first_step_known_answer(p, g, wd):
    param = torch.nn.Parameter(torch.tensor(p, dtype=torch.float64))
    param.grad = torch.tensor(g, dtype=torch.float64)
    Lamb([param], lr=0.1, weight_decay=wd).step()
    # The step count is a float32 tensor, so the bias corrections carry float32 rounding (~1e-7).
    torch.testing.assert_close(param.detach(), torch.tensor(lamb_step(p, g, 0.1, wd), dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)


def test_lamb_first_step_of_the_worked_example():
    """p = (3, 4), g = (1, 2): the update is about (1, 1), ‖p‖ = 5, so each weight moves by
    lr·5/√2 ≈ 0.35355 at lr 0.1."""
    param = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    param.grad = torch.tensor([1.0, 2.0], dtype=torch.float64)
    Lamb([param], lr=0.1).step()
    torch.testing.assert_close(param.detach(), torch.tensor([3.0, 4.0], dtype=torch.float64) - 0.5 / math.sqrt(2),
                               rtol=0, atol=1e-6)


def test_lamb_second_step_uses_bias_corrected_moments():
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    opt = Lamb([param], lr=0.05, betas=(0.8, 0.9), eps=0.0)
    grads = [torch.tensor([0.3, -0.1, 0.2], dtype=torch.float64), torch.tensor([-0.2, 0.4, 0.1], dtype=torch.float64)]
    expected = param.detach().clone()
    m = torch.zeros(3, dtype=torch.float64)
    v = torch.zeros(3, dtype=torch.float64)
    for step, grad in enumerate(grads, start=1):
        param.grad = grad.clone()
        opt.step()
        m = 0.8 * m + 0.2 * grad
        v = 0.9 * v + 0.1 * grad * grad
        update = (m / (1 - 0.8 ** step)) / (v / (1 - 0.9 ** step)).sqrt()
        expected -= 0.05 * (expected.norm() / update.norm()) * update
    torch.testing.assert_close(param.detach(), expected, rtol=1e-6, atol=1e-7)


def test_make_optimizer_names():
    params = [torch.nn.Parameter(torch.zeros(2))]
    sgd = make_optimizer("sgd", params, lr=0.1, momentum=0.8)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["nesterov"] and sgd.defaults["momentum"] == 0.8
    assert isinstance(make_optimizer("adam", params, lr=0.1), torch.optim.Adam)
    lamb = make_optimizer("lamb", params, lr=0.1, betas=(0.7, 0.8))
    assert isinstance(lamb, Lamb) and lamb.defaults["betas"] == (0.7, 0.8)
    with pytest.raises(ValueError, match="unknown optimizer"):
        make_optimizer("rmsprop", params, lr=0.1)
