"""One resolved plan per run (issue 43, item 2): every mode runs the config ``resolve()`` returned
(``resolve_data``, the data stage of resolving, the only later change), that config records its
decisions (``runtime.plan``), and a trained checkpoint records the plan that ran.

The real entry point on tiny synthetic data, with hooks on the functions that hand the config
on: ``resolve`` and ``resolve_data`` (what they return), ``build_components`` (the config it
gets and the one its components carry) and each mode's body (the config it runs with). The CPU
is made to look as if it had no native bf16 (``runtime.levers.cpu.isa.cpu_flags``), so ``--amp`` training
falls back to float32: a decision that once was taken after ``resolve`` by replacing the config.
"""
import copy
import sys

import pytest
import torch

import fake_data
from checkpoints import reference_format_checkpoint, unet
from main_runs import TINY, call, used_in
from runtime import app
from runtime.levers.cpu import isa
from runtime.checkpoint import load_checkpoint, saved_plan
from runtime.optimizers import fused_step
from runtime.plan import RunPlan

CPU = torch.device("cpu")
TRAIN_FLAGS = ["--amp", "--fused_optimizer"]  # --amp: float32 on a CPU without native bf16


def hook(monkeypatch, module_name: str, name: str, wrapper) -> None:
    """``module_name.name`` replaced by ``wrapper(original)`` there and in every loaded
    ``runtime`` module that imported it (wherever a mode's body lives)."""
    module = sys.modules.get(module_name) or __import__(module_name, fromlist=[name])
    original = getattr(module, name)
    wrapped = wrapper(original)
    for loaded in list(sys.modules.values()):
        if getattr(loaded, "__name__", "").startswith("runtime") and getattr(loaded, name, None) is original:
            monkeypatch.setattr(loaded, name, wrapped)


@pytest.fixture(autouse=True)
def no_native_bf16(monkeypatch):
    monkeypatch.setattr(isa, "cpu_flags", lambda *args: set())  # no avx512_bf16, no amx_bf16


@pytest.fixture
def seen(monkeypatch):
    return install_hooks(monkeypatch)


def install_hooks(monkeypatch) -> dict:
    """What each stage handed on, by stage: ``resolved``, ``data_in``/``data_out`` (resolve_data),
    ``build_in``/``built`` (build_components), ``body`` (the config the mode ran with)."""
    import runtime.predict.folder  # noqa: F401 - loaded, so that its predict_scans is hooked
    import runtime.training.benchmark  # noqa: F401
    from runtime.mode import MODES

    for mode in MODES.values():  # every body's module loaded (app imports it when its mode runs), so hooked
        app.function(mode.body)

    seen: dict[str, list] = {}

    def returns(stage):
        def wrapper(original):
            def wrapped(*args, **kwargs):
                parsed = copy.deepcopy(args[0])
                result = original(*args, **kwargs)
                seen.setdefault(stage, []).append(result)
                seen.setdefault("parsed", []).append((args[0], parsed))
                return result
            return wrapped
        return wrapper

    def data_stage(original):
        def wrapped(config, *args, **kwargs):
            seen.setdefault("data_in", []).append(config)
            result = original(config, *args, **kwargs)
            seen.setdefault("data_out", []).append(result)
            return result
        return wrapped

    def build(original):
        def wrapped(config, *args, **kwargs):
            seen.setdefault("build_in", []).append(config)
            components = original(config, *args, **kwargs)
            seen.setdefault("built", []).append(components.plan)
            return components
        return wrapped

    def body(position):
        def wrapper(original):
            def wrapped(*args, **kwargs):
                given = args[position]
                plan = given if isinstance(given, RunPlan) else getattr(given, "plan", given)
                seen.setdefault("body", []).append(plan)
                return original(*args, **kwargs)
            return wrapped
        return wrapper

    hook(monkeypatch, "runtime.resolve", "resolve", returns("resolved"))
    hook(monkeypatch, "runtime.resolve", "resolve_data", data_stage)
    hook(monkeypatch, "runtime.build", "build_components", build)
    for module, name, position in (("runtime.training.loop", "run_training", 0),
                                   ("runtime.clocked.evaluation", "run_evaluation", 0),
                                   ("runtime.training.benchmark", "benchmark_train", 0),
                                   ("runtime.training.benchmark", "benchmark_evaluate", 0),
                                   ("runtime.predict.folder", "predict_scans", 0)):
        hook(monkeypatch, module, name, body(position))
    return seen


