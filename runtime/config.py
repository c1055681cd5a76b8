"""The run's flags as one frozen value, with no argument parser: :class:`Config` (every flag, its
default), the choices a flag takes, and :class:`UsageError`.

The command line (:mod:`runtime.arguments`) turns ``argv`` into a :class:`Config`; predict's Python
API (:mod:`runtime.predict.api`) builds none: its options are the inference section's inputs. The
engines below the command line import this module, never the parser. Standard library only, with
the network's and the modes' names.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from numbers import Integral

from model.layers import ACTIVATIONS, NORMALIZATIONS
from model.unet3d import DEFAULT_FILTERS, SHAPE_DIVISOR
from runtime.division import DIVISIONS  # noqa: F401 - the division's own list, a choice here
from runtime.mode import FLAG_USES, Mode, int8_problems, mode_of, problems
from runtime.run_files import QUALITY_THRESHOLD

# The choices of the flags that take one (the command line's ``choices``; the Python API checks its
# options against the same lists).
LOADERS = ("pytorch", "synthetic")
CACHES = ("auto", "none", "memory", "device")
BRIGHTNESS = ("reference", "centered")
DEVICES = ("auto", "cpu", "cuda")
OPTIMIZERS = ("sgd", "adam", "lamb")
SEMANTICS = ("reference", "project")
LAST_BATCHES = ("pad", "drop")
AMP_DTYPES = ("auto", "fp16", "bf16")
STATUSES = ("onprem", "cloud", "preview", "research")
BACKENDS = ("auto", "torch", "openvino")
EPOCHS_AUTO = "auto"  # --epochs auto: the rules' non-convergence limit, decided by runtime.resolve


@dataclass(frozen=True)
class Config:
    # data and files
    data_dir: str = "/data"
    log_dir: str = "results"
    save_ckpt_path: str = ""
    ckpt_every_epochs: int = 0
    ckpt_every_minutes: float = 30.0
    ckpt_during_run: bool = False  # (new) --save_ckpt_path also written between run_start and run_stop
    load_ckpt_path: str = ""  # the (first) checkpoint
    load_ckpt_paths: tuple[str, ...] = ()  # (new) every --load_ckpt_path given: predict's ensemble
    pretrained_weights: str = ""  # (new) training starts from this checkpoint's weights (another label set too)
    resume: bool = False
    loader: str = "pytorch"
    cache: str = "auto"
    num_workers: int = 8
    prefetch: int = 2
    brightness: str = "reference"
    # process
    local_rank: int = 0
    device: str = "auto"
    exec_mode: str = "train"
    benchmark: bool = False
    benchmark_steps: int = 0  # (new) --benchmark's budget: timed steps or volumes, 0 = none
    benchmark_seconds: float = 0.0  # (new) and seconds of timed work, 0 = none
    seed: int = -1
    verbose: bool = False
    plot: bool = False
    # schedule
    epochs: int | str = 1  # "auto": the rules' non-convergence limit, decided by runtime.resolve
    quality_threshold: float = QUALITY_THRESHOLD
    ga_steps: int = 1
    warmup_steps: int = 4
    batch_size: int = 2
    evaluate_every: int | None = None
    start_eval_at: int | None = None
    # shapes
    input_shape: tuple[int, ...] = (128, 128, 128)
    val_input_shape: tuple[int, ...] = (128, 128, 128)
    # optimisation
    optimizer: str = "sgd"
    learning_rate: float = 1.0
    init_learning_rate: float = 1e-4
    lr_warmup_epochs: int = 0
    lr_decay_epochs: tuple[int, ...] = ()
    lr_decay_factor: float = 1.0
    lamb_betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.9
    weight_decay: float = 0.0
    # model
    normalization: str = "instancenorm"
    activation: str = "relu"
    filters: tuple[int, ...] = DEFAULT_FILTERS
    include_background: bool = False
    # augmentation and evaluation
    oversampling: float = 0.4
    overlap: float = 0.5
    semantics: str = "reference"  # (new) the reference's crop sampler and GA tail, or the project's
    last_batch: str = "pad"  # (new) the epoch's last global batch: padded (the rules) or dropped (the reference)
    sw_batch_size: int = 2
    # speed
    amp: bool = False
    amp_dtype: str = "auto"
    channels_last: bool = False
    compile: bool = False
    cuda_graphs: bool = False
    fused_optimizer: bool = False
    cudnn_benchmark: bool = False
    cudnn_deterministic: bool = False
    # MLPerf submission metadata
    submission_org: str = "reference_implementation"
    submission_platform: str = "unknown"
    submission_division: str = "auto"  # decided by runtime.division in runtime.resolve: closed or open
    submission_status: str = "onprem"
    # The flags given on the command line (field names), so that values saved in a checkpoint
    # can fill the others (runtime.resolve).
    explicit: frozenset = frozenset()
    # predict (new)
    input: str = ""
    output_dir: str = ""
    truth: str = ""  # (new) predict: a folder of ground truths (else labelsTr beside imagesTr, or beside the scan)
    tta: bool = False
    preview: bool = False
    force: bool = False
    int8: bool = False
    int8_calibration: str = ""  # predict --int8: the scans (a file or folder) it calibrates on; "": each scan alone
    save_probabilities: bool = False
    # inference backend and memory (new): predict and evaluate
    backend: str = "auto"
    max_memory_gb: float = 0.0
    cache_dir: str = ""  # OpenVINO's converted networks; "": $XDG_CACHE_HOME/unet3d-kits19 (runtime.resolve)

    @property
    def checkpoints(self) -> tuple[str, ...]:
        """Every checkpoint of ``--load_ckpt_path``, in order (one, or predict's ensemble)."""
        return self.load_ckpt_paths or ((self.load_ckpt_path,) if self.load_ckpt_path else ())

    @property
    def mode(self) -> Mode:
        """The exec mode ``--exec_mode`` and ``--benchmark`` select (:mod:`runtime.mode`): ask it
        what the run does."""
        return mode_of(self.exec_mode, self.benchmark)

    @property
    def checkpoints_on_the_clock(self) -> bool:
        """A training run that writes --save_ckpt_path between run_start and run_stop (at its
        evaluations, periodically, on a signal): asked for with --ckpt_during_run or a
        --ckpt_every_epochs; such a run is not an MLPerf result (its log says so). Otherwise the
        checkpoint is written once, after run_stop, as the reference writes it."""
        return (self.mode.saves_checkpoints and bool(self.save_ckpt_path)
                and (self.ckpt_during_run or self.ckpt_every_epochs > 0))


class UsageError(RuntimeError):
    """A problem with the flags that only shows once the machine or the data is known (printed as
    one line, exit code 1)."""


def flag_values(config: Config) -> dict:
    """Every flag of ``config`` as plain data (tuples as lists, sets sorted): what a checkpoint
    saves as its "config" before the plan's decided values are overlaid (``runtime.plan.saved_values``)."""
    return {name: (sorted(value) if isinstance(value, frozenset) else list(value) if isinstance(value, tuple)
                   else value) for name, value in dataclasses.asdict(config).items()}


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def checkpoint_path_problem(path: str, flag: str) -> str:
    """Why ``path`` is no checkpoint file: a folder (naming the checkpoints in it) or missing."""
    if not os.path.isdir(path):
        return f"{flag} {path!r} does not exist"
    found = sorted(name for name in os.listdir(path) if name.endswith((".pt", ".pth", ".ckpt")))
    hint = f", such as {os.path.join(path, found[0])!r}" if found else ""
    return f"{flag} {path!r} is a folder; give the checkpoint file{hint}"


# The flags of the MLCommons reference's parser (image_segmentation/pytorch/runtime/arguments.py),
# by Config field (argparse dest): it accepts each of them in every mode, so a script may pass one
# set of flags to train and evaluate. Given where they do nothing here they are accepted with one
# line saying so (:func:`no_effect_line`), never refused; predict (this project's own mode) takes
# them the same way.
REFERENCE_FLAGS = frozenset({
    "data_dir", "log_dir", "save_ckpt_path", "load_ckpt_path", "loader", "local_rank", "epochs",
    "quality_threshold", "ga_steps", "warmup_steps", "batch_size", "layout", "input_shape", "val_input_shape",
    "seed", "num_workers", "exec_mode", "benchmark", "amp", "optimizer", "learning_rate", "init_learning_rate",
    "lr_warmup_epochs", "lr_decay_epochs", "lr_decay_factor", "lamb_betas", "momentum", "weight_decay",
    "evaluate_every", "start_eval_at", "verbose", "normalization", "activation", "pad_mode", "oversampling",
    "overlap", "include_background", "cudnn_benchmark", "cudnn_deterministic"})


def unused_flags(cfg: Config) -> list[str]:
    """The flags (Config fields) given explicitly (``cfg.explicit``) that do nothing in this run's
    mode, in :data:`runtime.mode.FLAG_USES`' order (defaults never count)."""
    return [name for name in FLAG_USES if name in cfg.explicit and not cfg.mode.uses(name)]


def no_effect_line(cfg: Config) -> str:
    """The one line naming the reference's flags (:data:`REFERENCE_FLAGS`) given explicitly that do
    nothing in this run's mode ("" when none): accepted, as the reference accepts them."""
    unused = [name for name in unused_flags(cfg) if name in REFERENCE_FLAGS]
    if not unused:
        return ""
    flags = ", ".join(f"--{name}" for name in unused)
    verb, noun, pronoun = ("has", "flag", "it") if len(unused) == 1 else ("have", "flags", "them")
    return (f"{flags} {verb} no effect in --exec_mode {cfg.mode.name} (the MLCommons reference's {noun}: "
            f"accepted, as its parser accepts {pronoun} in every mode)")


@dataclass(frozen=True)
class PredictOptions:
    """Predict's inputs, as nnU-Net's predictor takes them: what the plan's inference and precision
    sections are decided from (``runtime.resolve.resolve_predict``), each its flag's value with
    the flag's default. The Python API (``runtime.predict.api.Segmenter``) takes them as they are;
    ``--exec_mode predict`` builds them from its flags (:meth:`of`); training's evaluations and
    evaluate take theirs from their flags alike.

    ``device`` (``--device``: auto, cpu, cuda); ``window`` (``--val_input_shape``; None: the
    checkpoint's training patch, 128³ for a network given or a checkpoint that records none);
    ``overlap``, ``sw_batch_size`` (lowered to fit ``max_memory_gb``, 0: the memory available),
    ``tta``; the precision: ``amp`` and ``amp_dtype``, ``int8`` (``int8_calibration``: the scans
    to calibrate on once; "": each file alone), ``channels_last``, ``compile``; ``backend``
    (``--backend``: auto, torch, openvino) and OpenVINO's ``cache_dir`` ("": the user's cache
    folder); the network flags ``filters``, ``normalization``, ``activation`` (None: the
    checkpoint's; given: checked against it); ``verbose`` prints the lines predict prints
    (window, weights, backend). Checked when made: a bad value raises :class:`UsageError`, the
    command line's one line naming the flag."""

    device: str = Config.device
    window: tuple[int, ...] | None = None
    overlap: float = Config.overlap
    sw_batch_size: int = Config.sw_batch_size
    tta: bool = Config.tta
    amp: bool = Config.amp
    amp_dtype: str = Config.amp_dtype
    backend: str = Config.backend
    int8: bool = Config.int8
    int8_calibration: str = Config.int8_calibration
    channels_last: bool = Config.channels_last
    compile: bool = Config.compile
    cache_dir: str = Config.cache_dir
    max_memory_gb: float = Config.max_memory_gb
    filters: tuple[int, ...] | None = None
    normalization: str | None = None
    activation: str | None = None
    verbose: bool = True

    def __post_init__(self):
        errors = self.errors()
        if errors:
            raise UsageError(errors[0])

    @classmethod
    def of(cls, config: Config) -> "PredictOptions":
        """The options of the parsed flags ``config``: a window and network flags only where given
        (the others are the checkpoint's)."""
        given = {name: getattr(config, name) for name in ("filters", "normalization", "activation")
                 if name in config.explicit}
        window = tuple(config.val_input_shape) if "val_input_shape" in config.explicit else None
        return cls(device=config.device, window=window, overlap=config.overlap, sw_batch_size=config.sw_batch_size,
                   tta=config.tta, amp=config.amp, amp_dtype=config.amp_dtype, backend=config.backend,
                   int8=config.int8, int8_calibration=config.int8_calibration, channels_last=config.channels_last,
                   compile=config.compile, cache_dir=config.cache_dir, max_memory_gb=config.max_memory_gb, **given)

    def architecture(self) -> tuple[dict, frozenset]:
        """``(flags, given)``: the network flags (the defaults where not given) and the names given."""
        values = {name: getattr(self, name) for name in ("filters", "normalization", "activation")}
        given = frozenset(name for name, value in values.items() if value is not None)
        return {name: getattr(Config, name) if value is None else value for name, value in values.items()}, given

    def errors(self) -> list[str]:
        """Every problem with these options, one line each, in the words of the flags' checks
        (``runtime.arguments.validate``)."""
        window = None if self.window is None else list(self.window)
        levels = len(DEFAULT_FILTERS)
        return problems(
            (self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}"),
            (self.backend in BACKENDS, f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}"),
            (self.amp_dtype in AMP_DTYPES,
             f"--amp_dtype must be one of {', '.join(AMP_DTYPES)}, got {self.amp_dtype!r}"),
            (window is None or len(window) == 3, f"--val_input_shape needs 3 sizes, got {len(window or ())}"),
            (window is None or all(isinstance(s, Integral) and s > 0 and s % SHAPE_DIVISOR == 0 for s in window),
             f"--val_input_shape sizes must be positive multiples of {SHAPE_DIVISOR}, got {window}"),
            (0.0 <= self.overlap < 1.0, f"--overlap must be in [0, 1), got {self.overlap}"),
            (isinstance(self.sw_batch_size, Integral) and self.sw_batch_size >= 1,
             f"--sw_batch_size must be >= 1, got {self.sw_batch_size}"),
            (self.max_memory_gb >= 0, f"--max_memory_gb must be >= 0, got {self.max_memory_gb}"),
            (self.filters is None or (len(self.filters) == levels and all(f > 0 for f in self.filters)),
             f"--filters needs {levels} positive widths, got {list(self.filters or ())}"),
            (self.normalization is None or self.normalization in NORMALIZATIONS,
             f"--normalization must be one of {', '.join(NORMALIZATIONS)}, got {self.normalization!r}"),
            (self.activation is None or self.activation in ACTIVATIONS,
             f"--activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}"),
            (self.device != "cuda" or cuda_available(),
             "--device cuda: no CUDA or ROCm GPU is visible here; use --device cpu or auto"),
        ) + int8_problems(self.int8, self.int8_calibration, self.device, self.amp)
