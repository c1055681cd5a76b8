"""Every speed lever computes the same function as the plain path, within its precision.

CPU where possible (channels-last, bf16 autocast, the fused optimizer's CPU fallback, batched
sliding windows, the CUDA-graph step's optimizer and state handling); GPU-only paths (fp16 with
the scaler, CUDA graphs, fused and foreach CUDA optimizers) skip without CUDA;
``torch.compile`` on the CPU takes over a minute on two cores, so its equivalence test is marked
``slow`` (``make test-slow``, which CI runs).
"""
import copy
import dataclasses
import warnings
from contextlib import nullcontext
from functools import lru_cache, partial

import pytest
import torch

from model.losses import DiceCELoss
from model.unet3d import Unet3D
from runtime.arguments import Config
from runtime.build import autocast_factory
from runtime.checkpoint import clean_state_dict, unwrap
from runtime.levers.gpu.graphs import (GraphedTrainStep, _graph_safe_autocast, capturable_optimizer,
                            cuda_graphs_supported, restore_snapshot, snapshot)
from runtime.inference.predictor import PredictorOptions, build_predictor
from runtime.inference.sliding_window import sliding_window_inference
from runtime.optimizers import fused_step, make_optimizer
from runtime.plan import PrecisionPlan
from runtime.compiling import CompiledModule, compile_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@lru_cache(maxsize=None)
def no_cpu_fused_step(cls: type) -> str | None:
    """Why ``cls(..., fused=True)`` cannot step CPU tensors in this torch, or None when it can
    (torch 2.3 has the fused SGD/Adam kernels for CUDA only: ``aten::_fused_sgd_`` has no CPU
    kernel). Found by trying one step on a 2-element parameter, once per class."""
    param = torch.zeros(2, requires_grad=True)
    param.grad = torch.ones(2)
    try:
        cls([param], lr=0.1, fused=True).step()
    except (RuntimeError, TypeError, NotImplementedError) as err:
        first_line = (str(err).splitlines() or [type(err).__name__])[0]
        return f"torch {torch.__version__}: no fused {cls.__name__} step on the CPU ({first_line[:120]})"
    return None


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors gain nothing from threads, and on a shared two-core machine OpenMP threads
    oversubscribe the cores (a 10x slowdown measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


FILTERS = (2, 4, 4, 8, 8)
SHAPE = (64, 64, 32)  # instance norm needs more than one bottleneck voxel: 2 x 2 x 1


def tiny_model(seed=0, normalization="instancenorm", device="cpu"):
    torch.manual_seed(seed)
    return Unet3D(1, 3, normalization=normalization, filters=FILTERS).to(device)


def batch(n=1, shape=SHAPE, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    image = torch.randn(n, 1, *shape, generator=g)
    label = torch.randint(0, 3, (n, 1, *shape), generator=g, dtype=torch.uint8)
    return image.to(device), label.to(device)


def forward_backward(model, image, label, autocast=nullcontext):
    model.zero_grad(set_to_none=True)
    with autocast():
        logits = model(image)
        loss = DiceCELoss()(logits, label)
    loss.backward()
    return logits.float().detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def flat(grads):
    return torch.cat([g.flatten() for g in grads.values()])


def set_random_grads(model, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.device)


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def to_channels_last(value):
    """A 5-D tensor in ``torch.channels_last_3d`` (NDHWC strides, same logical shape), or a module
    whose 5-D weights are; anything else unchanged."""
    if isinstance(value, torch.nn.Module):
        return value.to(memory_format=torch.channels_last_3d)
    if isinstance(value, torch.Tensor) and value.dim() == 5:
        return value.contiguous(memory_format=torch.channels_last_3d)
    return value


# --------------------------------------------------------------------------------------------
# channels-last, bf16

def test_channels_last_same_forward_and_gradients_fp32():
    image, label = batch()
    plain = tiny_model()
    fast = to_channels_last(copy.deepcopy(plain))
    assert fast.input_block.conv1[0].weight.is_contiguous(memory_format=torch.channels_last_3d)
    logits0, loss0, grads0 = forward_backward(plain, image, label)
    logits1, loss1, grads1 = forward_backward(fast, to_channels_last(image), label)
    assert rel_err(logits1, logits0) < 1e-5
    assert abs(float(loss1 - loss0)) < 1e-5
    for name in grads0:
        assert rel_err(grads1[name], grads0[name]) < 1e-4, name


def test_bf16_autocast_close_to_fp32_on_cpu():
    """The autocast of ``--amp --amp_dtype bf16`` on the CPU (runtime.build.autocast_factory):
    really bf16 (the logits differ from fp32's), close to fp32, and no gradient scaler."""
    image, label = batch()
    model = tiny_model()
    logits0, loss0, grads0 = forward_backward(model, image, label)
    bf16, scaler = autocast_factory(PrecisionPlan(amp=True, amp_dtype="bf16"), torch.device("cpu"))
    assert not scaler.is_enabled()
    logits1, loss1, grads1 = forward_backward(model, image, label, bf16)
    assert not torch.equal(logits1, logits0)
    assert rel_err(logits1, logits0) < 2e-2
    assert abs(float(loss1 - loss0)) / float(loss0) < 2e-2
    # All gradients as one vector: single tensors whose gradient nearly cancels (norm biases)
    # have large relative errors in bf16 without mattering for the update.
    assert rel_err(flat(grads1), flat(grads0)) < 5e-2


# --------------------------------------------------------------------------------------------
# optimizer steps

def torch_has_cpu_fused_sgd() -> bool:
    """Asked of torch itself, not of its version: one fused step on a CPU tensor."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    try:
        torch.optim.SGD([p], lr=0.5, momentum=0.9, nesterov=True, fused=True).step()
    except (TypeError, RuntimeError):
        return False
    return bool(torch.allclose(p.detach(), torch.full((3,), 0.05)))   # 1 - 0.5·(1 + 0.9·1)


def test_make_optimizer_fused_on_cpu_where_torch_has_it():
    """--fused_optimizer on the CPU: torch's fused SGD where it exists (else the default step,
    as on torch 2.3), the same updates as the default one-tensor-at-a-time step."""
    models = [tiny_model(), tiny_model()]
    opts = [make_optimizer("sgd", models[0].parameters(), 0.01, momentum=0.9),
            make_optimizer("sgd", models[1].parameters(), 0.01, momentum=0.9,
                           fused=fused_step("sgd", torch.device("cpu"))[0])]
    assert not opts[0].param_groups[0].get("fused")
    assert bool(opts[1].param_groups[0].get("fused")) == torch_has_cpu_fused_sgd()
    start = [p.detach().clone() for p in models[0].parameters()]
    for step in range(3):
        for model, opt in zip(models, opts):
            set_random_grads(model, step)
            opt.step()
    assert min(float((p - q).abs().max()) for p, q in zip(models[0].parameters(), start)) > 1e-3
    for p0, p1 in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p1, p0)             # float32's default tolerances


@pytest.mark.parametrize("saved_fused, fused", [(True, False), (False, True)])
def test_a_resumed_optimizer_keeps_this_runs_kernel(saved_fused, fused):
    """load_state_dict would take the saved run's fused/foreach choice: the resumed run keeps
    its own --fused_optimizer (the state itself is the saved one)."""
    from runtime.checkpoint import load_optimizer_state

    if not torch_has_cpu_fused_sgd():
        pytest.skip(f"torch {torch.__version__} has no fused SGD on the CPU")
    saved_model, model = tiny_model(), tiny_model()
    saved = make_optimizer("sgd", saved_model.parameters(), 0.01, fused=saved_fused)
    set_random_grads(saved_model, 0)
    saved.step()
    opt = make_optimizer("sgd", model.parameters(), 0.01, fused=fused)
    load_optimizer_state(opt, {"optimizer_state_dict": saved.state_dict()}, "ckpt.pt")
    assert bool(opt.param_groups[0]["fused"]) == fused
    buffers = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    for b, p in zip(buffers, saved_model.parameters()):
        torch.testing.assert_close(b, saved.state[p]["momentum_buffer"], rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# sliding window

def test_sliding_window_batched_bf16_matches_one_window_at_a_time():
    model = tiny_model(normalization="batchnorm").eval()   # instance norm needs > 1 bottleneck voxel
    g = torch.Generator().manual_seed(3)
    image = torch.randn(1, 1, 40, 60, 50, generator=g)
    cpu = torch.device("cpu")
    fp32 = build_predictor(model, cpu, PredictorOptions())
    bf16 = build_predictor(model, cpu, PredictorOptions(amp_dtype="bf16"))
    roi = (32, 32, 32)
    ref = sliding_window_inference(fp32, image, roi, 0.5, 1)
    one = sliding_window_inference(bf16, image, roi, 0.5, 1)
    four = sliding_window_inference(bf16, image, roi, 0.5, 4)
    fp32_four = sliding_window_inference(fp32, image, roi, 0.5, 4)
    torch.testing.assert_close(fp32_four, ref, rtol=1e-5, atol=1e-5)
    assert rel_err(four, one) < 1e-2
    assert rel_err(four, ref) < 2e-2
    assert (four.argmax(1) != ref.argmax(1)).float().mean() < 0.01      # the predicted classes


# --------------------------------------------------------------------------------------------
# torch.compile

def test_compile_model_disabled_returns_the_module_and_unavailable_is_decided(monkeypatch):
    """Off, the module itself; where this torch cannot compile, the plan decides --compile off
    (runtime.resolve.decide_compile: tests/test_plan_value.py), so compile_model checks nothing."""
    from runtime.compiling import compile_unavailable

    model = tiny_model()
    assert compile_model(model, enabled=False) is model
    monkeypatch.delattr(torch, "compile")
    assert "has no torch.compile" in compile_unavailable()


def test_compiled_module_falls_back_to_eager_once(monkeypatch):
    calls = []

    def broken_compile(module, **kwargs):
        def run(*args):
            calls.append(1)
            raise RuntimeError("backend compiler failed\nlong trace")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    model = tiny_model()
    wrapped = compile_model(model, enabled=True)
    assert isinstance(wrapped, CompiledModule)
    image, _ = batch(n=1)
    with pytest.warns(RuntimeWarning, match="backend compiler failed"):
        out = wrapped(image)
    torch.testing.assert_close(out, model(image))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped(image)                      # eager from now on: no second attempt, no warning
    assert len(calls) == 1
    # checkpoints see the plain model; attributes reach it
    assert unwrap(wrapped) is model
    assert set(clean_state_dict(wrapped.state_dict())) == set(model.state_dict())
    assert wrapped.divisor == model.divisor


def test_compiled_module_reraises_out_of_memory(monkeypatch):
    # torch.cuda.OutOfMemoryError: the name in every torch since 1.13 (torch.OutOfMemoryError,
    # the same class, is newer than torch 2.3)
    def oom_compile(module, **kwargs):
        def run(*args):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return run

    monkeypatch.setattr(torch, "compile", oom_compile)
    wrapped = compile_model(tiny_model(), enabled=True)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        wrapped(batch(n=1)[0])
    assert wrapped.compile_failed is None


@pytest.mark.slow  # torch.compile on the CPU: about a minute on two cores
def test_compile_same_function_on_cpu():
    image, label = batch(n=2, shape=(32, 32, 32))
    plain = tiny_model(normalization="batchnorm")
    compiled = compile_model(copy.deepcopy(plain), enabled=True)
    logits0, loss0, grads0 = forward_backward(plain, image, label)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)     # a fallback would hide a broken compile
        logits1, loss1, grads1 = forward_backward(compiled, image, label)
    assert compiled.compile_failed is None
    assert rel_err(logits1, logits0) < 1e-4
    assert abs(float(loss1 - loss0)) < 1e-5
    for name in grads0:
        assert rel_err(grads1["module." + name], grads0[name]) < 1e-3, name


# --------------------------------------------------------------------------------------------
# CUDA graphs: the fallback decision and the pieces that run on the CPU

GPU = torch.device("cuda", 0)


@pytest.mark.parametrize("changes, device, world, ok, reason", [
    (dict(), "cpu", 1, False, "need a CUDA GPU"),
    (dict(), GPU, 1, True, "ok"),
    (dict(amp=True, amp_dtype="bf16"), GPU, 1, True, "ok"),
    (dict(amp=True, amp_dtype="auto"), GPU, 1, False, "GradScaler"),     # auto = fp16 on CUDA
    (dict(amp=True, amp_dtype="fp16"), GPU, 1, False, "GradScaler"),
    (dict(ga_steps=2), GPU, 1, False, "ga_steps"),
    (dict(), GPU, 2, False, "world size 1"),
    (dict(optimizer="lamb"), GPU, 1, False, "lamb"),
    (dict(optimizer="adam", compile=True, channels_last=True), GPU, 1, True, "ok"),
])
def test_cuda_graphs_supported_decides(changes, device, world, ok, reason):
    cfg = dataclasses.replace(Config(loader="synthetic"), **changes)
    got, why = cuda_graphs_supported(torch.device(device), cfg, world_size=world)
    assert got is ok and reason in why


def test_cuda_graphs_refused_on_rocm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    ok, why = cuda_graphs_supported(GPU, Config(loader="synthetic"))
    assert not ok and "ROCm" in why


def test_graphed_step_refuses_cpu_tensors_and_an_enabled_scaler():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    image, label = batch(n=1)
    with pytest.raises(ValueError, match="CUDA"):
        GraphedTrainStep(model, DiceCELoss(), opt, image, label)
    scaler = type("Scaler", (), {"is_enabled": lambda self: True})()
    with pytest.raises(ValueError, match="GradScaler"):
        GraphedTrainStep(model, DiceCELoss(), opt, image, label, scaler=scaler)


def test_graph_autocast_has_no_weight_cache():
    ctx = _graph_safe_autocast(partial(torch.autocast, device_type="cpu", dtype=torch.bfloat16))
    assert isinstance(ctx, torch.autocast) and ctx._cache_enabled is False
    assert ctx.fast_dtype == torch.bfloat16
    assert not isinstance(_graph_safe_autocast(nullcontext), torch.autocast)


def test_capture_preparation_replays_the_eager_sgd_run_on_cpu():
    """What GraphedTrainStep does around the capture, run eagerly: warm-up steps undone, the
    fused SGD step reading a tensor lr that is refreshed when the schedule changes it, gives
    the same weights as plain SGD with float learning rates."""
    if no_cpu_fused_step(torch.optim.SGD):
        pytest.skip(no_cpu_fused_step(torch.optim.SGD))
    lrs = [0.05, 0.05, 0.02, 0.01]
    ref_model, model = tiny_model(), tiny_model()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=lrs[0], momentum=0.9, nesterov=True)
    opt = make_optimizer("sgd", model.parameters(), lrs[0], momentum=0.9)
    for step, lr in enumerate(lrs):
        ref_opt.param_groups[0]["lr"] = lr
        set_random_grads(ref_model, step)
        ref_opt.step()

    saved = snapshot(model, opt)
    with capturable_optimizer(opt, torch.device("cpu")) as lr_tensors:
        assert opt.param_groups[0]["fused"] and opt.param_groups[0]["lr"] is lr_tensors[0]
        for step in range(3):                               # warm-up: real updates...
            set_random_grads(model, 10 + step)
            opt.step()
        restore_snapshot(saved, model, opt)                          # ...undone
        for step, lr in enumerate(lrs):
            lr_tensors[0].fill_(lr)
            set_random_grads(model, step)
            opt.step()
    assert opt.param_groups[0]["lr"] == lrs[0] and not opt.param_groups[0]["fused"]
    for p0, p1 in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(p1, p0, rtol=1e-5, atol=1e-6)


def test_restore_puts_back_weights_buffers_and_prior_optimizer_state():
    model = tiny_model(normalization="batchnorm")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    set_random_grads(model, 0)
    opt.step()                                              # a resumed run: momentum exists
    before = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    saved = snapshot(model, opt)
    with torch.no_grad():
        model.train()(batch()[0])                           # running statistics move
    assert not torch.equal(before["input_block.conv1.1.running_mean"],
                           model.state_dict()["input_block.conv1.1.running_mean"])
    set_random_grads(model, 1)
    opt.step()
    restore_snapshot(saved, model, opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in zip(model.parameters(), momentum))


def test_capturable_optimizer_refuses_lamb_and_dampening():
    model = tiny_model()
    with pytest.raises(ValueError, match="Lamb"):
        with capturable_optimizer(make_optimizer("lamb", model.parameters(), 0.1), torch.device("cpu")):
            pass
    with pytest.raises(ValueError, match="dampening"):
        with capturable_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1),
                                  torch.device("cpu")):
            pass


# --------------------------------------------------------------------------------------------
# GPU-only paths

def _graph_vs_eager(optimizer_name, autocast, channels_last):
    dev = torch.device("cuda")
    batches = [batch(n=2, seed=s, device=dev) for s in range(5)]
    lrs = [0.02, 0.02, 0.01, 0.01, 0.005] if optimizer_name == "sgd" else [1e-3, 1e-3, 5e-4, 5e-4, 2e-4]
    results = []
    for graphed in (False, True):
        model = tiny_model(device=dev)
        if channels_last:
            model = to_channels_last(model)
        opt = make_optimizer(optimizer_name, model.parameters(), lrs[0], momentum=0.9)
        loss_fn = DiceCELoss()
        step = None
        if graphed:
            step = GraphedTrainStep(model, loss_fn, opt, to_channels_last(batches[0][0]) if channels_last
                                    else batches[0][0], batches[0][1], autocast)
        losses = []
        for (image, label), lr in zip(batches, lrs):
            for group in opt.param_groups:
                group["lr"] = lr
            if step is not None:
                losses.append(step(image, label))
            else:
                opt.zero_grad(set_to_none=True)
                with autocast():
                    loss = loss_fn(model(to_channels_last(image) if channels_last else image), label)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        torch.cuda.synchronize()
        results.append((torch.stack(losses).float().cpu(), [p.detach().float().cpu() for p in model.parameters()]))
    (loss0, params0), (loss1, params1) = results
    return loss0, loss1, params0, params1


@cuda
@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_cuda_graph_step_matches_eager_fp32(optimizer_name):
    # fp32 without TF32 and with deterministic kernels: what is left is the fused (graph) vs
    # foreach (eager) optimizer arithmetic.
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = False, True
    try:
        loss0, loss1, params0, params1 = _graph_vs_eager(optimizer_name, nullcontext, channels_last=False)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = flags
    torch.testing.assert_close(loss1, loss0, rtol=1e-4, atol=1e-5)
    assert rel_err(torch.cat([p.flatten() for p in params1]), torch.cat([p.flatten() for p in params0])) < 1e-4
    assert not all(torch.equal(a, b) for a, b in zip(params0, _initial_params()))     # it did train


@cuda
def test_cuda_graph_step_matches_eager_bf16_channels_last():
    bf16 = partial(torch.autocast, device_type="cuda", dtype=torch.bfloat16)
    loss0, loss1, params0, params1 = _graph_vs_eager("sgd", bf16, channels_last=True)
    torch.testing.assert_close(loss1, loss0, rtol=2e-2, atol=1e-3)
    assert rel_err(torch.cat([p.flatten() for p in params1]), torch.cat([p.flatten() for p in params0])) < 2e-2


def _initial_params():
    return [p.detach().float().cpu() for p in tiny_model(device="cuda").parameters()]


@cuda
def test_graph_rejects_a_different_batch_shape():
    dev = torch.device("cuda")
    model = tiny_model(device=dev)
    opt = make_optimizer("sgd", model.parameters(), 0.01)
    image, label = batch(n=2, device=dev)
    step = GraphedTrainStep(model, DiceCELoss(), opt, image, label, warmup_iters=1)
    with pytest.raises(ValueError, match="captured for image"):
        step(*batch(n=1, device=dev))


@cuda
def test_fp16_with_scaler_close_to_fp32_on_cuda():
    dev = torch.device("cuda")
    image, label = batch(device=dev)
    model = tiny_model(device=dev)
    logits0, loss0, grads0 = forward_backward(model, image, label)
    scaler = torch.amp.GradScaler("cuda")
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.float16):
        logits1 = model(image)
        loss1 = DiceCELoss()(logits1, label)
    scaler.scale(loss1).backward()
    scale = scaler.get_scale()
    assert rel_err(logits1.float(), logits0) < 1e-2
    # All gradients as one vector, as in the bf16 test: the transposed convolutions' biases feed a
    # norm that nearly cancels them, so their own gradients are rounding noise (2.8x apart per
    # tensor on an H100, 2026-11-26) without mattering for the update.
    grads1 = {n: p.grad / scale for n, p in model.named_parameters()}
    assert rel_err(flat(grads1), flat(grads0)) < 5e-2


@cuda
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_fused_step_matches_foreach_on_cuda(name):
    """The same gradients into both optimizers, so that only the update kernels differ (gradients
    of two forward-backward passes differ by cuDNN's own rounding, which Adam turns into whole
    steps where a gradient is near zero: 0.0096 apart at lr 0.01 on an H100, 2026-11-26)."""
    dev = torch.device("cuda")
    models = [tiny_model(device=dev), tiny_model(device=dev)]
    opts = [make_optimizer(name, models[0].parameters(), 0.01, fused=False),
            make_optimizer(name, models[1].parameters(), 0.01, fused=True)]
    assert opts[1].param_groups[0]["fused"]
    for step in range(3):
        for model, opt in zip(models, opts):
            set_random_grads(model, step)
            opt.step()
    moved = [float((p - q).abs().max()) for p, q in zip(models[0].parameters(), tiny_model(device=dev).parameters())]
    assert min(moved) > 1e-4                           # every tensor was stepped
    for p0, p1 in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p1, p0)             # float32's default tolerances