def assert_runs_as_resolved(seen, data_stage: bool = True) -> None:
    """The body ran with resolve's config (plus its data stage), and nothing in between replaced it."""
    (resolved,) = seen["resolved"]
    if data_stage:
        assert seen["build_in"] == [resolved] and seen["built"] == [resolved]
        assert seen["data_in"] == [resolved]
        resolved = seen["data_out"][-1]
    assert seen["body"] and all(config == resolved for config in seen["body"])
    # the flags parsed are the plan's, unchanged to the end of the run (issue 50)
    ((config, parsed),) = seen["parsed"]
    assert resolved.config is config and config == parsed


def names(plan) -> set:
    return {decision.name for decision in plan.decisions}


def train(tmp_path, capsys, *extra) -> tuple[str, str]:
    """A tiny training run's (stdout, stderr); its checkpoint is ``tmp_path / "c.pt"``."""
    argv = TINY + TRAIN_FLAGS + ["--epochs", "1", "--start_eval_at", "1", "--log_dir", str(tmp_path / "t"),
                                 "--save_ckpt_path", str(tmp_path / "c.pt"), *extra]
    code, out, err = call(argv, capsys, fake_data.FakeData())
    assert code == 0, err
    return out, err


def test_training_runs_the_resolved_config(tmp_path, capsys, seen):
    out, err = train(tmp_path, capsys)
    assert_runs_as_resolved(seen)
    (resolved,) = seen["resolved"]
    assert resolved.precision.amp is False and resolved.decision("precision").value == "float32"
    assert out.count("training in float32 instead") == 1  # said once, as before
    assert "plan: " not in out + err  # the whole plan only with --verbose
    assert {"precision", "fused_optimizer", "host_memory", "backend", "window", "window_batch", "seed",
            "cuda_graphs", "division"} <= names(resolved)
    assert "cache" in names(seen["data_out"][-1])


def test_benchmark_training_runs_the_resolved_config(capsys, seen):
    argv = TINY + TRAIN_FLAGS + ["--benchmark", "--epochs", "1", "--warmup_steps", "0", "--benchmark_steps", "1"]
    code, _, err = call(argv, capsys, fake_data.FakeData())
    assert code == 0, err
    assert_runs_as_resolved(seen)
    assert seen["resolved"][0].decision("precision").value == "float32"


def trained(tmp_path, capsys) -> str:
    train(tmp_path, capsys)
    return str(tmp_path / "c.pt")


@pytest.mark.parametrize("benchmark", [False, True], ids=["evaluate", "benchmark-evaluate"])
def test_evaluation_runs_the_resolved_config(tmp_path, capsys, monkeypatch, benchmark):
    checkpoint = trained(tmp_path, capsys)
    seen = install_hooks(monkeypatch)  # the evaluation's stages only
    mode = "evaluate --benchmark" if benchmark else "evaluate"
    argv = used_in(mode, TINY) + ["--exec_mode", "evaluate", "--load_ckpt_path", checkpoint]
    argv += ["--benchmark", "--epochs", "1", "--warmup_steps", "0", "--benchmark_steps", "1"] if benchmark else \
        ["--log_dir", str(tmp_path / "e")]
    code, _, err = call(argv, capsys, fake_data.FakeData())
    assert code == 0, err
    assert_runs_as_resolved(seen)
    assert {"host_memory", "backend", "window", "window_batch", "division"} <= names(seen["resolved"][0])


