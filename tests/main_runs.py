"""Running main.py in the test process, and what its errors must look like (one line, named)."""
from __future__ import annotations

import re

import main as main_module
from runtime.arguments import parse_args, used_in  # noqa: F401 (used_in: for the tests)

SMALL = ["--filters", "4", "8", "16", "32", "32", "--input_shape", "32", "32", "64",
         "--val_input_shape", "32", "32", "64", "--num_workers", "0", "--seed", "3"]
TINY = ["--loader", "synthetic", "--filters", "2", "4", "4", "8", "8", "--input_shape", "32", "32", "32",
        "--val_input_shape", "32", "32", "32", "--normalization", "batchnorm", "--batch_size", "2",
        "--optimizer", "adam", "--learning_rate", "0.01", "--seed", "7", "--device", "cpu", "--num_workers", "0"]


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
