"""The MLPerf division a training run belongs to, decided by what the run does.

A run is closed only when it is the reference's benchmark (the rules, v4.0 ``training_rules.adoc``
of mlcommons/training_policies, "Divisions"; docs/usage.md, "The division"): the reference's model and
loss, SGD with only the rules' tunables changed (global batch size, base and initial learning
rate, momentum, warm-up and decay epochs, decay factor, weight decay), every value the rules fix
to the reference's (training patch 128³, evaluation window 128³, overlap 0.5, oversampling 0.4,
the target 0.908), the reference's data semantics (its crop sampler and gradient-accumulation
tail: ``--semantics reference``; no project-only augmentation or
synthetic data), the rules' evaluation schedule at the run's global batch, every case once per
epoch (``--last_batch pad``; the reference's drop is open) and the 168/42 split of KiTS19.
Anything else makes it open.

Two pure functions, one per stage of ``runtime.resolve``: :func:`flag_reasons` over the flags
(``resolve``, before any MLPerf event) and :func:`data_reasons` over the data (``resolve_data``,
after ``run_start``, where the data is first listed: its case counts and its synthetic marker).
Each returns the reasons the run is open, in words, empty when nothing makes it so;
:func:`decide` turns them into the division and the one line that says why. The MLPerf log's
division precedes ``init_stop``, so a run the data makes open after its log said closed
carries ``not_closed`` (``runtime.run_files.NOT_CLOSED``) after ``run_start``, and the report,
the score and the package leave it out.
"""
from __future__ import annotations

from model.unet3d import DEFAULT_FILTERS
from runtime.run_files import QUALITY_THRESHOLD
from runtime.schedule import rules_schedule

# The values the rules fix to the reference's, and the reference's model and loss.
REFERENCE_PATCH = (128, 128, 128)
REFERENCE_WINDOW = (128, 128, 128)
REFERENCE_OVERLAP = 0.5
REFERENCE_OVERSAMPLING = 0.4
REFERENCE_TRAIN_CASES = 168
REFERENCE_EVAL_CASES = 42
DIVISIONS = ("auto", "closed", "open")


def _shape(shape) -> str:
    return "x".join(map(str, shape))


def schedule_reasons(config, world_size: int) -> list[str]:
    """Why ``--start_eval_at`` / ``--evaluate_every``, when given, are not the rules' schedule at the
    run's global batch (``runtime.schedule.rules_schedule``); a given value equal to it is fine."""
    global_batch = config.batch_size * world_size * config.ga_steps
    rules = rules_schedule(global_batch)
    reasons = []
    for name in ("start_eval_at", "evaluate_every"):
        given, expected = getattr(config, name), getattr(rules, name)
        if given is not None and given != expected:
            reasons.append(f"--{name} {given} is not the rules' {expected} at global batch {global_batch}")
    return reasons


def network_reasons(architecture: dict) -> list[str]:
    """What of a network (``architecture``: its ``filters``, ``normalization``, ``activation``) is
    not the reference's model."""
    filters, normalization, activation = (architecture[k] for k in ("filters", "normalization", "activation"))
    reasons = []
    if tuple(filters) != tuple(DEFAULT_FILTERS):
        reasons.append(f"--filters {' '.join(map(str, filters))} is not the reference's model")
    if normalization != "instancenorm":
        reasons.append(f"--normalization {normalization} is not the reference's model (instancenorm)")
    if activation != "relu":
        reasons.append(f"--activation {activation} is not the reference's model (relu)")
    return reasons


def shape_reasons(patch, window, overlap: float) -> list[str]:
    """What of a run's training ``patch``, evaluation ``window`` and ``overlap`` is not the
    benchmark's fixed value."""
    reasons = []
    if tuple(patch) != REFERENCE_PATCH:
        reasons.append(f"--input_shape {_shape(patch)} is not the fixed {_shape(REFERENCE_PATCH)}")
    if tuple(window) != REFERENCE_WINDOW:
        reasons.append(f"--val_input_shape {_shape(window)} is not the fixed {_shape(REFERENCE_WINDOW)}")
    if overlap != REFERENCE_OVERLAP:
        reasons.append(f"--overlap {overlap:g} is not the fixed {REFERENCE_OVERLAP:g}")
    return reasons


