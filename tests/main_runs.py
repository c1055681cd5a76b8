"""Running main.py in the test process, and what its errors must look like (one line, named);
training runs shared by the tests that read them (:class:`SharedRuns`, the ``shared_runs`` fixture)."""
from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import main as main_module
from runtime.arguments import parse_args, used_in  # noqa: F401 (used_in: for the tests)

SMALL = ["--filters", "4", "8", "16", "32", "32", "--input_shape", "32", "32", "64",
         "--val_input_shape", "32", "32", "64", "--num_workers", "0", "--seed", "3"]
TINY = ["--loader", "synthetic", "--filters", "2", "4", "4", "8", "8", "--input_shape", "32", "32", "32",
        "--val_input_shape", "32", "32", "32", "--normalization", "batchnorm", "--batch_size", "2",
        "--optimizer", "adam", "--learning_rate", "0.01", "--seed", "7", "--device", "cpu", "--num_workers", "0"]


# Runs that several tests read (shared_runs.run(argv, capsys): one run each per session; {run}: its folder).
# TRAINED: one epoch of TINY, evaluated, its log in {run}/l and its checkpoint {run}/c.pt.
TRAINED = TINY + ["--epochs", "1", "--start_eval_at", "1", "--log_dir", "{run}/l", "--save_ckpt_path", "{run}/c.pt"]


# used_in(mode, argv): argv without the flags that do nothing in mode (refused there, or named in a
# note): the training flags of TINY and SMALL, for an evaluate run of the same network.
EVAL_SMALL = used_in("evaluate", SMALL)  # the network, its window and the seed
EVAL_TINY = used_in("evaluate", TINY)


def call(argv, capsys, data_source=None):
    """main.py in this process: (exit code, stdout, stderr). ``data_source`` replaces the data
    (then errors are raised, not printed: ``run`` is called without ``main``'s handling)."""
    if data_source is None:
        try:
            code = main_module.main(argv)
        except SystemExit as exit_:
            code = exit_.code
    else:
        from runtime.app import run

        code = run(parse_args(argv), data=data_source)
    out, err = capsys.readouterr()
    return code, out, err


def run_main(capsys, *argv):
    """main.py in this process with ``argv``: (exit code, stdout, stderr)."""
    return call(list(argv), capsys)


def predict_runner(*flags):
    """The tests' one predict runner: ``predict(capsys, input_path, out, checkpoints, *extra)`` runs
    main.py's ``--exec_mode predict`` on ``input_path`` (a scan or a folder) into ``out`` with
    ``checkpoints`` (one path, or a list: an ensemble), then ``flags`` (a test file's own, such as
    its window), then ``extra``: (exit code, stdout, stderr)."""
    def predict(capsys, input_path, out, checkpoints, *extra):
        paths = [checkpoints] if isinstance(checkpoints, (str, os.PathLike)) else list(checkpoints)
        return run_main(capsys, "--exec_mode", "predict", "--input", str(input_path), "--output_dir", str(out),
                        "--load_ckpt_path", *map(str, paths), *flags, *extra)
    return predict


def call_main(argv, capsys, data_source):
    """Like main.py (one line on stderr and exit 1 for a user error) with ``data_source``."""
    from runtime.app import run

    try:
        code = run(parse_args(argv), data=data_source)
    except main_module.user_errors() as exc:
        print(f"main.py: error: {main_module.one_line(exc)}", file=__import__("sys").stderr)
        code = 1
    out, err = capsys.readouterr()
    return code, out, err


PROGRESS = re.compile(r"^.+: \d+/[\d?]+ done \(|^(warm-up|timed) step ")


def one_line_error(code, err, *named):
    """One error line on stderr (progress lines aside), naming each of ``named``."""
    assert code != 0
    messages = [line for line in err.splitlines() if line.strip() and not PROGRESS.match(line)]
    assert "Traceback" not in err and len(messages) == 1, err
    for name in named:
        assert str(name) in err, (name, err)


def official_compliance_output(records, tmp_path, fixed) -> str:
    """The official 4.0.0 compliance checker's output on ``records`` (MLLOG dicts) with the values
    of the keys in ``fixed`` replaced (a tiny run's counts and Dice set to the benchmark's)."""
    import json
    import subprocess
    import sys

    lines = []
    for record in records:
        record["value"] = fixed.get(record["key"], record["value"])
        lines.append(":::MLLOG " + json.dumps(record))
    patched = tmp_path / "patched.log"
    patched.write_text("\n".join(lines) + "\n")
    check = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                            "--ruleset", "4.0.0", str(patched)], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
    return check.stdout + check.stderr


@dataclass
class Run:
    """One finished main.py run: its exit code, stdout and stderr, the folder its ``{run}`` flags
    wrote into, and (start, end) of every checkpoint write (``time.time()``)."""
    code: int
    out: str
    err: str
    folder: Path
    save_times: list = field(default_factory=list)

    def copy_to(self, destination) -> Path:
        """The run's folder copied to ``destination`` (for a test that writes into it)."""
        shutil.copytree(self.folder, destination, symlinks=True)
        return Path(destination)


class SharedRuns:
    """Training runs through main.py (``call`` with a data source) that several tests read: one run
    per distinct command line in a test session, run by the first test that asks for it (its
    ``capsys`` captures the output, which every later test reads back from the :class:`Run`).

    ``{run}`` in a flag stands for the run's own folder: ``shared_runs.run(TINY + ["--epochs", "1",
    "--log_dir", "{run}/l"], capsys)``. The folder is the run's, read-only to the tests: a test
    that writes into it (a second run, a file added) works on ``Run.copy_to(tmp_path / ...)``."""

    def __init__(self, root):
        self.root, self.runs = Path(root), {}

    def run(self, argv, capsys, data=None) -> Run:
        """The run of ``argv`` (with ``data``, a zero-argument factory of the data source, default
        ``fake_data.FakeData``), made now if no test made it before."""
        import fake_data
        import runtime.checkpoint as checkpoint
        from pytest import MonkeyPatch

        data = data or fake_data.FakeData
        key = (tuple(argv), f"{data.__module__}.{data.__qualname__}")
        if key not in self.runs:
            folder = self.root / f"run{len(self.runs)}"
            folder.mkdir(parents=True)
            save_times, original = [], checkpoint.atomic_save

            def timed(obj, path):
                start = time.time()
                original(obj, path)
                save_times.append((start, time.time()))

            capsys.readouterr()  # what the test printed before is not the run's
            with MonkeyPatch.context() as patch:
                patch.setattr(checkpoint, "atomic_save", timed)
                code, out, err = call([a.replace("{run}", str(folder)) for a in argv], capsys, data())
            self.runs[key] = Run(code, out, err, folder, save_times)
        return self.runs[key]