def test_predict_runs_the_resolved_config(tmp_path, capsys, seen, monkeypatch):
    from test_predict_provenance import install_cheap_network, predict, scan_folder, trained_on

    install_cheap_network(monkeypatch)
    checkpoint = trained_on(tmp_path / "c.pt", (32, 32, 32))
    code, _, err = predict(capsys, scan_folder(tmp_path / "in"), tmp_path / "out", checkpoint)
    assert code == 0, err
    assert_runs_as_resolved(seen, data_stage=False)
    resolved = seen["resolved"][0]
    assert resolved.decision("window").why == "from the checkpoint's training patch"
    assert {"precision", "host_memory", "backend", "window", "window_batch"} <= names(resolved)


# The decisions a trained checkpoint records; runtime/levers adds its own ("levers").
RECORDED = ("precision", "fused_optimizer", "host_memory", "backend", "window", "window_batch", "seed",
            "cuda_graphs", "levers", "division", "cache")


def test_a_trained_checkpoint_records_the_plan_that_ran(tmp_path, capsys):
    train(tmp_path, capsys)
    plan = saved_plan(load_checkpoint(str(tmp_path / "c.pt")))  # weights_only: plain data
    assert set(RECORDED) <= set(plan)
    precision = plan["precision"]
    assert precision["value"] == "float32" and precision["asked"] == "--amp --amp_dtype auto"
    assert "no native bf16" in precision["why"] and "float32 instead" in precision["why"]
    assert plan["fused_optimizer"]["asked"] is True
    assert plan["fused_optimizer"]["value"] == fused_step("adam", CPU)[0]
    assert plan["backend"]["value"] == "torch" and plan["backend"]["why"]
    assert plan["division"]["value"] == "open" and plan["division"]["asked"] == "auto" and plan["division"]["why"]
    assert plan["seed"] == {"name": "seed", "value": 7, "why": "--seed", "asked": 7}
    assert plan["window"]["value"] == (32, 32, 32)


def test_checkpoints_without_a_plan_still_load(tmp_path):
    from checkpoints import architecture

    path = tmp_path / "reference.pt"
    reference_format_checkpoint(str(path), unet(architecture((2, 4, 4, 8, 8))).state_dict())
    assert saved_plan(load_checkpoint(str(path))) == {}
    assert saved_plan({"config": {"optimizer": "sgd"}}) == {}  # written before the plan


def test_checkpoints_with_the_old_reason_fields_still_load(tmp_path, capsys):
    """A checkpoint written when Config still had its reason sentences (backend_why, sw_batch_note,
    division_not_closed; now the plan's) evaluates: its saved config is read by name, never
    rebuilt into a Config, so keys Config no longer has are left alone."""
    checkpoint = trained(tmp_path, capsys)
    old = load_checkpoint(checkpoint)
    old["config"].update(backend_why="PyTorch (training and --benchmark run PyTorch)", sw_batch_note="",
                         division_not_closed="")
    torch.save(old, checkpoint)
    argv = used_in("evaluate", TINY) + ["--exec_mode", "evaluate", "--load_ckpt_path", checkpoint,
                                        "--log_dir", str(tmp_path / "e")]
    code, out, err = call(argv, capsys, fake_data.FakeData())
    assert code == 0, err
    assert "backend: --backend auto: PyTorch, the network as trained" in out


def test_verbose_says_every_decision_once(tmp_path, capsys):
    _, err = train(tmp_path, capsys, "--verbose")
    lines = [line for line in err.splitlines() if line.startswith("plan: ")]
    said = [line.split(":")[1].strip() for line in lines]
    assert sorted(said) == sorted(set(said)) and set(RECORDED) <= set(said)
    assert "plan: precision: float32 (bf16: " in "\n".join(lines)
