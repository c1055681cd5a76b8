"""The plan as a value (issue 50, item 1): every mode's plan is built by ``resolve()`` (and its data
stage) from a :class:`Config` that never changes after ``parse_args``, each decision recorded once,
and the plan answers every decided value in its sections (issue 58), every other flag through
its ``config``.

Oracle: the parsed config itself, deep-copied right after ``parse_args``; and a counter on
``Config.__init__``, through which every ``dataclasses.replace`` of a Config goes: none is built
between parsing and the plan. Tiny flags on the CPU, no training (the whole runs are
``tests/test_resolved_plan.py``'s).
"""
import copy
import dataclasses

import pytest
import torch

from checkpoints import architecture, write_checkpoint
from main_runs import TINY, used_in
from runtime.arguments import parse_args
from runtime.checkpoint import Saved, load_checkpoint, saved_plan
from runtime.distributed import DistInfo
from runtime.plan import RunPlan
from runtime.resolve import resolve, resolve_data

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
BUDGET = ["--epochs", "1", "--warmup_steps", "0", "--benchmark_steps", "1"]
SUMMARY = dataclasses.make_dataclass("Summary", [("num_train", int), ("num_eval", int), ("train_bytes", int),
                                                 ("synthetic", str)])(6, 2, 0, "synthetic")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "c.pt"
    config = dataclasses.replace(architecture((2, 4, 4, 8, 8), "batchnorm"), input_shape=(32, 32, 32))
    write_checkpoint(str(path), config)
    return str(path)


def argv_of(mode: str, checkpoint: str, tmp_path) -> list[str]:
    if mode == "predict":
        return ["--exec_mode", "predict", "--input", str(tmp_path), "--output_dir", str(tmp_path / "out"),
                "--load_ckpt_path", checkpoint, "--device", "cpu"]
    argv = used_in(mode, TINY)
    if mode.startswith("evaluate"):
        argv += ["--exec_mode", "evaluate", "--load_ckpt_path", checkpoint]
    return argv + (["--benchmark", *BUDGET] if mode.endswith("--benchmark") else [])


