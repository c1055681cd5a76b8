"""The exec modes: what each one does, the paths it writes, its checks, its body (:data:`MODES`),
and what a body gets from the lifecycle (:class:`Session`).

``--exec_mode`` and ``--benchmark`` select one :class:`Mode` (:func:`mode_of`, ``Config.mode``):
train, train --benchmark, evaluate, evaluate --benchmark, predict. Code asks the mode what it
does (``trains``, ``scores``, ``predicts``, ``mlperf_run``...), never its name, and the flags a
mode takes follow from what it does (:data:`FLAG_USES`): a new mode is one entry of
:data:`MODES`. The table imports no product: a body (and predict's source) is named
``"module:function"`` and imported when the mode runs (``runtime.app``); so the products'
bodies import this module without importing each other.

``Config`` below is ``runtime.config.Config``, not imported: the config imports this table
(``Config.mode``, the flag refusals).
"""
from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

from runtime.outputs import RunLock, check_output_dir, check_output_file, checkpoint_lock

if TYPE_CHECKING:
    from runtime.distributed import DistInfo
    from runtime.signals import PreemptionFlag


@dataclass(frozen=True)
class Output:
    """A path a mode writes: a folder (its lock file inside) or, ``is_file``, one file (a lock
    file beside it)."""

    path: str
    flag: str
    is_file: bool = False

    def check(self) -> str | None:
        """Create/prove writable; the outermost folder created (see ``remove_if_empty``)."""
        return check_output_file(self.path, self.flag) if self.is_file else check_output_dir(self.path, self.flag)

    def folder(self) -> str:
        return os.path.dirname(os.path.abspath(self.path)) if self.is_file else self.path

    def lock(self, enabled: bool) -> RunLock:
        if self.is_file:
            return checkpoint_lock(self.path, enabled=enabled)
        return RunLock(self.path, enabled=enabled, flag=self.flag)


Check = Callable[["Config"], "list[str]"]  # a mode's check of the flags: one message per problem
# a function, or "module:function" in a product's folder, imported when the mode runs (runtime.app)
Function = Union[str, Callable]


def _no_outputs(config: Config) -> list[Output]:
    return []


def _given_source(config: Config, data):
    return data


@dataclass(frozen=True)
class Mode:
    """One exec mode: what it does (what code asks), what the lifecycle asks of it, its checks and
    its body (``(Session) -> exit code``)."""

    exec_mode: str  # its --exec_mode
    body: Function
    benchmark: bool = False  # --benchmark: times the work and predicts the MLPerf time to train
    trains: bool = False  # a training step runs (the training loader, the optimizer, --input_shape)
    scores: bool = False  # reads the preprocessed dataset (--data_dir) and scores its evaluation cases
    predicts: bool = False  # segments raw scans (--input) into --output_dir (an ensemble, --tta)
    chooses_backend: bool = False  # infers with the backend --backend chooses (PyTorch or OpenVINO)
    # --backend auto keeps the network as trained (PyTorch): its numbers are the benchmark's Dice
    scores_as_trained: bool = False
    # an MLPerf training run: writes the MLPerf log (one run per folder: the last run's files are
    # moved aside first) and says in it whether the attempt started from a checkpoint
    mlperf_run: bool = False
    saves_checkpoints: bool = False  # writes --save_ckpt_path (and --resume continues from it)
    writes_metrics: bool = False  # writes log.json in --log_dir, when --log_dir is one of its outputs
    stop_at_once: bool = True  # a signal stops the run now (outputs are atomic); False: at the next step
    outputs: Callable[[Config], list[Output]] = _no_outputs  # checked and locked before the body runs
    # checks and inputs that need no process group: (config, data given by the caller) -> source
    source: Function = _given_source
    checks: tuple[Check, ...] = ()  # after those every mode shares (runtime.arguments.validate)

    @property
    def name(self) -> str:
        """As the command line selects it: ``"evaluate --benchmark"``."""
        return f"{self.exec_mode} --benchmark" if self.benchmark else self.exec_mode

    @property
    def reads_schedule(self) -> bool:
        """Reads the training schedule (batch, accumulation, epochs, evaluations): it trains by it,
        or --benchmark predicts a time to train from it."""
        return self.trains or self.benchmark

    def uses(self, flag: str) -> bool:
        """Whether ``flag`` (a Config field) means something in this mode (:data:`FLAG_USES`)."""
        what = FLAG_USES[flag]
        return what == EVERY_MODE or (what != NO_MODE and getattr(self, what))

    @property
    def flags(self) -> tuple[str, ...]:
        """The flags (Config fields) that mean something in this mode, in :data:`FLAG_USES`' order."""
        return tuple(flag for flag in FLAG_USES if self.uses(flag))

    def errors(self, config: Config) -> list[str]:
        """This mode's problems with ``config``'s flags (one message each)."""
        return [message for check in self.checks for message in check(config)]

    def writes_metrics_for(self, config: Config) -> bool:
        """Whether a run of ``config`` writes ``log.json``: a mode that writes it, into a
        ``--log_dir`` that is one of this run's outputs (checked and locked first)."""
        return self.writes_metrics and any(output.flag == "--log_dir" for output in self.outputs(config))


