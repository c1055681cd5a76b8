"""The run report shows the MLPerf time to train predicted at a run's own speed beside its time:
run folders written by hand (the formats of runtime/run_log.py) with NVIDIA 8xH200's published
numbers, so the prediction has a known answer (mlperf-results.md: 11.46 min)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.results import time_to_train as T
from runtime.report.cli import make_report, main

T0_MS = 1_795_000_000_000


def mllog(key, t_ms, value=None, event_type="POINT_IN_TIME", **metadata) -> str:
    record = {"namespace": "", "time_ms": t_ms, "event_type": event_type, "key": key, "value": value,
              "metadata": {"file": "synthetic.py", "lineno": 1, **metadata}}
    return ":::MLLOG " + json.dumps(record)


def write_run(folder: Path, evals=((1000, 1.60), (1020, 1.67), (1040, 1.90)), throughput=608.0,
              train_samples=168, samples_per_epoch=168, global_batch=56, minutes=11.5):
    folder.mkdir(parents=True)
    lines = [mllog("submission_benchmark", T0_MS - 900, "unet3d"), mllog("seed", T0_MS - 700, 1),
             mllog("global_batch_size", T0_MS - 700, global_batch), mllog("train_samples", T0_MS - 700, train_samples)]
    if samples_per_epoch is not None:
        lines.append(mllog("samples_per_epoch", T0_MS - 700, samples_per_epoch))
    lines.append(mllog("run_start", T0_MS, event_type="INTERVAL_START"))
    for i, (epoch, seconds) in enumerate(evals):
        start = T0_MS + 60_000 * (i + 1)
        lines += [mllog("eval_start", start, event_type="INTERVAL_START", epoch_num=epoch),
                  mllog("eval_accuracy", start + 10, 0.5, epoch_num=epoch),
                  mllog("eval_stop", start + round(seconds * 1000), event_type="INTERVAL_END", epoch_num=epoch)]
    lines.append(mllog("run_stop", T0_MS + round(minutes * 60_000), event_type="INTERVAL_END", status="success",
                       epoch_num=evals[-1][0] if evals else 1))
    (folder / "unet3d.log").write_text("\n".join(lines) + "\n")
    records = [{"time": T0_MS / 1000 + e, "kind": "train", "epoch": e, "loss": 0.5, "lr": 1.0,
                "throughput": throughput} for e in (1, 2, 3)]
    records += [{"time": T0_MS / 1000 + 100 + e, "kind": "eval", "epoch": e, "mean_dice": 0.5, "l1_dice": 0.5,
                 "l2_dice": 0.5, "eval_loss": 0.5, "eval_cases": 42} for e, _ in evals]
    (folder / "log.json").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_a_kits19_run_shows_its_predicted_time_beside_its_own(tmp_path, capsys):
    write_run(tmp_path / "h200")
    result = make_report([str(tmp_path / "h200")], str(tmp_path / "out"), check=False, draw=False)
    predicted = result["runs"][0].predicted
    # median evaluation 1.67 s, 608 samples/s, evaluations from 1000 every 20, global batch 56
    expected = T.predict(608.0, 1.67, 56, T.Schedule(168, 1000, 20))
    assert predicted["score_s"] == pytest.approx(expected.score_s, rel=1e-6)
    assert predicted["eval_seconds"] == pytest.approx(1.67) and predicted["rcp_global_batch"] == 56
    assert abs(predicted["score_s"] / 60 / 11.46 - 1) < 0.05
    markdown = Path(result["summary_md"]).read_text()
    row = next(line for line in markdown.splitlines() if line.startswith("| h200"))
    assert "11.50 min" in row and T.duration_text(expected.run_mean_s) in row      # the run's time, the prediction
    assert f"{T.duration_text(expected.score_s)} expected" in markdown
    document = json.loads(Path(result["summary_json"]).read_text())
    assert document["runs"][0]["predicted"]["score_s"] == pytest.approx(expected.score_s, rel=1e-6)
    assert main([str(tmp_path / "h200"), "--output", str(tmp_path / "out2"), "--no_compliance", "--no_curves"]) == 0
    assert "predicted time to train at its speed" in capsys.readouterr().out


@pytest.mark.parametrize("change, note", [
    (dict(train_samples=24), "trained on 24 cases, the RCPs on KiTS19's 168"),
    (dict(samples_per_epoch=None), "no samples_per_epoch"),
    (dict(evals=((1000, 1.6),)), "fewer than 2 evaluations"),
])
def test_a_run_without_what_the_prediction_needs_says_why(tmp_path, change, note):
    write_run(tmp_path / "x1", **change)
    result = make_report([str(tmp_path / "x1")], str(tmp_path / "out"), check=False, draw=False)
    summary = result["runs"][0]
    assert summary.predicted is None and any(note in n for n in summary.notes), summary.notes
    row = next(line for line in Path(result["summary_md"]).read_text().splitlines() if line.startswith("| x1"))
    assert row.split("|")[5].strip() == "-"


@pytest.mark.parametrize("batch, basis", [
    (2, "a lower bound: no RCP at global batch 2, the smallest (at 28) bounds it"),
    (40, "interpolated between the RCPs at global batches 28 and 56"),
    (56, "RCP at global batch 56"),
])
def test_the_report_says_what_the_prediction_stands_on(tmp_path, batch, basis):
    """Never another batch's RCP without a word: the report's prediction line names the RCP at
    the run's global batch, the interpolation, or the lower bound."""
    write_run(tmp_path / "b", global_batch=batch)
    result = make_report([str(tmp_path / "b")], str(tmp_path / "out"), check=False, draw=False)
    assert result["runs"][0].predicted["rcp_basis"] == basis
    markdown = Path(result["summary_md"]).read_text().splitlines()
    line = next(line for line in markdown if line.startswith("- b (seed 1):"))
    assert line.endswith(basis), line
    row = next(line for line in markdown if line.startswith("| b (seed 1)"))
    assert ("a lower bound)" in row) == (batch == 2), row


