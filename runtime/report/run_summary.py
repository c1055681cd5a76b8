"""``summary.md`` and ``summary.json``: one row per run, the compliance problems, the score and
the notes; both written atomically."""
from __future__ import annotations

import json
import math
import os
from typing import Sequence

from runtime.results.files import atomic_write
from runtime.results.scoring import RunSummary, Score
from runtime.results.time_to_train import duration_text
from runtime.run_files import METRICS_LOG, MLPERF_LOG, SUMMARY_JSON, SUMMARY_MD, UNVERIFIED


def number_text(value, spec: str, unit: str = "") -> str:
    """``value`` formatted by ``spec``; "-" for None and non-finite floats."""
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:{spec}}{unit}"


def time_text(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s ({seconds / 60:.2f} min)"


def predicted_text(predicted: dict | None) -> str:
    """One run's predicted MLPerf time to train: mean (5th-95th percentile), or "-"."""
    if not predicted:
        return "-"
    bound = ", a lower bound" if predicted.get("rcp_kind") == "lower bound" else ""
    return (f"{duration_text(predicted['run_mean_s'])} ({duration_text(predicted['run_p5_s'])} - "
            f"{duration_text(predicted['run_p95_s'])}{bound})")


def _run_row(s: RunSummary) -> str:
    best = "-" if s.best_mean_dice is None else f"{s.best_mean_dice:.4f} ({s.best_epoch})"
    compliance = "<br>".join(f"{os.path.basename(c.log)}: {c.short()}" for c in s.compliance) or "-"
    time_cell = time_text(s.time_to_target_s)
    if s.time_to_target_s is None and s.run_time_s is not None:
        time_cell = f"- (ran {time_text(s.run_time_s)})"
    if not s.is_result:
        time_cell += " (not a result)"
    return (f"| {s.label} | {s.status} | {number_text(s.epochs, 'd')} | {time_cell} | {predicted_text(s.predicted)} "
            f"| {best} "
            f"| {number_text(s.reached_epoch, 'd')} | {number_text(s.mean_throughput, '.2f', ' samples/s')} "
            f"| {compliance.replace('|', '/')} |")


def summary_markdown(summaries: Sequence[RunSummary], empty: Sequence[str], score: Score,
                     threshold: float, ruleset: str, curves: str | None) -> str:
    lines = ["# Run report", "",
             f"Target mean Dice {threshold:g}; compliance: `mlperf_logging` ruleset {ruleset}.", ""]
    if curves:
        lines += [f"![training curves]({curves})", ""]
    lines += ["| run | status | epochs | time to target | predicted (RCPs): one run, 5th-95th percentile "
              "| best mean Dice (epoch) | target reached at epoch | mean throughput | compliance |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += [_run_row(s) for s in summaries]
    lines += ["", f"**Score**: {score.text}.", "", UNVERIFIED, ""]
    predicted = [s for s in summaries if s.predicted]
    if predicted:
        lines += ["**Predicted** MLPerf time to train at each run's speed (its mean training throughput, median "
                  "seconds per evaluation and schedule; epochs to converge from the RCPs of the installed "
                  "mlperf-logging, docs/time-to-train.md): the score, the mean of 40 runs less the 4 fastest "
                  "and 4 slowest:", ""]
        lines += [f"- {s.label}: {duration_text(s.predicted['score_s'])} expected (5th-95th percentile "
                  f"{duration_text(s.predicted['score_p5_s'])} - {duration_text(s.predicted['score_p95_s'])}), "
                  + (s.predicted.get("rcp_basis") or f"RCP at global batch {s.predicted['rcp_global_batch']}")
                  + (f"; NOT the benchmark's: {'; '.join(s.predicted['not_the_benchmark'])}"
                     if s.predicted.get("not_the_benchmark") else "")
                  for s in predicted]
        lines.append("")
    failing = [(s, c) for s in summaries for c in s.compliance if c.problems]
    if failing:
        lines += [f"## Compliance problems (ruleset {ruleset})", ""]
        for s, c in failing:
            lines.append(f"- {s.label}, `{os.path.basename(c.log)}`:")
            lines += [f"  - {problem}" for problem in c.problems]
        lines.append("")
    noted = [s for s in summaries if s.notes]
    if noted or empty:
        lines += ["## Notes", ""]
        lines += [f"- {s.label} (`{s.folder}`): {note}" for s in noted for note in s.notes]
        lines += [f"- `{folder}`: no run here (no {METRICS_LOG} or {MLPERF_LOG})" for folder in empty]
        lines.append("")
    return "\n".join(lines)


def _clean(value):
    """JSON without NaN or Infinity (not JSON): non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def summary_json(summaries: Sequence[RunSummary], empty: Sequence[str], score: Score,
                 threshold: float, ruleset: str, curves: str | None) -> str:
    runs = []
    for s in summaries:
        entry = {k: getattr(s, k) for k in ("folder", "label", "status", "epochs", "seed", "time_to_target_s",
                                            "run_time_s", "best_mean_dice", "best_epoch", "reached_epoch",
                                            "mean_throughput", "attempts", "notes", "predicted",
                                            "not_a_result")}
        entry["is_result"] = s.is_result
        entry["compliance"] = [{"log": c.log, "checked": c.checked, "passed": c.passed,
                                "problems": list(c.problems)} for c in s.compliance]
        runs.append(entry)
    document = {"quality_threshold": threshold, "ruleset": ruleset, "curves": curves, "runs": runs,
                "no_run": list(empty),
                "score": {"minutes": score.minutes, "successful_runs": score.successful,
                          "failed_runs": score.failed, "dropped_each_end": score.drop, "text": score.text}}
    return json.dumps(_clean(document), indent=2, allow_nan=False) + "\n"


def write_summaries(output: str, summaries: Sequence[RunSummary], empty: Sequence[str], score: Score,
                    threshold: float, ruleset: str, curves: str | None) -> tuple[str, str]:
    """``output/summary.md`` and ``output/summary.json``, each atomically; their paths."""
    parts = (summaries, empty, score, threshold, ruleset, curves)
    md = atomic_write(os.path.join(output, SUMMARY_MD), lambda h: h.write(summary_markdown(*parts).encode()))
    js = atomic_write(os.path.join(output, SUMMARY_JSON), lambda h: h.write(summary_json(*parts).encode()))
    return md, js
