"""The one lifecycle of runtime.app: every mode's outputs are checked and locked before its body
runs, released after, and a refused or failed run leaves no empty folder behind. A mode added
to the table of modes (runtime.mode.MODES; docs/development.md: "An exec mode") gets all of it
without a line of start-up code."""
import os
import signal

import pytest

import runtime.app as app
import runtime.mode as M
from runtime.arguments import build_parser, parse_args
from runtime.outputs import LOCK_NAME, OutputError, RunLock


def evaluate_config(tmp_path, *flags):
    (tmp_path / "c.pt").touch()  # the flags' checks want it to exist; the scratch body never reads it
    return parse_args(["--exec_mode", "evaluate", "--data_dir", str(tmp_path), "--log_dir",
                       str(tmp_path / "new" / "logs"), "--load_ckpt_path", str(tmp_path / "c.pt"),
                       "--device", "cpu", *flags])


def scratch_mode(seen: dict, fail: bool = False) -> M.Mode:
    """A new mode: writes one folder (--log_dir), records what the lifecycle gave it."""

    def body(session: M.Session) -> int:
        lock = os.path.join(session.config.log_dir, LOCK_NAME)
        seen.update(locked=os.path.exists(lock), rank=session.dist.rank, world=session.dist.world_size,
                    handler=signal.getsignal(signal.SIGTERM), source=session.source)
        session.on_exit.callback(lambda: seen.update(cleanup_saw_lock=os.path.exists(lock)))
        if fail:
            raise RuntimeError("the body failed")
        return 7

    return M.Mode("evaluate", body, scores=True, outputs=lambda config: [M.Output(config.log_dir, "--log_dir")],
                  source=lambda config, data: "checked before the process group", checks=M.MODES["evaluate"].checks)


def test_a_new_mode_gets_the_whole_lifecycle(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setitem(M.MODES, "evaluate", scratch_mode(seen))
    before = signal.getsignal(signal.SIGTERM)
    config = evaluate_config(tmp_path)
    assert app.run(config) == 7
    assert seen["locked"] and seen["cleanup_saw_lock"]  # teardown callbacks run before the locks go
    assert (seen["rank"], seen["world"]) == (0, 1)
    assert seen["handler"] is not before and signal.getsignal(signal.SIGTERM) is before
    assert seen["source"] == "checked before the process group"
    assert not os.path.exists(os.path.join(config.log_dir, LOCK_NAME))


def test_a_failed_body_leaves_no_empty_folder_and_no_lock(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setitem(M.MODES, "evaluate", scratch_mode(seen, fail=True))
    with pytest.raises(RuntimeError, match="the body failed"):
        app.run(evaluate_config(tmp_path))
    assert seen["locked"] and seen["cleanup_saw_lock"]
    assert not (tmp_path / "new").exists()


def test_a_locked_output_refuses_the_run_before_its_body(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setitem(M.MODES, "evaluate", scratch_mode(seen))
    config = evaluate_config(tmp_path)
    os.makedirs(config.log_dir)
    with open(os.path.join(config.log_dir, LOCK_NAME), "w") as handle:  # a live holder: this process
        handle.write(f"{os.getpid()} {os.uname().nodename} now\n")
    with pytest.raises(OutputError, match="another run"):
        app.run(config)
    assert seen == {}


def test_every_exec_mode_is_one_table_entry(tmp_path):
    """--exec_mode's choices are the table's, and each command line selects its entry."""
    assert set(M.MODES) == {"train", "train --benchmark", "evaluate", "evaluate --benchmark", "predict"}
    choices = next(action.choices for action in build_parser()._actions if action.dest == "exec_mode")
    assert set(choices) == {"train", "evaluate", "predict"}
    (tmp_path / "c.pt").touch()
    d = str(tmp_path)
    for name in M.MODES:
        exec_mode, _, benchmark = name.partition(" ")
        argv = ["--exec_mode", exec_mode, "--load_ckpt_path", d + "/c.pt", *([benchmark] if benchmark else []),
                *(["--input", d, "--output_dir", d + "/o"] if exec_mode == "predict" else ["--data_dir", d])]
        assert parse_args(argv).mode is M.MODES[name]
    assert isinstance(app.take_lock(RunLock("unused", enabled=False), app.D.DistInfo(0, 0, 1, None)), RunLock)