def test_the_prediction_names_what_of_the_run_is_not_the_benchmark(tmp_path, capsys):
    """A run measured on a smaller network and patch (its MLPerf log's training_input_shape, its
    run_description.json's flags): the report's prediction says it is that configuration's; the
    benchmark's own shapes and network (logged, or not given) say nothing."""
    folder = write_run(tmp_path / "small")
    log = folder / "unet3d.log"
    log.write_text(mllog("training_input_shape", T0_MS - 700, [64, 64, 64]) + "\n"
                   + mllog("validation_input_shape", T0_MS - 700, [128, 128, 128]) + "\n" + log.read_text())
    (folder / "run_description.json").write_text(json.dumps({"recipe": {"flags": [
        "--filters", "4", "8", "16", "32", "32", "--learning_rate", "0.5"]}}))
    result = make_report([str(folder)], str(tmp_path / "out"), check=False, draw=False)
    summary = result["runs"][0]
    assert summary.predicted["not_the_benchmark"] == [
        "--filters 4 8 16 32 32 is not the reference's model", "--input_shape 64x64x64 is not the fixed 128x128x128"]
    assert any("is this configuration's, not the benchmark's" in note for note in summary.notes)
    assert "NOT the benchmark's: --filters 4 8 16 32 32" in Path(result["summary_md"]).read_text()
    same = write_run(tmp_path / "same")
    (same / "run_description.json").write_text(json.dumps({"recipe": {"flags": ["--learning_rate", "0.5"]}}))
    assert make_report([str(same)], str(tmp_path / "out2"), check=False, draw=False)["runs"][0].predicted[
        "not_the_benchmark"] == []


def test_the_benchmarks_prediction_names_the_network_and_patch_it_measured():
    """--benchmark's lines (runtime.training.benchmark: runtime.division.cost_reasons of its config)."""
    from runtime.arguments import parse_args
    from runtime.division import cost_reasons

    def costs(config):  # the network, patch, window and overlap of the flags
        network = {name: getattr(config, name) for name in ("filters", "normalization", "activation")}
        return cost_reasons(network, config.input_shape, config.val_input_shape, config.overlap)

    small = parse_args(["--data_dir", "/", "--filters", "4", "8", "16", "32", "32", "--input_shape", "64", "64", "64"])
    differs = costs(small)
    assert differs == ["--filters 4 8 16 32 32 is not the reference's model",
                       "--input_shape 64x64x64 is not the fixed 128x128x128"]
    assert costs(parse_args(["--data_dir", "/"])) == []  # the benchmark's own
    text = "\n".join(T.prediction_lines(T.predict(608.0, 1.67, 56, T.Schedule(168, 1000, 20), differs=differs)))
    assert "NOT the benchmark's network or shapes: --filters 4 8 16 32 32" in text and "64x64x64" in text
    plain = "\n".join(T.prediction_lines(T.predict(608.0, 1.67, 56, T.Schedule(168, 1000, 20))))
    assert "NOT the benchmark" not in plain
    share = "\n".join(T.evaluation_share_lines(1.67, 56, T.Schedule(168, 1000, 20), differs=differs))
    assert "NOT the benchmark's network or shapes" in share