@dataclass
class Session:
    """What a mode's body gets from the lifecycle."""

    config: Config  # as parsed: the body resolves it (runtime.resolve)
    dist: DistInfo
    preempt: PreemptionFlag
    source: object  # the data source (train, evaluate, benchmark) or the scans (predict)
    on_exit: ExitStack  # callbacks run at teardown, before the locks are released
    mode: Mode
    recipe: tuple[str, ...] = ()  # main.py's command line rebuilt from the flags (runtime.arguments.recipe_flags)


# ------------------------------------------------------------------ which flags each mode takes

# Which modes each flag means something in (issue 42), by what a mode does: a Mode attribute, or
# every mode, or none. A flag of this project's own given on the command line in a mode that does
# not use it is refused in one line naming the flag and the mode (a default is never refused); a
# flag of the MLCommons reference (runtime.config.REFERENCE_FLAGS) is accepted there, as the
# reference's one parser accepts every flag in every mode, and one line says it has no effect
# (issue 48). Every flag of the parser has an entry (tests/test_mode_flags.py checks it against
# --help): a new flag needs one. A mode answers it: Mode.uses(flag), Mode.flags.
EVERY_MODE, NO_MODE = "every mode", "no mode"
FLAG_USES: dict[str, str] = {
    # data and files
    "data_dir": "scores",
    "log_dir": "scores",  # --benchmark: log.json's benchmark record, as the reference's; predict: --output_dir
    "save_ckpt_path": "saves_checkpoints",
    "load_ckpt_path": EVERY_MODE,
    "pretrained_weights": "trains",
    "resume": "saves_checkpoints",
    "ckpt_during_run": "saves_checkpoints",
    "ckpt_every_epochs": "saves_checkpoints",
    "ckpt_every_minutes": "saves_checkpoints",
    "loader": "scores",
    "cache": "trains",  # where training volumes live
    "num_workers": "trains",  # the training loader's workers (evaluation reads in the process)
    "prefetch": "scores",
    "brightness": "trains",
    # process
    "local_rank": EVERY_MODE,
    "device": EVERY_MODE,
    "exec_mode": EVERY_MODE,
    "benchmark": "benchmark",
    "benchmark_steps": "benchmark",
    "benchmark_seconds": "benchmark",
    "seed": "scores",  # weights, sampling, augmentation, the synthetic loader's volumes
    "verbose": EVERY_MODE,
    "plot": "mlperf_run",  # curves.png after each evaluation of the run
    # schedule
    "epochs": "reads_schedule",  # evaluate --benchmark: passes over the evaluation set
    "quality_threshold": "mlperf_run",
    "ga_steps": "reads_schedule",
    "warmup_steps": "benchmark",
    "batch_size": "reads_schedule",
    "evaluate_every": "reads_schedule",
    "start_eval_at": "reads_schedule",
    # shapes
    "layout": EVERY_MODE,  # accepted for the reference's scripts (ACCEPTED_ONLY); no mode reads it
    "pad_mode": NO_MODE,  # accepted for the reference's scripts (ACCEPTED_ONLY); read nowhere, as there
    "input_shape": "trains",
    "val_input_shape": EVERY_MODE,
    # optimisation
    **{name: "trains" for name in ("optimizer", "learning_rate", "init_learning_rate", "lr_warmup_epochs",
                                   "lr_decay_epochs", "lr_decay_factor", "lamb_betas", "momentum", "weight_decay")},
    # model: given with a checkpoint, checked against the one it was trained with
    "normalization": EVERY_MODE,
    "activation": EVERY_MODE,
    "filters": EVERY_MODE,
    "include_background": "scores",  # the Dice loss (the benchmark's Dice stays kidney and tumour)
    # augmentation and evaluation
    "oversampling": "trains",
    "semantics": "trains",  # the crop sampler and accumulation tail
    "last_batch": "trains",
    "overlap": EVERY_MODE,
    "sw_batch_size": EVERY_MODE,
    # speed
    "amp": EVERY_MODE,
    "amp_dtype": EVERY_MODE,
    "channels_last": EVERY_MODE,
    "compile": EVERY_MODE,
    "cuda_graphs": "trains",  # captures the training step
    "fused_optimizer": "trains",
    "cudnn_benchmark": "scores",
    "cudnn_deterministic": "scores",
    # MLPerf submission metadata: the MLPerf log
    **{name: "mlperf_run" for name in ("submission_org", "submission_platform", "submission_division",
                                       "submission_status")},
    # predict
    **{name: "predicts" for name in ("input", "output_dir", "truth", "tta", "preview", "force",
                                     "save_probabilities", "int8", "int8_calibration")},
    # inference backend
    "backend": "chooses_backend",
    "max_memory_gb": "predicts",
    "cache_dir": "chooses_backend",  # OpenVINO's converted networks
}


