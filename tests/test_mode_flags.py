"""Every flag means something where it is accepted (issue 42): the parser's table of the modes
each flag is used in (``runtime.mode.MODES``, each asked ``uses(flag)``), checked against ``main.py --help``; a
flag of this project's own given in a mode that does not use it is refused in one line naming it
and the mode, and a flag of the MLCommons reference is accepted there with one line saying it has
no effect (issue 48: the reference's one parser takes every flag in every mode); and evaluate
scores the network as trained (PyTorch) unless a backend is asked for, and says so."""
import argparse
import os
import re
import subprocess
import sys

import pytest
import torch

import fake_data
from main_runs import TINY, TRAINED, call, used_in
from runtime.arguments import (ACCEPTED_ONLY, REFERENCE_FLAGS, Config, build_parser, no_effect_line, parse_args,
                               unused_flag_errors)
from runtime.mode import FLAG_USES, MODES

PREDICT = "predict"
RUN_MODES = tuple(MODES)
# the modes that use each flag, by flag, as the modes answer it
FLAG_MODES = {flag: frozenset(mode.name for mode in MODES.values() if mode.uses(flag)) for flag in FLAG_USES}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")


def options_in_help(text: str) -> set[str]:
    """Every ``--option`` the help text lists (the usage line and the groups' rows)."""
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_]*)", text))


def missing_entries(help_text: str, parser: argparse.ArgumentParser) -> list[str]:
    """The options of ``help_text`` whose flag has no entry in the table."""
    dests = {option: action.dest for action in parser._actions for option in action.option_strings}
    return sorted(option for option in options_in_help(help_text)
                  if dests.get(option) not in FLAG_MODES and option not in ("--help", "--version"))


