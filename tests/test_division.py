"""The MLPerf division decided by what the run does (runtime/division.py, called by
runtime/resolve.py): closed only for the reference's benchmark; open, with one line saying why,
for anything else; ``--submission_division closed`` on such a run refused in one line. The
decided value is what the MLPerf log carries, and the official compliance checker (ruleset
4.0.0) passes a real tiny run's log."""
import json
import subprocess
import sys

import pytest
import torch

import easy_data
from main_runs import TINY, call, one_line_error
from runtime import distributed as D
from runtime.arguments import UsageError, parse_args
from runtime.division import data_reasons, decide, flag_reasons
from runtime.resolve import resolve, resolve_data
from runtime.run_files import MLPERF_LOG

CPU = D.DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def _resolved(argv, capsys=None):
    return resolve(parse_args(["--data_dir", "/", "--device", "cpu", "--seed", "1", *argv]), CPU)


def test_the_reference_benchmarks_flags_are_closed(capsys):
    cfg = _resolved([])
    assert cfg.submission_division == "closed" and cfg.division_why == ""
    assert flag_reasons(cfg) == [] and data_reasons(168, 42) == []
    assert capsys.readouterr().out == ""
    # the rules' tunables stay closed
    assert _resolved(["--learning_rate", "2.0", "--momentum", "0.95", "--lr_warmup_epochs", "1000",
                      "--init_learning_rate", "0.001", "--batch_size", "7", "--ga_steps", "2",
                      "--weight_decay", "0.0001"]).submission_division == "closed"


@pytest.mark.parametrize("flags, named", [
    (["--filters", "4", "8", "16", "32", "32"], "--filters 4 8 16 32 32"),
    (["--input_shape", "64", "64", "64"], "--input_shape 64x64x64"),
    (["--optimizer", "adam"], "--optimizer adam"),
    (["--loader", "synthetic"], "--loader synthetic"),
    (["--semantics", "project"], "--semantics project"),
    (["--brightness", "centered"], "--brightness centered"),
    (["--include_background"], "--include_background"),
    (["--oversampling", "0.5"], "--oversampling 0.5"),
    (["--overlap", "0.25"], "--overlap 0.25"),
    (["--val_input_shape", "64", "64", "64"], "--val_input_shape 64x64x64"),
    (["--normalization", "batchnorm"], "--normalization batchnorm"),
    (["--quality_threshold", "0.5"], "--quality_threshold 0.5"),
])
def test_a_changed_run_is_open_with_one_line_and_closed_is_refused(flags, named, capsys):
    cfg = _resolved(flags)
    assert cfg.submission_division == "open" and named in cfg.division_why
    lines = capsys.readouterr().out.splitlines()
    assert lines == [cfg.division_why] and lines[0].startswith("MLPerf division: open, because")
    with pytest.raises(UsageError, match="--submission_division closed") as err:
        _resolved([*flags, "--submission_division", "closed"])
    assert named in str(err.value) and "\n" not in str(err.value)


def test_several_reasons_are_one_line():
    cfg = _resolved(["--filters", "4", "8", "16", "32", "32", "--input_shape", "64", "64", "64",
                     "--optimizer", "adam", "--loader", "synthetic"])
    assert cfg.division_why.count("\n") == 0 and "(and 3 more)" in cfg.division_why


def test_the_data_stage_opens_a_run_on_other_cases(capsys):
    cfg = _resolved([])
    summary = type("S", (), {"num_train": 10, "num_eval": 3, "train_bytes": 0})()
    opened = resolve_data(cfg, CPU, summary)
    assert opened.submission_division == "open" and "10 training and 3 evaluation cases" in opened.division_why
    assert capsys.readouterr().out.splitlines() == [opened.division_why]
    closed = _resolved(["--submission_division", "closed"])
    with pytest.raises(UsageError, match="10 training and 3 evaluation cases"):
        resolve_data(closed, CPU, summary)
    kits = type("S", (), {"num_train": 168, "num_eval": 42, "train_bytes": 0})()
    assert resolve_data(cfg, CPU, kits).submission_division == "closed"


def test_decide_known_answers():
    assert decide("auto", []) == ("closed", "")
    assert decide("open", []) == ("open", "")
    assert decide("auto", ["x"]) == ("open", "MLPerf division: open, because x")
    with pytest.raises(ValueError):
        decide("closed", ["x"])


def test_a_tiny_run_is_logged_open_and_passes_the_compliance_checker(tmp_path, capsys):
    """A real run (TINY: filters 2-8, 32³ patches, Adam, synthetic data) logs open, once, with
    the line saying why on stdout; its log passes the official checker, ruleset 4.0.0, once its
    tiny data's values are KiTS19's (as tests/test_clock.py does)."""
    log_dir = tmp_path / "logs"
    code, out, err = call([*TINY, "--log_dir", str(log_dir), "--epochs", "2", "--start_eval_at", "1",
                           "--evaluate_every", "1"], capsys)
    assert code in (0, 3), err[-2000:]
    assert sum(line.startswith("MLPerf division: open, because --filters 2 4 4 8 8") for line in out.splitlines()) == 1
    records = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in (log_dir / MLPERF_LOG).read_text().splitlines()]
    divisions = [r["value"] for r in records if r["key"] == "submission_division"]  # before init_stop: the checker
    # sets the initialisation time limit it checks there from it
    assert divisions == ["open"] and keys_before(records, "submission_division", "init_stop")
    keys = [r["key"] for r in records]
    assert "opt_initial_learning_rate" in keys and keys.count("seed") == 1
    fixed = {"train_samples": 168, "eval_samples": 42, "eval_accuracy": 0.95}
    lines = []
    for record in records:
        record["value"] = fixed.get(record["key"], record["value"])
        lines.append(":::MLLOG " + json.dumps(record))
    patched = tmp_path / "patched.log"
    patched.write_text("\n".join(lines) + "\n")
    check = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                            "--ruleset", "4.0.0", str(patched)], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
    output = check.stdout + check.stderr
    assert "SUCCESS" in output and "FAILED" not in output, output[-3000:]
    assert "open" in output  # checked as an open run


def keys_before(records, first, second) -> bool:
    keys = [r["key"] for r in records]
    return keys.index(first) < keys.index(second)
