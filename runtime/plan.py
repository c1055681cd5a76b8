"""The resolved plan of a run: the value ``runtime.resolve`` returns, read by everything after it.

A :class:`RunPlan` holds the parsed :class:`~runtime.arguments.Config` (never changed after
``parse_args``) beside one field per decision (device, precision, fused step, CUDA graphs, levers,
backend, window, window batch, seed, division, cache...) and the tuple of :class:`Decision`
records saying, for each, what runs, why, and what was asked. A :class:`Decision` is plain data
(strings, numbers, booleans, tuples of them), so the plan travels in the checkpoint beside the
flags and loads with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from data_loading.description import KITS19
from runtime.config import Config
from runtime.labels import LabelSet


@dataclass(frozen=True)
class Decision:
    """One decision of a run: ``value`` is what runs, ``asked`` the user's flag value or intent
    (None when no flag asks), ``why`` one line saying how ``value`` followed from it."""

    name: str
    value: Any
    why: str = ""
    asked: Any = None

    def line(self) -> str:
        """``"name: value (why)"``, one line."""
        return f"{self.name}: {_text(self.value)}" + (f" ({self.why})" if self.why else "")


def _text(value) -> str:
    return "x".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def find(decisions, name: str) -> Decision | None:
    """The decision ``name`` of ``decisions``, or None when the run did not make it."""
    return next((d for d in decisions if d.name == name), None)


def recorded(decisions: tuple[Decision, ...], *made: Decision | None) -> tuple[Decision, ...]:
    """``decisions`` with ``made`` recorded (None: nothing decided); a later stage deciding a name
    again (the data stage's division) replaces the earlier record, so each is recorded once."""
    made = tuple(d for d in made if d is not None)
    names = {d.name for d in made}
    return tuple(d for d in decisions if d.name not in names) + made


@dataclass(frozen=True)
class RunPlan:
    """Every decided value of a run, and the flags it was decided from (``config``).

    The decided values carry the names of the flags they decide (``amp``, ``val_input_shape``,
    ``sw_batch_size``, ``seed``...), so code written against the flags reads what runs. Every
    other attribute is the flag itself, read through to ``config`` by :meth:`__getattr__`: a
    builder takes the plan where it took the config, and a flag needs no copy here. Built only by
    ``runtime.resolve`` (and its data stage, which returns a new plan); never edited after.
    """

    config: Config
    decisions: tuple[Decision, ...]
    # the machine and the precision
    device: str
    host_memory: bool
    amp: bool
    amp_dtype: str
    # the network (flags, or the checkpoint's) and how it runs
    filters: tuple[int, ...]
    normalization: str
    activation: str
    labels: tuple[tuple[str, int], ...]  # the label set (runtime.labels): one output channel each
    dice: str  # how it is scored (runtime.labels: "benchmark" for KiTS19's folder, "nnunet" for any described one)
    ignore_label: int | None  # nnU-Net's ignore label of the data (no class), None without one
    pretrained: str  # --pretrained_weights: "every layer" or "every layer but the output" loaded; "" without
    levers: tuple[str, ...]
    # training
    seed: int
    fused_optimizer: bool
    foreach_optimizer: bool  # the unfused step multi-tensor (CUDA), as decided with fused_optimizer
    compile: bool  # --compile where this torch can compile (the model, the loss, the inference copy)
    cuda_graphs: bool
    epochs: int | str
    submission_division: str
    # inference: the backend, its cache, the window and its batch
    backend: str
    inference_copy: bool  # the torch backend converts the network for inference (predict), else runs it as trained
    tta: bool
    cache_dir: str  # OpenVINO's cache (evaluate, predict); "" where the mode chooses no backend
    val_input_shape: tuple[int, ...]
    sw_batch_size: int
    calibration: str | None  # predict --int8: --int8_calibration, or "each scan"; None without --int8
    overflow_fix: str | None  # predict --int8: NNCF's overflow fix, "enable" (no VNNI) or "first_layer"
    load_ckpt_path: str  # the checkpoint this plan's network loads (an ensemble member's own)
    weights_sha256: str  # predict: the weights it loads (recorded beside each segmentation)
    ensemble_sha256: tuple[str, ...]  # every checkpoint's, in order, when predict ensembles several
    # the data stage (runtime.resolve.resolve_data): the flags' values until then
    cache: str
    start_eval_at: int | None
    evaluate_every: int | None
    num_train_cases: int | None = None
    num_eval_cases: int | None = None
    samples_per_epoch: int | None = None  # global samples per epoch (padding counted, as the rules)
    samples_trained_per_epoch: int | None = None  # padding not counted: the MLPerf log's epoch_num unit
    fail_epoch: int | None = None  # a run not converged by this epoch has failed (MLPerf)
    # mm per axis the network's data is resampled to (runtime.spacing): the checkpoint's, then the data's
    target_spacing: tuple[float, ...] = KITS19.target_spacing

    def __getattr__(self, name: str):
        # Only for names that are no field: the flags nothing decides (and Config's properties,
        # such as mode). Dunder names and "config" itself fail as usual, so that copy and
        # pickle, which look them up before the fields exist, see a plain AttributeError.
        if name.startswith("__") or name == "config":
            raise AttributeError(name)
        return getattr(self.config, name)

    @property
    def label_set(self) -> LabelSet:
        """The run's classes and how they are scored (``runtime.labels``)."""
        return LabelSet(self.labels, self.dice, self.ignore_label)

    def decision(self, name: str) -> Decision | None:
        """The decision ``name``, or None when the run made none."""
        return find(self.decisions, name)

    def why(self, name: str) -> str:
        """The one-line reason of the decision ``name`` ("" when the run made none)."""
        made = self.decision(name)
        return made.why if made is not None else ""


def saved_values(run: RunPlan | Config) -> dict:
    """What a checkpoint saves as its "config": the flags with a plan's decided values overlaid,
    and ``plan``, every decision (plain data: tuples and frozensets as lists; read back by name).
    A bare :class:`Config` (a checkpoint written by a tool or a test that plans nothing): its
    flags and an empty plan."""
    plan = run if isinstance(run, RunPlan) else None
    values = dataclasses.asdict(plan.config if plan else run)
    if plan is not None:
        values.update({f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)
                       if f.name not in ("config", "decisions")})
    values["plan"] = [dataclasses.asdict(d) for d in plan.decisions] if plan else []
    return {k: (sorted(v) if isinstance(v, frozenset) else list(v) if isinstance(v, tuple) else v)
            for k, v in values.items()}
