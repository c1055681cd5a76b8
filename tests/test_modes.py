"""One Mode object per exec mode (issue 50, item 3): code asks the mode what it does, never its
name; a new mode is one entry of runtime.mode.MODES (its flags, its checks, its outputs, its
body), and the table imports no product (a body is "module:function", imported when it runs)."""
import ast
import os

import pytest

import runtime.app as app
import runtime.mode as M
from runtime.arguments import REFERENCE_FLAGS, no_effect_line, parse_args
from runtime.outputs import LOCK_NAME

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCTS = ("runtime.training", "runtime.evaluate", "runtime.predict", "runtime.report", "runtime.submission")


def python_files(*tops):
    for top in tops:
        path = os.path.join(ROOT, top)
        if path.endswith(".py"):
            yield path
            continue
        for folder, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            yield from (os.path.join(folder, name) for name in names if name.endswith(".py"))


def rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def mode_name_tests(path: str) -> list[str]:
    """The places of ``path`` that test a mode by its flags: ``x.exec_mode`` compared, a config's
    ``.benchmark`` or ``.is_train`` read (``config``, ``cfg``, ``self`` or ``*.config``)."""
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Attribute) and o.attr == "exec_mode" for o in operands):
                found.append(f"{rel(path)}:{node.lineno} exec_mode compared")
        elif isinstance(node, ast.Attribute) and node.attr in ("benchmark", "is_train"):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in ("config", "cfg", "self")) or \
                    (isinstance(owner, ast.Attribute) and owner.attr == "config"):
                found.append(f"{rel(path)}:{node.lineno} .{node.attr}")
    return found


def test_code_asks_the_mode_not_its_name():
    """Outside the table of modes (runtime/mode.py) and Config.mode (runtime/config.py), no code
    compares --exec_mode or reads --benchmark to know what the run does."""
    allowed = {os.path.join(ROOT, "runtime", "mode.py"), os.path.join(ROOT, "runtime", "config.py")}
    found = [place for path in python_files("runtime", "data_loading", "benchmarks", "main.py")
             if path not in allowed for place in mode_name_tests(path)]
    assert found == []
    arguments = [place for place in mode_name_tests(os.path.join(ROOT, "runtime", "config.py"))]
    assert all(".benchmark" in place or ".is_train" in place for place in arguments), arguments
    assert len(arguments) <= 1  # Config.mode: the one place the flags choose the mode


def test_the_checker_finds_a_mode_tested_by_name(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("if config.exec_mode == 'predict' or cfg.benchmark or session.config.is_train:\n    pass\n"
                    "torch.backends.cudnn.benchmark = config.mode.benchmark\n")
    assert [place.split(" ", 1)[1] for place in mode_name_tests(str(path))] == [
        "exec_mode compared", ".benchmark", ".is_train"]


def imported_modules(path: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.update([node.module] + [f"{node.module}.{alias.name}" for alias in node.names])
    return found


def test_the_lifecycle_and_the_table_of_modes_import_no_product():
    for name in ("app.py", "mode.py", "arguments.py", "config.py"):
        imported = imported_modules(os.path.join(ROOT, "runtime", name))
        assert not [m for m in imported if m.startswith(PRODUCTS)], (name, imported)


# Each mode's product (docs/development.md's layout): --benchmark, timed in either mode, is training's.
PRODUCT_OF = {"train": "runtime.training", "train --benchmark": "runtime.training", "evaluate": "runtime.evaluate",
              "evaluate --benchmark": "runtime.training", "predict": "runtime.predict"}


@pytest.mark.parametrize("name", sorted(M.MODES))
def test_every_mode_names_its_body_in_its_products_folder(name):
    mode = M.MODES[name]
    assert mode.name == name and isinstance(mode.body, str) and set(PRODUCT_OF) == set(M.MODES)
    body = app.function(mode.body)
    assert callable(body) and body.__module__.startswith(PRODUCT_OF[name] + ".")
    assert mode.body.startswith(body.__module__ + ":")
    assert callable(app.function(mode.source))
    assert mode.checks  # every mode checks its flags


def test_what_each_mode_does():
    """The table answers what the branches used to ask of the names."""
    does = {name: {what for what in ("benchmark", "trains", "scores", "predicts", "chooses_backend", "mlperf_run",
                                     "saves_checkpoints", "writes_metrics") if getattr(mode, what)}
            for name, mode in M.MODES.items()}
    assert {name for name, what in does.items() if "trains" in what} == {"train", "train --benchmark"}
    assert {name for name, what in does.items() if "benchmark" in what} == {"train --benchmark", "evaluate --benchmark"}
    assert {name for name, what in does.items() if "mlperf_run" in what} == {"train"}
    assert {name for name, what in does.items() if "predicts" in what} == {"predict"}
    # --backend auto: PyTorch where the mode computes the benchmark's Dice, OpenVINO may serve predict
    assert {name for name, mode in M.MODES.items() if mode.chooses_backend and mode.scores_as_trained} == {"evaluate"}
    assert [name for name, mode in M.MODES.items() if not mode.stop_at_once] == ["train"]  # saves at the next step
    assert M.mode_of("predict", True) is M.MODES["predict"]  # its checks refuse --benchmark


def test_a_new_mode_is_one_entry(tmp_path, monkeypatch, capsys):
    """A mode added to the table alone: --exec_mode takes it, its checks run, the flags it does not
    use are refused (its own) or named (the reference's), and the lifecycle runs its body."""
    seen = {}

    def body(session: M.Session) -> int:
        seen.update(locked=os.path.exists(os.path.join(session.config.log_dir, LOCK_NAME)),
                    mode=session.mode, source=session.source)
        return 5

    def needs_seed(cfg) -> list[str]:
        return M.problems((cfg.seed >= 0, "--exec_mode inspect needs --seed"))

    inspect = M.Mode("inspect", body, scores=True, outputs=lambda config: [M.Output(config.log_dir, "--log_dir")],
                     checks=(needs_seed,))
    monkeypatch.setitem(M.MODES, "inspect", inspect)
    base = ["--exec_mode", "inspect", "--data_dir", str(tmp_path), "--log_dir", str(tmp_path / "logs")]
    config = parse_args(base + ["--seed", "3", "--optimizer", "adam"])
    assert config.mode is inspect and "seed" in inspect.flags and "optimizer" not in inspect.flags
    assert "optimizer" in REFERENCE_FLAGS and no_effect_line(config).startswith(
        "--optimizer has no effect in --exec_mode inspect (")
    for flags, message in ((["--seed", "3", "--tta"], "--tta does nothing in --exec_mode inspect (it applies to "
                                                      "predict); drop it"),
                           ([], "--exec_mode inspect needs --seed")):
        with pytest.raises(SystemExit):
            parse_args(base + flags)
        assert capsys.readouterr().err.endswith(f"error: {message}\n")
    assert app.run(config, data="the data") == 5
    assert seen == {"locked": True, "mode": inspect, "source": "the data"}
    assert not os.path.exists(os.path.join(config.log_dir, LOCK_NAME))
