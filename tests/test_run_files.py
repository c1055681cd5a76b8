"""runtime/run_files.py is the one owner of a run's file names and log.json's record keys: the
writer (MetricsWriter) refuses what is not declared there, the report carries every key of an
eval record, and the names it restates from other projects match theirs."""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime import run_files as F
from runtime.results.runs import EvalPoint, TrainPoint, load_run
from runtime.run_log import MetricsWriter

ROOT = Path(__file__).resolve().parent.parent
EVAL_METRICS = {"mean_dice": 0.5, "l1_dice": 0.6, "l2_dice": 0.4, "eval_loss": 0.7, "eval_cases": 2}


def test_a_metric_added_to_the_eval_record_reaches_the_report(tmp_path, monkeypatch):
    """A new metric, declared once in run_files, written by the writer, read by the report."""
    monkeypatch.setitem(F.RECORD_KEYS, F.EVAL, F.RECORD_KEYS[F.EVAL] + ("hausdorff_mm",))
    writer = MetricsWriter(str(tmp_path), enabled=True)
    writer.write(F.TRAIN, epoch=1, loss=0.9, lr=0.1, throughput=2.0)
    writer.write(F.EVAL, epoch=1, hausdorff_mm=12.5, **EVAL_METRICS)
    written = [json.loads(line) for line in (tmp_path / F.METRICS_LOG).read_text().splitlines()]
    assert written[-1]["hausdorff_mm"] == 12.5
    run = load_run(str(tmp_path))
    assert [p.epoch for p in run.evals] == [1]
    assert run.evals[0].metrics == {"epoch": 1, "hausdorff_mm": 12.5, **EVAL_METRICS}  # all but time, kind
    assert run.evals[0].mean_dice == 0.5


@pytest.mark.parametrize("enabled", [True, False])
def test_the_writer_refuses_an_undeclared_key_or_kind(tmp_path, enabled):
    """Every rank checks (a disabled writer too), so the first test that writes a new key fails
    until run_files declares it; nothing is written."""
    writer = MetricsWriter(str(tmp_path), enabled=enabled)
    with pytest.raises(ValueError, match=r"'eval' record: key\(s\) 'hausdorff_mm' not declared in runtime/run_files.py"):
        writer.write(F.EVAL, epoch=1, hausdorff_mm=12.5, **EVAL_METRICS)
    with pytest.raises(ValueError, match="record kind 'evals' is not declared"):
        writer.write("evals", epoch=1)
    with pytest.raises(ValueError, match="'time'"):  # the header is the writer's own
        writer.write(F.TRAIN, epoch=1, time=0.0)
    assert not (tmp_path / F.METRICS_LOG).exists()


def test_every_record_the_runtime_writes_is_declared():
    """The records written by app.py and training.py, with the keys they pass (the eval metrics
    are those of runtime.clocked.evaluation.evaluate; an end-to-end run writes them through the same
    check)."""
    for kind, keys in [(F.TRAIN, ["epoch", "loss", "lr", "throughput"]),
                       (F.EVAL, ["epoch", *EVAL_METRICS]), (F.EVAL, ["epoch", "checkpoint", *EVAL_METRICS]),
                       (F.RESULT, ["status", "epoch", "epochs"]), (F.BACKEND, ["backend", "why"])]:
        F.check_record(kind, keys)


def test_the_report_reads_declared_keys_only():
    names = {f.name for f in dataclasses.fields(TrainPoint)} - {"time"}
    assert names <= set(F.RECORD_KEYS[F.TRAIN])
    names = {f.name for f in dataclasses.fields(EvalPoint)} - {"time", "metrics"}
    assert names <= set(F.RECORD_KEYS[F.EVAL])


def test_case_csv_columns_are_the_keys_of_a_case_score():
    from runtime.clocked.evaluation import case_scores

    scores = case_scores("00001", torch.tensor(0.5), torch.tensor([0.9, 0.8]), torch.tensor([0.95, 0.85]))
    assert tuple(scores) == F.EVAL_CASES_COLUMNS


def test_mlperf_names_are_mlperf_loggings():
    constants = pytest.importorskip("mlperf_logging.mllog.constants")
    assert (F.RUN_START, F.RUN_STOP, F.SEED) == (constants.RUN_START, constants.RUN_STOP, constants.SEED)
    assert (F.CACHE_CLEAR, F.SUBMISSION_DIVISION) == (constants.CACHE_CLEAR, constants.SUBMISSION_DIVISION)
    assert F.MLLOG_PREFIX == ":::MLLOG "  # mllog's line prefix, which its default formatter writes
    from runtime.arguments import Config

    assert Config().quality_threshold == F.QUALITY_THRESHOLD == 0.908  # the benchmark's target


def test_resumed_log_names_match_the_glob_and_sort_by_time():
    names = [F.resumed_log_name(stamp) for stamp in ("20261121-120000", "20261121-090000", "20270101-000000")]
    assert names[0] == "unet3d.resumed-20261121-120000.log"
    assert all(fnmatch.fnmatch(name, F.RESUMED_LOG_GLOB) for name in names + [F.resumed_log_name()])
    assert not fnmatch.fnmatch(F.MLPERF_LOG, F.RESUMED_LOG_GLOB)
    assert sorted(names) == [names[1], names[0], names[2]]


def test_the_report_imports_neither_torch_nor_numpy():
    code = ("import sys, runtime.run_files, runtime.report.cli, runtime.results.plotter; "
            "print(sorted(m for m in ('torch', 'numpy', 'matplotlib') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
