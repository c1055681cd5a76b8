"""The plan in sections, the API first (issue 58, items 1, 2, 5 and 6).

* The plan answers no flag through its config: its decided values live in its sections
  (``network``, ``precision``, ``training``, ``inference``, ``data``), the flags in ``config``.
* Each builder takes the section it reads; handed the parsed flags by mistake it fails loudly
  (it never builds KiTS19's 3-class network for a plan it was not given).
* Below the command line no parameter is typed ``Config`` and no module imports an argument
  parser; predict's Python API builds no ``Config``.
* A data source's loaders are a typed pair read by the ``TrainLoader`` / ``EvalLoader``
  protocols, not by ``getattr``.

Oracles: the code's own syntax trees (``ast``), a counter on ``Config.__init__``, and known answers
on tiny shapes.
"""
from __future__ import annotations

import ast
import dataclasses
import os

import pytest
import torch

from main_runs import TINY
from runtime.arguments import parse_args
from runtime.distributed import DistInfo
from runtime.plan import InferencePlan, NetworkPlan, PrecisionPlan, RunPlan
from runtime.resolve import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))

# The command line and where its parsed Config meets the resolver: the parser, the value with its
# choices, the resolver, the lifecycle that main.py hands the Config to (and its table of modes,
# whose checks read the flags), and predict's source, which checks --input before the process
# group starts.
CONFIG_TYPED = {"runtime/arguments.py", "runtime/config.py", "runtime/resolve.py", "runtime/app.py",
                "runtime/mode.py", "runtime/predict/body.py"}
# The command lines that parse argv themselves (each a ``python -m`` entry or its argparse types).
PARSERS = {"runtime/arguments.py", "runtime/report/cli.py", "runtime/submission/cli.py", "data_loading/cli_types.py",
           "data_loading/synthetic.py"}
# What imports the command line's parser: the command line, and the lifecycle main.py runs (it
# rebuilds the run's recipe from the flags) and the submission's driver (it builds runs' argv).
PARSER_USERS = {"runtime/arguments.py", "runtime/app.py", "runtime/submission/driver.py"}


def product_files():
    for top in ("runtime", "data_loading", "model"):
        for folder, dirs, names in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in sorted(names):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    yield os.path.relpath(path, ROOT), ast.parse(open(path, encoding="utf-8").read(), path)


def names_config(annotation) -> bool:
    """Whether an annotation names ``Config`` (alone, in a union, or as a string)."""
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return "Config" in {n.id for n in ast.walk(ast.parse(annotation.value, mode="eval")) if isinstance(n, ast.Name)}
    return any(isinstance(n, ast.Name) and n.id == "Config" or isinstance(n, ast.Attribute) and n.attr == "Config"
               for n in ast.walk(annotation))


def config_parameters(tree) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            found += [f"{node.name}({a.arg})" for a in arguments if names_config(a.annotation)]
    return found


def test_the_plan_answers_no_flag_through_its_config():
    assert "__getattr__" not in vars(RunPlan)
    config = parse_args(TINY)
    plan = resolve(config, CPU)
    for flag in ("overlap", "val_input_shape", "batch_size", "amp", "filters", "label_set", "seed_source"):
        with pytest.raises(AttributeError):
            getattr(plan, flag)
    # each decided value lives in its section, the flags nothing decides in the config
    assert plan.inference.overlap == config.overlap and plan.config.batch_size == config.batch_size
    assert plan.network.filters == config.filters and plan.precision.amp is False
    assert {f.name for f in dataclasses.fields(RunPlan)} == {
        "config", "decisions", "device", "host_memory", "network", "precision", "inference", "training", "seed",
        "division", "data"}


def test_a_builder_handed_the_flags_fails_loudly():
    from runtime.build import autocast_factory, build_model

    config = parse_args(TINY)
    with pytest.raises(AttributeError):
        build_model(config, torch.device("cpu"))
    with pytest.raises(AttributeError):
        autocast_factory(config, torch.device("cpu"))
    plan = resolve(config, CPU)
    model = build_model(plan.network, torch.device("cpu"))
    assert model.output.conv.out_channels == plan.network.n_classes == 3


