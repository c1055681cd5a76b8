"""``--exec_mode predict``'s body: the plan resolved once from its flags (their predict options,
``runtime.resolve.resolve_predict``), the :class:`runtime.predict.api.Segmenter` made from it,
every scan of ``--input`` segmented through it (:mod:`runtime.predict.folder`). The lifecycle
around it (the output folder checked and locked, the process group, signals) is
:mod:`runtime.app`'s."""
from __future__ import annotations

from typing import TYPE_CHECKING

from runtime import checkpoint as ckpt
from runtime.config import Config
from runtime.predict.api import Segmenter
from runtime.predict.folder import predict_scans, scans_to_predict
from runtime.resolve import apply_host_memory, resolve, window_line

if TYPE_CHECKING:
    from runtime.mode import Session


def predict_source(config: Config, data) -> list:
    """The scans, and ``--preview``'s matplotlib, checked before the process group starts (the
    mode's source: it gets the parsed flags)."""
    return scans_to_predict(config.input, config.output_dir, config.truth, config.preview)


def predict_body(session: Session) -> int:
    """Resolve the flags with their checkpoint(s) (further ones: an ensemble, their probabilities
    averaged), make the run's segmenter, segment this rank's scans; the exit code."""
    saved = ckpt.saved_for(session.config)
    ensemble = ckpt.saved_ensemble(session.config)
    plan = resolve(session.config, session.dist, None, saved, ensemble)
    apply_host_memory(plan, session.config.verbose)
    if session.dist.is_main:
        print(window_line(plan), flush=True)
    segmenter = Segmenter.from_plan(plan, [saved, *ensemble] if ensemble else saved, session.dist.device,
                                    session.dist.is_main)
    return predict_scans(plan, segmenter, session.source, session.dist)