@pytest.mark.parametrize("mode", ["train", "train --benchmark", "evaluate", "evaluate --benchmark", "predict"])
def test_every_mode_plans_from_an_unchanged_config(mode, checkpoint, tmp_path, configs_built, capsys):
    config = parse_args(argv_of(mode, checkpoint, tmp_path))
    parsed = copy.deepcopy(config)
    configs_built.clear()
    saved = Saved(checkpoint, load_checkpoint(checkpoint), resume=False) if config.load_ckpt_path else None
    plan = resolve(config, CPU, None, saved)
    if mode != "predict":  # the data stage, after run_start
        plan = resolve_data(plan, CPU, SUMMARY)
    assert configs_built == []  # no Config replaced after parse_args
    assert config == parsed and plan.config is config
    assert isinstance(plan, RunPlan) and dataclasses.is_dataclass(plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.seed = 1
    names = [made.name for made in plan.decisions]
    assert len(names) == len(set(names))  # each decision recorded once
    # today's unrecorded decisions are recorded too
    assert {"device", "architecture", "window", "window_batch", "backend", "precision", "compile"} <= set(names)
    if mode != "predict":
        assert {"seed", "levers", "division", "cache"} <= set(names)
    # the training section and its decisions only where the mode trains (issue 58)
    assert ("cuda_graphs" in names) == (plan.training is not None) == mode.startswith("train")
    # OpenVINO's cache folder only where the mode chooses a backend: a training run's checkpoint
    # records no cache path of the user's
    assert ("cache_dir" in names) == (mode in ("evaluate", "predict")) == bool(plan.inference.cache_dir)
    # the plan answers the decided values in its sections, and every other flag through its config
    assert plan.device == "cpu" and plan.inference.window == plan.decision("window").value
    assert plan.inference.window_batch == plan.decision("window_batch").value and plan.inference.backend == "torch"
    assert plan.inference.overlap == config.overlap and plan.config.mode.trains == config.mode.trains
    assert plan.config.checkpoints == config.checkpoints and plan.config.explicit == config.explicit
    with pytest.raises(AttributeError):
        plan.no_such_flag  # noqa: B018
    with pytest.raises(AttributeError):  # no flag read through to the config (issue 58)
        plan.overlap  # noqa: B018


def test_predict_records_the_architecture_and_the_normalization_it_runs(checkpoint, tmp_path, configs_built):
    """The checkpoint's network flags, and batch norm for a sync-batch-norm network, are
    recorded decisions of the plan (the Config keeps what was given)."""
    sync = tmp_path / "sync.pt"
    write_checkpoint(str(sync), dataclasses.replace(architecture((2, 4, 4, 8, 8), "syncbatchnorm"),
                                                    input_shape=(32, 32, 32)))
    config = parse_args(argv_of("predict", str(sync), tmp_path))
    plan = resolve(config, CPU, None, Saved(str(sync), load_checkpoint(str(sync)), resume=False))
    assert config.normalization == "instancenorm" and config.filters != (2, 4, 4, 8, 8)  # the flags' defaults
    assert (plan.network.normalization, plan.network.filters) == ("batchnorm", (2, 4, 4, 8, 8))
    made = plan.decision("architecture")
    assert "syncbatchnorm" in made.why and "--normalization batchnorm" in made.value and str(sync) in made.why


def test_the_unfused_step_is_decided_in_the_plan(monkeypatch, tmp_path):
    """Where torch has no fused step (its probe fails), the plan decides the default step and
    says so; the builder obeys the plan and no longer swaps a failing fused step for another."""
    from runtime import optimizers

    monkeypatch.setattr(optimizers, "fused_step_runs", lambda cls, device_type: False)
    plan = resolve(parse_args(TINY + ["--fused_optimizer"]), CPU)
    made = plan.decision("fused_optimizer")
    assert plan.training.fused_optimizer is False and made.value is False and made.asked is True
    assert "no fused adam step on the CPU" in made.why

    class NoFused(torch.optim.SGD):
        def __init__(self, params, fused=None, **kwargs):
            if fused:
                raise RuntimeError("no fused kernel here")
            super().__init__(params, **kwargs)
    monkeypatch.setitem(optimizers.TORCH_OPTIMIZERS, "sgd", NoFused)
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(optimizers.make_optimizer("sgd", params, 0.1, fused=False), NoFused)
    with pytest.raises(RuntimeError, match="no fused kernel"):
        optimizers.make_optimizer("sgd", params, 0.1, fused=True)


def test_a_checkpoint_saves_the_flags_overlaid_with_the_plan(tmp_path):
    """The saved "config" keeps today's format: every flag, the decided values under the flags'
    names, and every decision under "plan" (read back by ``saved_plan``)."""
    from runtime.plan import saved_values

    config = parse_args(TINY + ["--amp"])
    plan = resolve_data(resolve(config, CPU), CPU, SUMMARY)
    values = saved_values(plan)
    assert values["seed"] == 7 and values["amp_dtype"] == "bf16" and values["num_train_cases"] == 6
    assert values["samples_per_epoch"] == plan.training.samples_per_epoch and values["filters"] == [2, 4, 4, 8, 8]
    assert set(saved_plan({"config": values})) == {made.name for made in plan.decisions}
    assert set(dataclasses.asdict(config)) <= set(values)


def test_compile_is_decided_in_the_plan_and_the_builders_obey(monkeypatch):
    """Where this torch cannot compile, the plan decides --compile off (recorded, one warning);
    the levers, the builders and the warm-up read the plan's value, not the flag."""
    from runtime import build, resolve as resolve_module

    monkeypatch.setattr(resolve_module, "compile_unavailable", lambda: "no compiler here")
    config = parse_args(TINY + ["--compile"])
    with pytest.warns(RuntimeWarning, match="--compile ignored: no compiler here"):
        plan = resolve(config, CPU)
    made = plan.decision("compile")
    assert config.compile is True and plan.precision.compile is False
    assert (made.value, made.asked) == (False, True) and "no compiler here" in made.why
    monkeypatch.setattr(build, "compile_model", lambda module, enabled: pytest.fail("compiled") if enabled else module)
    model = build.wrap_model(torch.nn.Linear(1, 1), plan.precision.compile, CPU)
    assert isinstance(model, torch.nn.Linear)
    assert not build.compiles_lazily(plan)
    # with a compiler, the flag runs
    monkeypatch.setattr(resolve_module, "compile_unavailable", lambda: None)
    assert resolve(config, CPU).precision.compile is True


@pytest.fixture
def plans_built(monkeypatch):
    """How many RunPlans were built (a ``dataclasses.replace`` of one builds one) since reset."""
    built = []
    original = RunPlan.__init__

    def counted(self, *args, **kwargs):
        built.append(kwargs)
        original(self, *args, **kwargs)
    monkeypatch.setattr(RunPlan, "__init__", counted)
    return built


def test_an_ensemble_runs_the_plan_unchanged_with_each_members_weights(checkpoint, tmp_path, monkeypatch,
                                                                       plans_built, configs_built):
    """Predict's ensemble: every member runs on the one resolved plan (no replace of the plan or
    the Config after resolve), the backend told each member's own checkpoint."""
    from runtime.inference import backends
    from runtime.predict.api import Segmenter

    second = tmp_path / "second.pt"
    write_checkpoint(str(second), dataclasses.replace(architecture((2, 4, 4, 8, 8), "batchnorm"),
                                                      input_shape=(32, 32, 32)), seed=1)
    config = parse_args(argv_of("predict", checkpoint, tmp_path) + ["--load_ckpt_path", str(second)])
    members = [Saved(path, load_checkpoint(path), resume=False) for path in (checkpoint, str(second))]
    plan = resolve(config, CPU, None, members[0], members[1:])
    told = []

    def convert(model, network, precision, inference, say, calibration=None, checkpoint=""):
        told.append(((network, precision, inference), checkpoint))
        return model
    monkeypatch.setitem(backends.BACKENDS, "torch", dataclasses.replace(backends.BACKENDS["torch"], convert=convert))
    plans_built.clear()
    configs_built.clear()
    segmenter = Segmenter.from_plan(plan, members, CPU.device, verbose=False)
    segmenter._inference(None)
    assert plans_built == [] and configs_built == []
    sections = (plan.network, plan.precision, plan.inference)
    assert told == [(sections, checkpoint), (sections, str(second))]


@pytest.mark.parametrize("mode", ["train", "evaluate"])
def test_one_process_syncbatchnorm_is_recorded_as_batchnorm(mode, tmp_path):
    """A one-process --normalization syncbatchnorm run computes batch norm (build_model converts
    only a distributed network): the architecture decision says so in every mode, and the model
    built has no SyncBatchNorm."""
    from runtime.build import build_model

    sync = tmp_path / "sync.pt"
    write_checkpoint(str(sync), dataclasses.replace(architecture((2, 4, 4, 8, 8), "syncbatchnorm"),
                                                    input_shape=(32, 32, 32)))
    config = parse_args(argv_of(mode, str(sync), tmp_path) + ["--normalization", "syncbatchnorm"])
    saved = Saved(str(sync), load_checkpoint(str(sync)), resume=False) if config.load_ckpt_path else None
    plan = resolve(config, CPU, None, saved)
    assert "one process: syncbatchnorm runs as batchnorm" in plan.why("architecture")
    model = build_model(plan.network, CPU.device, CPU.distributed)
    assert not any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())
    assert any(isinstance(m, torch.nn.BatchNorm3d) for m in model.modules())