def test_no_parameter_is_typed_config_below_the_command_line():
    found = {path: params for path, tree in product_files() if path not in CONFIG_TYPED
             for params in [config_parameters(tree)] if params}
    assert found == {}


def test_the_checker_finds_a_config_parameter():
    tree = ast.parse("def f(a: Config, b: RunPlan | Config, c: 'Config | None', d: int): pass")
    assert config_parameters(tree) == ["f(a)", "f(b)", "f(c)"]


def test_no_module_below_the_command_line_imports_an_argument_parser():
    found = {}
    for path, tree in product_files():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            if "argparse" in modules and path not in PARSERS:
                found.setdefault(path, []).append("argparse")
            if "runtime.arguments" in modules and path not in PARSER_USERS:
                found.setdefault(path, []).append("runtime.arguments")
    assert found == {}


def test_predicts_python_api_builds_no_config(configs_built):
    """``Segmenter.from_network`` with ``PredictOptions``: the inference section's inputs, planned
    with no command line (no Config built), its window the options'."""
    from runtime.predict.api import PredictOptions, Segmenter

    segmenter = Segmenter.from_network(torch.nn.Conv3d(1, 3, 1), PredictOptions(device="cpu", window=(32, 32, 32),
                                                                                backend="torch", verbose=False))
    assert configs_built == [] and segmenter.plan.config is None
    assert segmenter.plan.inference.window == (32, 32, 32) and segmenter.plan.training is None
    assert segmenter.plan.network.label_set.n_classes == 3  # no checkpoint: KiTS19's


def test_predict_options_of_the_flags_are_what_was_given():
    from runtime.config import PredictOptions

    config = parse_args(["--exec_mode", "predict", "--input", ROOT, "--output_dir", "/tmp/o", "--load_ckpt_path",
                         __file__, "--filters", "4", "8", "16", "32", "32", "--tta"])
    options = PredictOptions.of(config)
    assert options.window is None and options.tta and options.filters == (4, 8, 16, 32, 32)
    assert options.normalization is None and options.architecture()[1] == {"filters"}


def test_a_data_sources_loaders_are_a_typed_pair(tmp_path):
    """The preprocessed folder's and the synthetic source's loaders: a ``Loaders`` pair whose
    training loader tells its step weights and samples trained, whose evaluation loader tells its
    volumes' shapes and scan regions (protocol methods, no getattr)."""
    import easy_data
    from data_loading.data_loader import PreprocessedData
    from data_loading.source import DataUse, Loaders, LoaderSettings
    from data_loading.synthetic_loader import SyntheticData

    folder = easy_data.write_dataset(str(tmp_path / "d"), range(4))
    settings = LoaderSettings(seed=1, cache="memory", patch=(32, 32, 32), batch_size=1, num_workers=0, prefetch=0,
                              window=(32, 32, 32))
    source = PreprocessedData(folder)
    source.summary(DataUse(patch=(32, 32, 32)))
    loaders = source.loaders(settings, 1, 0)
    assert isinstance(loaders, Loaders) and loaders.train is loaders[0] and loaders.eval is loaders[1]
    assert loaders.train.samples_trained == len(loaders.train) * settings.batch_size
    assert loaders.train.step_weights(0) is None
    shapes = loaders.eval.volume_shapes()
    assert len(shapes) == len(loaders.eval) and all(len(shape) == 3 for shape in shapes)
    synthetic = SyntheticData().loaders(settings, 1, 0)
    assert isinstance(synthetic, Loaders) and synthetic.eval.volume_shapes() is None
    assert synthetic.eval.scan_region("00000", (32, 32, 32)) is None


def test_the_sections_a_plan_has_follow_what_its_mode_does(tmp_path):
    """Training's plan has a training section; evaluate's and predict's none; every plan computes
    windows (training's evaluations too); the builders' sections are typed."""
    train = resolve(parse_args(TINY), CPU)
    assert train.training is not None and isinstance(train.inference, InferencePlan)
    assert isinstance(train.network, NetworkPlan) and isinstance(train.precision, PrecisionPlan)
    assert train.network.patch == parse_args(TINY).input_shape