# ------------------------------------------------------------------ each mode's checks


def problems(*checks: tuple[bool, str]) -> list[str]:
    """The messages of the failed ``(ok, message)`` checks, in order."""
    return [message for ok, message in checks if not ok]


def _int8_errors(cfg: Config) -> list[str]:
    return problems((not cfg.int8,
                     "--int8 applies to --exec_mode predict only (evaluation scores the model as trained)"))


def _train_errors(cfg: Config) -> list[str]:
    return _int8_errors(cfg) + problems(
        (cfg.backend != "openvino", "--backend openvino applies to --exec_mode predict and evaluate; "
                                    "training runs PyTorch"))


def _evaluate_errors(cfg: Config) -> list[str]:
    return problems((bool(cfg.load_ckpt_path), "--exec_mode evaluate needs --load_ckpt_path")) + _int8_errors(cfg)


def _predict_errors(cfg: Config) -> list[str]:
    errors = problems(*((bool(getattr(cfg, name)), f"--exec_mode predict needs --{name}")
                        for name in ("load_ckpt_path", "input", "output_dir")))
    return errors + problems(
        (not cfg.input or os.path.exists(cfg.input), f"--input {cfg.input!r} does not exist"),
        (not cfg.benchmark, "--benchmark does not apply to --exec_mode predict "
                            "(its summary times every stage; docs/performance.md)"),
    ) + int8_problems(cfg.int8, cfg.int8_calibration, cfg.device, cfg.amp)


def int8_problems(int8: bool, calibration: str, device: str, amp: bool) -> list[str]:
    """Predict's ``--int8`` checks, for the flags and ``runtime.predict.api.PredictOptions`` alike."""
    return problems(
        (not (int8 and device == "cuda"), "--int8 runs on the CPU only; drop it or use --device cpu"),
        (not (int8 and amp), "--int8 replaces --amp: give one of them"),
        (not calibration or int8, "--int8_calibration names the scans --int8 calibrates on: add --int8 or drop it"),
        (not calibration or os.path.exists(calibration), f"--int8_calibration {calibration!r} does not exist"))


def _benchmark_errors(cfg: Config) -> list[str]:
    return problems((cfg.backend != "openvino", "--backend openvino does not apply to --benchmark (it times PyTorch)"))


# ------------------------------------------------------------------ the outputs


def _log_dir(config: Config) -> list[Output]:
    return [Output(config.log_dir, "--log_dir")]


def _train_outputs(config: Config) -> list[Output]:
    return _log_dir(config) + ([Output(config.save_ckpt_path, "--save_ckpt_path", is_file=True)]
                               if config.save_ckpt_path else [])


def _benchmark_outputs(config: Config) -> list[Output]:
    # writes nothing, but log.json's benchmark record where --log_dir is given (the reference's
    # --benchmark writes its throughput to <log_dir>/log.json)
    return _log_dir(config) if "log_dir" in config.explicit else []


def _output_dir(config: Config) -> list[Output]:
    return [Output(config.output_dir, "--output_dir")]


# ------------------------------------------------------------------ the modes

MODES: dict[str, Mode] = {mode.name: mode for mode in (
    # training saves a checkpoint at the next step when signalled
    Mode("train", "runtime.training.bodies:train_body", trains=True, scores=True, mlperf_run=True,
         saves_checkpoints=True, writes_metrics=True, stop_at_once=False, outputs=_train_outputs,
         checks=(_train_errors,)),
    Mode("train", "runtime.training.bodies:benchmark_body", benchmark=True, trains=True, scores=True,
         writes_metrics=True, outputs=_benchmark_outputs, checks=(_train_errors, _benchmark_errors)),
    Mode("evaluate", "runtime.evaluate.body:evaluate_body", scores=True, chooses_backend=True,
         scores_as_trained=True, writes_metrics=True, outputs=_log_dir, checks=(_evaluate_errors,)),
    Mode("evaluate", "runtime.training.bodies:benchmark_body", benchmark=True, scores=True,
         writes_metrics=True, outputs=_benchmark_outputs, checks=(_int8_errors, _benchmark_errors)),
    Mode("predict", "runtime.predict.body:predict_body", predicts=True, chooses_backend=True,
         outputs=_output_dir, source="runtime.predict.body:predict_source", checks=(_predict_errors,)),
)}


def mode_of(exec_mode: str, benchmark: bool) -> Mode:
    """The mode ``--exec_mode`` and ``--benchmark`` select (predict has none with --benchmark: its
    checks refuse the flag)."""
    return MODES.get(f"{exec_mode} --benchmark" if benchmark else exec_mode) or MODES[exec_mode]


def exec_modes() -> tuple[str, ...]:
    """``--exec_mode``'s choices, in the table's order."""
    return tuple(dict.fromkeys(mode.exec_mode for mode in MODES.values()))
