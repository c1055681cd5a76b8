"""The MLPerf division decided by what the run does (runtime/division.py, called by
runtime/resolve.py): closed only for the reference's benchmark; open, with one line saying why,
for anything else; ``--submission_division closed`` on such a run refused in one line. The
decided value is what the MLPerf log carries, and the official compliance checker (ruleset
4.0.0) passes a real tiny run's log."""
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import easy_data
from main_runs import TINY, call, official_compliance_output, one_line_error
from runtime import distributed as D
from runtime.arguments import UsageError, parse_args
from runtime.division import data_reasons, decide, flag_reasons
from runtime.plan import DataPlan
from runtime.resolve import resolve, resolve_data
from runtime.run_files import MLPERF_LOG, NOT_CLOSED, RUN_DESCRIPTION

CPU = D.DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def _resolved(argv, capsys=None):
    return resolve(parse_args(["--data_dir", "/", "--device", "cpu", "--seed", "1", *argv]), CPU)


def test_the_reference_benchmarks_flags_are_closed(capsys):
    cfg = _resolved([])
    assert cfg.division == "closed" and cfg.why("division") == ""
    assert flag_reasons(cfg.config, cfg.network.architecture, cfg.inference.window) == []
    assert data_reasons(168, 42) == []
    assert capsys.readouterr().out == ""
    # the rules' tunables stay closed
    assert _resolved(["--learning_rate", "2.0", "--momentum", "0.95", "--lr_warmup_epochs", "1000",
                      "--init_learning_rate", "0.001", "--batch_size", "7", "--ga_steps", "2",
                      "--weight_decay", "0.0001"]).division == "closed"


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
    assert cfg.division == "open" and named in cfg.why("division")
    lines = capsys.readouterr().out.splitlines()
    assert lines == [cfg.why("division")] and lines[0].startswith("MLPerf division: open, because")
    with pytest.raises(UsageError, match="--submission_division closed") as err:
        _resolved([*flags, "--submission_division", "closed"])
    assert named in str(err.value) and "\n" not in str(err.value)


def test_several_reasons_are_one_line():
    cfg = _resolved(["--filters", "4", "8", "16", "32", "32", "--input_shape", "64", "64", "64",
                     "--optimizer", "adam", "--loader", "synthetic"])
    assert cfg.why("division").count("\n") == 0 and "(and 3 more)" in cfg.why("division")


def test_the_data_stage_opens_a_run_on_other_cases(capsys):
    cfg = _resolved([])
    summary = type("S", (), {"num_train": 10, "num_eval": 3, "train_bytes": 0, "synthetic": ""})()
    opened = resolve_data(cfg, CPU, summary)
    assert opened.division == "open" and "10 training and 3 evaluation cases" in opened.why("division")
    assert capsys.readouterr().out.splitlines() == [opened.why("division")]
    closed = _resolved(["--submission_division", "closed"])
    with pytest.raises(UsageError, match="10 training and 3 evaluation cases"):
        resolve_data(closed, CPU, summary)
    kits = type("S", (), {"num_train": 168, "num_eval": 42, "train_bytes": 0, "synthetic": ""})()
    assert resolve_data(cfg, CPU, kits).division == "closed"


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
    output = official_compliance_output(records, tmp_path, fixed)
    assert "SUCCESS" in output and "FAILED" not in output, output[-3000:]
    assert "open" in output  # checked as an open run


def keys_before(records, first, second) -> bool:
    keys = [r["key"] for r in records]
    return keys.index(first) < keys.index(second)


# -- data that is not KiTS19 in a run whose log already says closed (issue 41, item 3) ---------------------------

SYNTHETIC_WHY = "synthetic data is not KiTS19"


def marked_dataset(folder) -> str:
    """A preprocessed-format folder (tests/easy_data.py, ids 0-3) carrying the generator's
    synthetic marker, as preprocess_dataset.py copies it (tests/test_preprocess.py)."""
    from data_loading.synthetic import write_marker

    easy_data.write_dataset(str(folder), range(4))
    write_marker(str(folder), seed=0, size="small", ids=range(4))
    return str(folder)


