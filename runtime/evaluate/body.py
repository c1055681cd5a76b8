"""The body of ``--exec_mode evaluate`` (``runtime.mode.MODES``): the scores first (stdout), then
the files, so that a full disk loses no number. In a ``--log_dir`` that holds a training run,
evaluate's records and per-case Dice go to files of its own (``evaluate.json``,
``evaluate_cases.csv``), never into the run's ``log.json`` or ``eval_cases.csv``."""
from __future__ import annotations

import dataclasses

from runtime import checkpoint as ckpt
from runtime import distributed as D
from runtime.clocked.evaluation import run_evaluation
from runtime.clocked.start import started
from runtime.evaluate.components import evaluation_components
from runtime.evaluate.report import (OWN_CASES, OWN_RECORDS, OwnRecords, explain_scores, holds_training_run,
                                     write_case_scores)
from runtime.mode import Session
from runtime.resolve import window_line
from runtime.run_files import BACKEND, EVAL


def evaluate_body(session: Session) -> int:
    parts, saved = started(session)
    if parts is None:
        return 0
    out, components = parts
    plan = components.plan
    log_dir = plan.config.log_dir
    own = holds_training_run(log_dir)  # before this run writes anything
    if own:
        out = dataclasses.replace(out, metrics=OwnRecords(log_dir, out.metrics.enabled))
        out.say(f"--log_dir {log_dir} holds a training run: evaluate writes {OWN_RECORDS} and {OWN_CASES} there, "
                "never the run's own files")
    components = evaluation_components(components, out)  # PyTorch or OpenVINO (resolved --backend)
    cases: list[dict] = []
    metrics = run_evaluation(components, out, epoch=0, cases=cases)
    cases = [case for part in D.all_gather_objects(cases) for case in part]
    out.say(f"mean_dice {metrics['mean_dice']:.4f}")
    per_label = "  ".join(f"{key} {metrics[key]:.4f}" for key in plan.network.label_set.keys)
    out.say(f"{per_label}  eval_loss {metrics['eval_loss']:.4f}  cases {metrics['eval_cases']}")
    if saved is not None:
        out.say(f"weights: {ckpt.weights_description(saved.checkpoint)} of {saved.path}")
    out.say(window_line(plan))  # the benchmark's 128³ unless --val_input_shape
    out.say(f"backend: {plan.why('backend')}")  # PyTorch unless --backend asks for another
    for line in explain_scores(cases, plan):
        out.say(line)
    out.metrics.write(BACKEND, backend=plan.inference.backend, why=plan.why("backend"))
    out.metrics.write(EVAL, epoch=0, checkpoint=plan.config.load_ckpt_path, **metrics)
    if out.is_main:
        written = write_case_scores(log_dir, cases, OWN_CASES) if own else write_case_scores(log_dir, cases)
        out.say(f"per-case Dice: {written}")
    return 0