def cost_reasons(architecture: dict, patch, window, overlap: float) -> list[str]:
    """What makes a training step or an evaluation cost other than the benchmark's: the network
    (``architecture``) and the patch, window and overlap (the predicted time to train names them)."""
    return network_reasons(architecture) + shape_reasons(patch, window, overlap)


def flag_reasons(config, architecture: dict, window, world_size: int = 1) -> list[str]:
    """Why a run of the parsed flags ``config`` (``runtime.config.Config``), with the network
    ``architecture`` and the evaluation ``window`` it runs (decided from the flags and the
    checkpoint), is open (empty: it may be closed); ``world_size`` makes the global batch that
    fixes the evaluation schedule."""
    reasons = network_reasons(architecture)
    if config.include_background:
        reasons.append("--include_background is not the reference's loss")
    if config.optimizer != "sgd":
        reasons.append(f"--optimizer {config.optimizer} is not the reference's optimizer (sgd)")
    reasons += shape_reasons(config.input_shape, window, config.overlap)
    if config.oversampling != REFERENCE_OVERSAMPLING:
        reasons.append(f"--oversampling {config.oversampling:g} is not the fixed {REFERENCE_OVERSAMPLING:g}")
    if config.quality_threshold != QUALITY_THRESHOLD:
        reasons.append(f"--quality_threshold {config.quality_threshold:g} is not the target {QUALITY_THRESHOLD:g}")
    if config.semantics != "reference":
        reasons.append(f"--semantics {config.semantics} is not the reference's crop sampler and "
                       "gradient-accumulation tail")
    if config.brightness != "reference":
        reasons.append(f"--brightness {config.brightness} is not the reference's augmentation")
    if config.loader != "pytorch":
        reasons.append(f"--loader {config.loader} is not the KiTS19 data")
    if config.pretrained_weights:
        reasons.append(f"--pretrained_weights {config.pretrained_weights}: the run starts from another run's weights")
    if config.last_batch != "pad":
        reasons.append(f"--last_batch {config.last_batch} trains not every case once per epoch (the rules: "
                       "only DLRMv2 may drop the last batch)")
    return reasons + schedule_reasons(config, world_size)


def own_data_reason(description) -> str:
    """Why a folder preprocessed from a dataset description (``data_loading.description``: its
    file, name and labels) makes the run open: it is not KiTS19 (known before ``run_start``)."""
    return (f"own data: {description.path} describes {description.name} (labels {description.labels_text()}), "
            "not the benchmark's KiTS19")


def data_reasons(num_train: int, num_eval: int, synthetic: str = "") -> list[str]:
    """Why the data makes the run open (empty: KiTS19's 168/42 split, not marked synthetic): its
    case counts, and ``synthetic``, the folder's synthetic marker in words
    (``data_loading.synthetic``'s, which preprocessing copies; "" when it has none), since a
    generated set of 210 cases has KiTS19's counts. (A described folder is open before the data
    is read: :func:`own_data_reason`.)"""
    reasons = []
    if synthetic:
        reasons.append(f"synthetic data is not KiTS19 ({synthetic})")
    if (num_train, num_eval) != (REFERENCE_TRAIN_CASES, REFERENCE_EVAL_CASES):
        reasons.append(f"{num_train} training and {num_eval} evaluation cases are not KiTS19's "
                       f"{REFERENCE_TRAIN_CASES} and {REFERENCE_EVAL_CASES}")
    return reasons


def decide(asked: str, reasons: list[str]) -> tuple[str, str]:
    """``(division, why)`` for ``--submission_division asked`` given the ``reasons`` the run is
    open: ``("closed", "")``, or ``("open", one line naming the first reason and how many more)``.
    ``asked`` "closed" with a reason raises ``ValueError`` with the line to tell the user."""
    if asked not in DIVISIONS:
        raise ValueError(f"division must be one of {DIVISIONS}, got {asked!r}")
    if not reasons:
        return ("open", "") if asked == "open" else ("closed", "")
    more = f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""
    if asked == "closed":
        raise ValueError(f"--submission_division closed: this run cannot be closed: {reasons[0]}{more}; "
                         "drop the flag (auto) to log it open")
    return "open", f"MLPerf division: open, because {reasons[0]}{more}"