def test_the_data_stage_opens_a_run_on_synthetic_data_with_kits19s_counts(tmp_path, capsys):
    """168/42 synthetic cases (python -m data_loading.synthetic --cases 210) used to pass as
    KiTS19: the folder's marker, listed by the data stage after run_start, makes the run open;
    a run whose log already says closed keeps the reason for its not_closed event, and
    --submission_division closed is refused in one line naming it."""
    from data_loading.data_loader import PreprocessedData
    from data_loading.source import DataSummary, DataUse

    patch = parse_args(["--data_dir", "/", "--device", "cpu", "--input_shape", "32", "32", "64"])
    marked = PreprocessedData(marked_dataset(tmp_path / "marked")).summary(DataUse.of_flags(patch))
    use = DataUse.of_flags(patch)
    plain = PreprocessedData(easy_data.write_dataset(str(tmp_path / "plain"), range(4))).summary(use)
    assert plain.synthetic == "" and "synthetic.json: data_loading.synthetic, seed 0" in marked.synthetic
    assert data_reasons(168, 42, marked.synthetic) == [f"{SYNTHETIC_WHY} ({marked.synthetic})"]

    cfg = _resolved([])
    assert cfg.division == "closed" and capsys.readouterr().out == ""
    kits_counts = DataSummary(168, 42, 0, synthetic=marked.synthetic)
    opened = resolve_data(cfg, CPU, kits_counts)
    assert opened.division == "open" and SYNTHETIC_WHY in opened.why("division")
    assert opened.decision("not_closed").value == f"{SYNTHETIC_WHY} ({marked.synthetic})"
    assert capsys.readouterr().out.splitlines() == [opened.why("division")]
    with pytest.raises(UsageError, match=SYNTHETIC_WHY) as err:
        resolve_data(_resolved(["--submission_division", "closed"]), CPU, kits_counts)
    assert "\n" not in str(err.value)
    unmarked = resolve_data(cfg, CPU, DataSummary(168, 42, 0))
    assert unmarked.division == "closed" and unmarked.decision("not_closed") is None
    # a run already open by its flags logged open: nothing to correct in its log
    assert resolve_data(_resolved(["--optimizer", "adam"]), CPU, kits_counts).decision("not_closed") is None


def write_log(folder, not_closed: str) -> str:
    """An MLPerf log of a closed run written by the project's own logger functions, with the
    data stage's not_closed event after run_start when ``not_closed``."""
    from mlperf_logging.mllog import constants as C

    from runtime.run_log import MLPerfLogger

    logger = MLPerfLogger(str(folder), enabled=True)
    cfg = _resolved([])
    logger.submission_info(cfg)
    logger.start(C.INIT_START)
    logger.end(C.INIT_STOP)
    logger.start(C.RUN_START)
    logger.not_closed(not_closed)
    logger.hyperparameters(replace(cfg, data=DataPlan("memory", 168, 42),
                                   training=replace(cfg.training, samples_per_epoch=168)), 1)
    logger.end(C.RUN_STOP, metadata={"status": "success"})
    logger.close()
    return str(folder / MLPERF_LOG)


def test_a_closed_log_with_not_closed_is_no_result_for_validity_the_report_and_the_package(tmp_path, monkeypatch):
    from runtime.results.runs import not_a_result
    from runtime.results import validity as V

    monkeypatch.setenv("UNET3D_CACHE_CLEARED", "1")  # a closed result needs its cache dropped (cache_clear true)

    why = f"{SYNTHETIC_WHY} (/d/synthetic.json: data_loading.synthetic, seed 0)"
    marked, plain = write_log(tmp_path / "marked", why), write_log(tmp_path / "plain", "")
    events = V.read_events(marked)
    (event,) = [e for e in events if e["key"] == NOT_CLOSED]
    assert event["value"] == why and [e["key"] for e in events].index("run_start") < events.index(event)
    verdict = V.judge_log(marked, compliance_problems=[])
    assert verdict.kind == V.NOT_A_RESULT and SYNTHETIC_WHY in verdict.reason and not verdict.counts
    assert V.judge_log(plain, compliance_problems=[]) == V.Validity(V.RESULT)  # the same log without it counts
    assert not_a_result(V.read_events(plain)) == ()