def test_the_openvino_cache_needs_the_plans_folder():
    from runtime.inference.openvino.cache import cache_folder

    with pytest.raises(ValueError, match="cache_dir"):
        cache_folder("a.pt", "")
    assert cache_folder("a.pt", "/c").startswith("/c/openvino/a.pt-")


def test_the_default_steps_foreach_is_decided_from_the_plans_device():
    """The unfused step is multi-tensor (foreach) on CUDA, one tensor at a time on the CPU: decided
    from the device in the plan (recorded), not from the parameters when the optimizer is built."""
    from runtime import optimizers
    from runtime.resolve import decide_fused_optimizer

    config = parse_args(TINY)
    fused, foreach, made = decide_fused_optimizer(config, torch.device("cuda"))
    assert (fused, foreach, made.value) == (False, True, False) and "foreach" in made.why
    fused, foreach, made = decide_fused_optimizer(config, torch.device("cpu"))
    assert (fused, foreach) == (False, False) and "one tensor at a time" in made.why
    plan = resolve(config, CPU)
    assert plan.training.foreach_optimizer is False and plan.decision("fused_optimizer").why == made.why
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizers.make_optimizer("sgd", params, 0.1, foreach=True).defaults["foreach"] is True
    assert not optimizers.make_optimizer("sgd", params, 0.1).defaults["foreach"]