def test_every_flag_of_help_has_an_entry_and_every_entry_is_a_flag():
    text = subprocess.run([sys.executable, "main.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    parser = build_parser()
    assert len(options_in_help(text)) > 60  # the test reads the real help
    assert missing_entries(text, parser) == []
    dests = {action.dest for action in parser._actions if action.option_strings}
    assert set(FLAG_MODES) <= dests
    # a flag no mode reads is one the reference's scripts pass (accepted only)
    assert all((FLAG_MODES[name] or name in ACCEPTED_ONLY) and FLAG_MODES[name] <= set(RUN_MODES)
               for name in FLAG_MODES)


def test_a_flag_added_without_an_entry_is_found():
    parser = build_parser()
    parser.add_argument("--brand_new_flag", action="store_true", help="(new) added without a table entry")
    assert missing_entries(parser.format_help(), parser) == ["--brand_new_flag"]


def mode_config(mode: str, **changes) -> Config:
    exec_mode, _, benchmark = mode.partition(" ")
    return Config(exec_mode=exec_mode, benchmark=bool(benchmark), **changes)


@pytest.mark.parametrize("mode", RUN_MODES)
def test_every_flag_is_refused_exactly_in_the_modes_that_do_not_use_it(mode):
    """Given explicitly: a project's flag is refused (one message naming the flag and the mode)
    where the table says the mode does not use it, and a reference's flag is accepted there with
    one line saying it has no effect; either is accepted silently where the mode uses it; not
    given (its default): never refused, never named."""
    for name, modes in FLAG_MODES.items():
        config = mode_config(mode, explicit=frozenset({name}))
        errors, line = unused_flag_errors(config), no_effect_line(config)
        if mode in modes:
            assert errors == [] and line == "", (name, mode)
        elif name in REFERENCE_FLAGS:
            assert errors == [] and line.startswith(f"--{name} has no effect in --exec_mode {mode} ("), (name, line)
        else:
            assert len(errors) == 1 and f"--{name} does nothing in --exec_mode {mode} (" in errors[0], (name, errors)
            assert line == ""
    assert unused_flag_errors(mode_config(mode)) == [] and no_effect_line(mode_config(mode)) == ""


def test_the_reference_flags_are_the_flags_not_marked_new():
    """An oracle apart from the list: the help marks every flag the reference has not "(new)" (in
    its help or its group's title); the reference's flags are exactly the others."""
    parser = build_parser()
    unmarked = {action.dest for group in parser._action_groups for action in group._group_actions
                if action.option_strings and action.dest not in ("help", "version")
                and not (action.help or "").startswith("(new)") and "(new)" not in (group.title or "")}
    assert len(unmarked) > 30 and unmarked == REFERENCE_FLAGS


def test_the_predict_flags_are_predict_only_as_their_help_says():
    """An oracle apart from the table: a flag whose help starts "(new) predict:" is used by
    predict alone."""
    helps = {action.dest: action.help or "" for action in build_parser()._actions}
    predict_only = {name for name, text in helps.items() if text.startswith("(new) predict:")}
    assert {"input", "output_dir", "tta", "preview", "force", "save_probabilities"} <= predict_only
    assert all(FLAG_MODES[name] == {PREDICT} for name in predict_only)


def test_the_benchmark_budget_and_the_backend_flags_are_where_their_help_says():
    """The same oracle for "(new) --benchmark:" (the budget: both --benchmark modes only) and
    "(new) predict and evaluate" (the inference backend)."""
    helps = {action.dest: action.help or "" for action in build_parser()._actions}
    budget = {name for name, text in helps.items() if text.startswith("(new) --benchmark:")}
    backend = {name for name, text in helps.items() if text.startswith("(new) predict and evaluate")}
    assert {"benchmark_steps", "benchmark_seconds"} <= budget and "backend" in backend
    assert all(FLAG_MODES[name] == {"train --benchmark", "evaluate --benchmark"} for name in budget)
    assert all(FLAG_MODES[name] == {"evaluate", PREDICT} for name in backend)


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_predict_flags_in_evaluate_are_refused_naming_each_and_the_mode(tmp_path, capsys):
    """evaluate --tta --save_probabilities --output_dir X used to give the same score and write
    nothing: now one line naming the three flags and the mode, and nothing made."""
    (tmp_path / "c.pt").touch()
    out = tmp_path / "X"
    proc = subprocess.run([sys.executable, "main.py", "--exec_mode", "evaluate", "--data_dir", str(tmp_path),
                           "--load_ckpt_path", str(tmp_path / "c.pt"), "--tta", "--save_probabilities",
                           "--output_dir", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    for flag in ("--output_dir", "--tta", "--save_probabilities", "--exec_mode evaluate", "predict"):
        assert flag in proc.stderr, (flag, proc.stderr)
    assert not out.exists() and not (tmp_path / "results").exists()


@pytest.mark.parametrize("flags, named", [
    (["--benchmark_steps", "3"], ["--benchmark_steps", "--exec_mode train", "train --benchmark"]),
    (["--benchmark_seconds"], ["--benchmark_seconds", "--exec_mode train"]),
    (["--preview", "--force"], ["--preview", "--force", "--exec_mode train", "predict"]),
    (["--exec_mode", "evaluate", "--semantics", "project"], ["--semantics", "--exec_mode evaluate"]),
    (["--exec_mode", "evaluate", "--optimizer", "adam", "--fused_optimizer"],
     ["--fused_optimizer does nothing", "--exec_mode evaluate"]),
    (["--benchmark", "--ckpt_during_run"], ["--ckpt_during_run", "--exec_mode train --benchmark"]),
    (["--exec_mode", "predict", "--input", ".", "--output_dir", "o", "--cache", "memory"],
     ["--cache", "--exec_mode predict"]),
])
def test_flags_that_do_nothing_are_refused_in_one_line(tmp_path, capsys, flags, named):
    (tmp_path / "c.pt").touch()
    err = refused(["--load_ckpt_path", str(tmp_path / "c.pt"), *flags], capsys) if "--data_dir" in flags else \
        refused(["--data_dir", str(tmp_path), "--load_ckpt_path", str(tmp_path / "c.pt"), *flags], capsys)
    for name in named:
        assert name in err, (name, err)


def test_a_flag_given_with_its_default_value_is_refused_a_default_never(tmp_path, capsys):
    err = refused(["--data_dir", str(tmp_path), "--overlap", "0.5", "--tta", "--backend", "auto"], capsys)
    assert "--tta, --backend do nothing in --exec_mode train" in err
    assert parse_args(["--data_dir", str(tmp_path)]).backend == "auto"


def test_used_in_keeps_what_a_mode_uses():
    evaluate = used_in("evaluate", TINY)
    assert "--optimizer" not in evaluate and "--num_workers" not in evaluate and "--input_shape" not in evaluate
    assert evaluate[evaluate.index("--filters"):][:6] == ["--filters", "2", "4", "4", "8", "8"]
    assert "--batch_size" in used_in("evaluate --benchmark", TINY)  # the time-to-train prediction's batch
    assert used_in("train", TINY) == TINY


# ------------------------------------------------------------------ evaluate's backend


def test_evaluates_auto_is_pytorch_even_with_openvino_installed(tmp_path, monkeypatch):
    """The benchmark's Dice must not depend on an installed package: evaluate's --backend auto is
    PyTorch (the network as trained); --backend openvino asks for OpenVINO; predict's auto keeps
    taking OpenVINO where it can run."""
    import runtime.inference.backends as backend

    monkeypatch.setattr(backend, "openvino_missing", lambda int8=False: None)  # as if installed
    monkeypatch.setattr(backend, "_openvino_version", lambda: "X")
    (tmp_path / "c.pt").touch()
    from runtime.config import PredictOptions

    def decide_backend(argv):
        config = parse_args(argv)
        return backend.decide_backend(PredictOptions.of(config), config.mode, CPU)

    evaluate = ["--exec_mode", "evaluate", "--data_dir", str(tmp_path), "--load_ckpt_path", str(tmp_path / "c.pt")]
    auto, why = decide_backend(evaluate)
    assert auto == "torch" and why.startswith("--backend auto: PyTorch, the network as trained")
    assert decide_backend(evaluate + ["--backend", "openvino"])[0] == "openvino"
    predict = ["--exec_mode", "predict", "--input", str(tmp_path), "--output_dir", str(tmp_path / "o"),
               "--load_ckpt_path", str(tmp_path / "c.pt")]
    assert decide_backend(predict)[0] == "openvino"


def test_evaluate_prints_the_backend_it_used(tmp_path, capsys, shared_runs):
    run = shared_runs.run(TRAINED, capsys)
    assert run.code == 0
    code, out, _ = call(used_in("evaluate", TINY) + ["--exec_mode", "evaluate", "--load_ckpt_path",
                                                      str(run.folder / "c.pt"), "--log_dir", str(tmp_path / "e")],
                        capsys, fake_data.FakeData())
    assert code == 0 and out.startswith("mean_dice ")
    lines = [line for line in out.splitlines() if line.startswith("backend: ")]
    assert lines == ["backend: --backend auto: PyTorch, the network as trained (evaluate computes the "
                     "benchmark's Dice; --backend openvino asks for OpenVINO)"]