def tiny_closed_run(argv, data, log_dir, capsys, monkeypatch):
    """A real tiny run of main.py (filters 2-8, 32³) whose flags the division takes for the
    reference's (``flag_reasons`` patched to find nothing: a closed-by-flags run is the full
    network at 128³, too large for a test), so that its log says closed before its data is read."""
    monkeypatch.setattr("runtime.resolve.flag_reasons", lambda config, *_: [])
    monkeypatch.setenv("UNET3D_CACHE_CLEARED", "1")  # as run_and_time.sh says after dropping the cache
    return call(["--data_dir", data, "--log_dir", str(log_dir), "--filters", "2", "4", "4", "8", "8",
                 "--input_shape", "32", "32", "32", "--val_input_shape", "32", "32", "32", "--normalization",
                 "batchnorm", "--batch_size", "2", "--optimizer", "adam", "--learning_rate", "0.01", "--device",
                 "cpu", "--num_workers", "0", "--epochs", "1", "--start_eval_at", "1", "--evaluate_every", "1",
                 "--quality_threshold", "0.001", "--seed", "5", "--submission_org", "test_org", *argv], capsys)


def records_of(path) -> list:
    return [json.loads(line.split(":::MLLOG ", 1)[1]) for line in path.read_text().splitlines() if ":::MLLOG " in line]


def test_a_real_run_on_marked_data_logs_not_closed_and_is_left_out_of_the_package(tmp_path, capsys, monkeypatch):
    from runtime.report.cli import make_report
    from runtime.results import validity as V
    from runtime.submission.package import assemble

    data = marked_dataset(tmp_path / "data")
    sweep = tmp_path / "sweep"
    code, out, err = tiny_closed_run([], data, sweep / "synthetic", capsys, monkeypatch)
    assert code in (0, 3), err[-2000:]
    log = sweep / "synthetic" / MLPERF_LOG
    records = records_of(log)
    keys = [r["key"] for r in records]
    assert [r["value"] for r in records if r["key"] == "submission_division"] == ["closed"]
    (event,) = [r for r in records if r["key"] == NOT_CLOSED]
    assert SYNTHETIC_WHY in event["value"] and keys.index("run_start") < keys.index(NOT_CLOSED)
    assert sum(SYNTHETIC_WHY in line and "not_closed" in line for line in out.splitlines()) == 1
    # a control: the same log without the event is a result (the checker not run: tiny data)
    control = sweep / "control"
    control.mkdir()
    (control / MLPERF_LOG).write_text("".join(line for line in log.read_text().splitlines(keepends=True)
                                              if f'"{NOT_CLOSED}"' not in line))
    assert V.judge_log(str(control / MLPERF_LOG)).counts
    shutil.copy(sweep / "synthetic" / RUN_DESCRIPTION, control / RUN_DESCRIPTION)  # the same run's machines
    verdict = V.judge_log(str(log))
    assert verdict.kind == V.NOT_A_RESULT and SYNTHETIC_WHY in verdict.reason

    report = assemble([str(sweep)], str(tmp_path / "package"), check=False, code=False, say=lambda _: None)
    runs = {os.path.basename(r["folder"]): r for r in report["runs"]}
    assert runs["synthetic"]["packed_as"] is None and SYNTHETIC_WHY in runs["synthetic"]["reason"]
    assert runs["control"]["packed_as"] == "result_0.txt"
    score = make_report([str(sweep)], str(tmp_path / "report"), check=False, draw=False, say=lambda _: None)["score"]
    assert "synthetic" in score.text and SYNTHETIC_WHY in score.text, score.text


def test_closed_asked_on_marked_data_stops_the_run_with_run_stop_aborted(tmp_path, capsys, monkeypatch):
    data = marked_dataset(tmp_path / "data")
    code, out, err = tiny_closed_run(["--submission_division", "closed"], data, tmp_path / "l", capsys, monkeypatch)
    one_line_error(code, err, "--submission_division closed", SYNTHETIC_WHY)
    records = records_of(tmp_path / "l" / MLPERF_LOG)
    keys = [r["key"] for r in records]
    assert keys.index("run_start") < keys.index("run_stop") and keys[-1] == "run_stop"
    assert records[-1]["metadata"]["status"] == "aborted"