@pytest.mark.parametrize("saturate, fix", [(True, "enable"), (False, "first_layer")])
def test_int8s_overflow_fix_is_decided_once_in_the_plan(saturate, fix, tmp_path, checkpoint, monkeypatch):
    """NNCF's overflow fix (every layer where this CPU's int8 pairs saturate) is decided with the
    calibration in the plan and recorded; every calibration set is built with the plan's."""
    from runtime import resolve as resolve_module
    from runtime.inference import backends

    monkeypatch.setattr(resolve_module, "int8_pairs_saturate", lambda: saturate)
    monkeypatch.setattr(resolve_module, "decide_backend",
                        lambda options, mode, device, benchmark: ("openvino", "a stand-in"))
    plan = resolve(parse_args(argv_of("predict", checkpoint, tmp_path) + ["--int8"]), CPU,
                   None, Saved(checkpoint, load_checkpoint(checkpoint), resume=False))
    assert plan.inference.overflow_fix == fix
    assert ("every layer" if saturate else "first layer") in plan.why("calibration")
    made = []
    monkeypatch.setattr("runtime.inference.openvino.calibration.scan_calibration",
                        lambda window, scans, overflow_fix: made.append(overflow_fix))
    backends.BACKENDS["openvino"].calibrate(plan.inference, [("s", "s.nii.gz")])
    assert made == [fix]


def test_the_decisions_say_nothing_the_plan_says_their_lines_once(monkeypatch, capsys):
    """The decide_* functions are pure (their text is the decision's why); resolve says the
    lines once the plan is built, on rank 0's stdout, in the order decided: the bf16 answer,
    why --cuda_graphs is off, each lever's line, why the run is open."""
    from runtime import resolve as resolve_module
    from runtime.levers.gpu import graphs

    monkeypatch.setattr(resolve_module, "native_bf16", lambda: (False, "no bf16 here"))
    monkeypatch.setattr(graphs, "cuda_graphs_supported", lambda device, step, world: (False, "no GPU"))
    config = parse_args(TINY + ["--amp", "--amp_dtype", "bf16", "--cuda_graphs", "--channels_last"])
    amp, amp_dtype, _ = resolve_module.decide_amp(config.amp, config.amp_dtype, config.int8, config.mode.trains,
                                                  CPU.device)
    resolve_module.decide_cuda_graphs(config, CPU, amp, amp_dtype)
    arch, _ = resolve_module.decide_architecture(*resolve_module.asked_architecture(config), None)
    _, lines = resolve_module.decide_levers(config.mode.trains, config.channels_last, CPU, arch, amp, amp_dtype, False)
    assert capsys.readouterr().out == "" and lines
    plan = resolve(config, CPU)
    said = capsys.readouterr().out.splitlines()
    assert said[:2] == [plan.why("precision"), "--cuda_graphs off: no GPU"] and "no bf16 here" in said[0]
    assert said[2:2 + len(lines)] == list(lines) and said[-1] == plan.why("division")
    other = dataclasses.replace(CPU, rank=1)
    resolve(config, other)
    assert capsys.readouterr().out == ""  # rank 0 only
