"""The body of ``--exec_mode evaluate`` (``runtime.app.MODES``): the scores first (stdout), then
the files, so that a full disk loses no number."""
from __future__ import annotations

from runtime import checkpoint as ckpt
from runtime import distributed as D
from runtime.evaluate.components import evaluation_components
from runtime.evaluate.report import explain_scores, write_case_scores
from runtime.mode import Session
from runtime.resolve import window_line
from runtime.run_files import BACKEND, EVAL
from runtime.training.loop import run_evaluation
from runtime.training.start import started


def evaluate_body(session: Session) -> int:
    parts, saved = started(session)
    if parts is None:
        return 0
    out, components = parts
    components = evaluation_components(components, out)  # PyTorch or OpenVINO (resolved --backend)
    cases: list[dict] = []
    metrics = run_evaluation(components, out, epoch=0, cases=cases)
    cases = [case for part in D.all_gather_objects(cases) for case in part]
    out.say(f"mean_dice {metrics['mean_dice']:.4f}")
    out.say(f"l1_dice {metrics['l1_dice']:.4f}  l2_dice {metrics['l2_dice']:.4f}  "
            f"eval_loss {metrics['eval_loss']:.4f}  cases {metrics['eval_cases']}")
    if saved is not None:
        out.say(f"weights: {ckpt.weights_description(saved.checkpoint)} of {saved.path}")
    out.say(window_line(components.config))  # the benchmark's 128³ unless --val_input_shape
    out.say(f"backend: {components.config.why('backend')}")  # PyTorch unless --backend asks for another
    for line in explain_scores(cases):
        out.say(line)
    out.metrics.write(BACKEND, backend=components.config.backend, why=components.config.why("backend"))
    out.metrics.write(EVAL, epoch=0, checkpoint=components.config.load_ckpt_path, **metrics)
    if out.is_main:
        out.say(f"per-case Dice: {write_case_scores(components.config.log_dir, cases)}")
    return 0
