"""The resolved plan of a run: the value ``runtime.resolve`` returns, read by everything after it.

A :class:`RunPlan` is made of typed sections, as torchtitan's configuration is, and each builder
takes the section it reads: the network (:class:`NetworkPlan`: ``runtime.build.build_model``), the
precision (:class:`PrecisionPlan`: autocast, layout, compile, levers), the training
(:class:`TrainingPlan`, None where the mode does not train: the optimizer's step, the schedule,
CUDA graphs), the inference (:class:`InferencePlan`: how windows become logits, in training's
evaluations, evaluate and predict: ``runtime.inference.backends.window_predictor``) and the data
(:class:`DataPlan`, from the data stage on: the cache and the case counts). What fits no section
is the run's own: its device, the host-memory reuse, the master seed and the MLPerf division.

A decided value lives once, in its section's field; :attr:`RunPlan.decisions` says how each was
decided (a :class:`Decision`: what runs, why, what was asked). A flag that nothing decides is read
from :attr:`RunPlan.config`, the flags as parsed (never changed after ``parse_args``; None for a
plan of predict's Python API, which parses no command line). A :class:`Decision` is plain data
(strings, numbers, booleans, tuples of them), so the plan travels in the checkpoint beside the
flags (:func:`saved_values`) and loads with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from data_loading.description import KITS19
from runtime.config import Config, flag_values
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


@dataclass(frozen=True)
class NetworkPlan:
    """The network a run builds (``runtime.build.build_model``): its widths, normalization and
    activation (the flags, or the checkpoint's), its label set (``runtime.labels``: one output
    channel per label, how they are scored, the ignore label), the mm per axis its data is
    resampled to (``runtime.spacing``), and the patch it is trained on (training's
    ``--input_shape``; the checkpoint's training patch elsewhere, None when it records none)."""

    filters: tuple[int, ...]
    normalization: str
    activation: str
    label_set: LabelSet
    target_spacing: tuple[float, ...] = KITS19.target_spacing
    patch: tuple[int, ...] | None = None

    @property
    def n_classes(self) -> int:
        """The network's output channels: one per label."""
        return self.label_set.n_classes

    @property
    def architecture(self) -> dict:
        """The network flags (``filters``, ``normalization``, ``activation``) as a checkpoint records them."""
        return {"filters": self.filters, "normalization": self.normalization, "activation": self.activation}


@dataclass(frozen=True)
class PrecisionPlan:
    """How the network computes: ``--amp`` as it runs here and its autocast type (``amp_dtype``,
    decided: ``auto`` is fp16 on CUDA, bf16 elsewhere), predict's ``--int8`` (OpenVINO's int8
    windows), the channels-last layout, ``--compile`` where this torch compiles, and the speed
    levers decided for the run (``runtime.levers``)."""

    amp: bool
    amp_dtype: str
    int8: bool = False
    channels_last: bool = False
    compile: bool = False
    levers: tuple[str, ...] = ()

    @property
    def autocast(self) -> str | None:
        """The autocast type that runs ("bf16", "fp16"), None for float32."""
        return self.amp_dtype if self.amp else None


@dataclass(frozen=True)
class TrainingPlan:
    """How a run trains (None in a plan that does not: evaluate, predict): the optimizer's step
    (torch's fused step where it runs here, else the default one, multi-tensor on CUDA), the
    training step captured in a CUDA graph, the epochs (``--epochs auto``: the rules' limit),
    the layers ``--pretrained_weights`` loads ("every layer", "every layer but the output"; ""
    without), and the schedule of the data stage (``runtime.resolve.resolve_data``: samples per
    epoch, padding counted as the rules count them and not, the evaluation epochs and the epoch by
    which an unconverged run has failed; the flags' values, or None, until then)."""

    fused_optimizer: bool
    foreach_optimizer: bool
    cuda_graphs: bool
    epochs: int
    pretrained: str = ""
    start_eval_at: int | None = None
    evaluate_every: int | None = None
    fail_epoch: int | None = None
    samples_per_epoch: int | None = None  # global samples per epoch (padding counted, as the rules)
    samples_trained_per_epoch: int | None = None  # padding not counted: the MLPerf log's epoch_num unit


@dataclass(frozen=True)
class InferencePlan:
    """How windows become logits (training's evaluations, evaluate, predict): the backend
    (``runtime.inference.backends``), whether the PyTorch backend runs the network's inference copy
    (predict) or the network as trained, the sliding window, its overlap and batch, predict's test-
    time flips, OpenVINO's cache folder ("" where the mode chooses no backend), predict ``--int8``'s
    calibration set and NNCF's overflow fix, and the checkpoint(s) whose weights run with the
    sha256 of each one's weights (predict; several: an ensemble)."""

    backend: str
    window: tuple[int, ...]
    overlap: float
    window_batch: int
    tta: bool = False
    inference_copy: bool = False
    cache_dir: str = ""
    calibration: str | None = None  # --int8_calibration, or "each scan"; None without --int8
    overflow_fix: str | None = None  # "enable" (every layer: no VNNI) or "first_layer"; None without --int8
    checkpoints: tuple[str, ...] = ()
    weights: tuple[str, ...] = ()

    @property
    def checkpoint(self) -> str:
        """The (first) checkpoint whose weights run ("" for a network given)."""
        return self.checkpoints[0] if self.checkpoints else ""

    @property
    def weights_sha256(self) -> str:
        """The first checkpoint's weights' digest ("" without one)."""
        return self.weights[0] if self.weights else ""

    @property
    def ensemble_sha256(self) -> tuple[str, ...]:
        """Every checkpoint's weights' digest, in order, when predict averages several; () for one."""
        return self.weights if len(self.weights) > 1 else ()


@dataclass(frozen=True)
class DataPlan:
    """The data a run reads, from the data stage on (``runtime.resolve.resolve_data``): where the
    training volumes live (``cache``: none, memory or device) and the case counts."""

    cache: str
    num_train_cases: int
    num_eval_cases: int


@dataclass(frozen=True)
class RunPlan:
    """Every decided value of a run, in sections, with the flags it was decided from (``config``).

    Built only by ``runtime.resolve`` (and its data stage, which returns a new plan); never edited
    after. ``training`` is None where the mode does not train, ``data`` before the data stage and
    in predict, ``seed`` and ``division`` in predict (it draws no seed and is no MLPerf run).
    """

    config: Config | None  # the flags as parsed; None: predict's Python API (runtime.config.PredictOptions)
    decisions: tuple[Decision, ...]
    device: str
    host_memory: bool  # freed host memory reused (runtime.resolve.apply_host_memory)
    network: NetworkPlan
    precision: PrecisionPlan
    inference: InferencePlan
    training: TrainingPlan | None = None
    seed: int | None = None  # the master seed (weights, sampling, augmentation); None: predict draws none
    division: str | None = None  # the MLPerf division, closed or open (runtime.division); None in predict
    data: DataPlan | None = None

    def decision(self, name: str) -> Decision | None:
        """The decision ``name``, or None when the run made none."""
        return find(self.decisions, name)

    def why(self, name: str) -> str:
        """The one-line reason of the decision ``name`` ("" when the run made none)."""
        made = self.decision(name)
        return made.why if made is not None else ""


def _plain(value):
    return sorted(value) if isinstance(value, frozenset) else list(value) if isinstance(value, tuple) else value


def saved_values(plan: RunPlan) -> dict:
    """What a checkpoint saves as its "config": the flags (:func:`runtime.config.flag_values`) with
    the plan's decided values overlaid under the names they have always been saved by (the flags'
    for the values that decide a flag: ``val_input_shape`` is the window, ``sw_batch_size`` its
    batch, ``submission_division`` the division), and ``plan``, every decision; plain data
    (tuples as lists), read back by name (``runtime.checkpoint.trained_network``). A section the
    plan has not leaves the flag as given (None for a value that is no flag)."""
    flags = plan.config if plan.config is not None else Config()
    network, precision, inference = plan.network, plan.precision, plan.inference
    training, data = plan.training, plan.data
    values = flag_values(flags)
    values.update(
        device=plan.device, host_memory=plan.host_memory,
        amp=precision.amp, amp_dtype=precision.amp_dtype, compile=precision.compile, levers=precision.levers,
        **network.architecture, labels=network.label_set.labels, dice=network.label_set.dice,
        ignore_label=network.label_set.ignore, target_spacing=network.target_spacing,
        seed=plan.seed if plan.seed is not None else flags.seed,
        submission_division=plan.division or flags.submission_division,
        pretrained=training.pretrained if training else "",
        fused_optimizer=training.fused_optimizer if training else flags.fused_optimizer,
        foreach_optimizer=training.foreach_optimizer if training else False,
        cuda_graphs=training.cuda_graphs if training else flags.cuda_graphs,
        epochs=training.epochs if training else flags.epochs,
        start_eval_at=training.start_eval_at if training else flags.start_eval_at,
        evaluate_every=training.evaluate_every if training else flags.evaluate_every,
        fail_epoch=training.fail_epoch if training else None,
        samples_per_epoch=training.samples_per_epoch if training else None,
        samples_trained_per_epoch=training.samples_trained_per_epoch if training else None,
        backend=inference.backend, inference_copy=inference.inference_copy, tta=inference.tta,
        cache_dir=inference.cache_dir, val_input_shape=inference.window, sw_batch_size=inference.window_batch,
        calibration=inference.calibration, overflow_fix=inference.overflow_fix,
        weights_sha256=inference.weights_sha256, ensemble_sha256=inference.ensemble_sha256,
        cache=data.cache if data else flags.cache,
        num_train_cases=data.num_train_cases if data else None, num_eval_cases=data.num_eval_cases if data else None)
    values["plan"] = [dataclasses.asdict(d) for d in plan.decisions]
    return {name: _plain(value) for name, value in values.items()}
