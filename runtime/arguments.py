"""Command line -> one frozen, validated :class:`~runtime.config.Config` (the value and its choices
live in :mod:`runtime.config`, which has no argument parser: the engines import that, never this).

Every flag of the MLCommons reference keeps its name, default and meaning; the flags added
here are marked "(new)" in their help. ``parse_args`` validates once and exits with code 2
and a single line naming the flag on a bad value.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
from typing import Iterable, Mapping, Sequence

from data_loading.cli_types import OneLineParser, positive_int
from model.unet3d import DEFAULT_FILTERS, SHAPE_DIVISOR
from runtime import __version__
from runtime.config import (ACTIVATIONS, AMP_DTYPES, BACKENDS, BRIGHTNESS, CACHES, DEVICES, DIVISIONS,  # noqa: F401
                            EPOCHS_AUTO, LAST_BATCHES, LOADERS, NORMALIZATIONS, OPTIMIZERS, SEMANTICS, STATUSES,
                            REFERENCE_FLAGS, Config, UsageError, checkpoint_path_problem, cuda_available,
                            no_effect_line, unused_flags)
from runtime.mode import FLAG_USES, MODES, exec_modes
from runtime.mode import problems as _problems


# A container's default --log_dir: the image sets it to its writable /results volume (the code
# folder, where a relative "results" would go, belongs to root there).
LOG_DIR_ENV = "UNET3D_LOG_DIR"


def _data_flags(g, d: Config) -> None:
    g.add_argument("--data_dir", default=d.data_dir, help="preprocessed dataset (case_XXXXX_x/_y.npy)")
    g.add_argument("--log_dir", default=os.environ.get(LOG_DIR_ENV) or d.log_dir,
                   help="folder for unet3d.log (MLPerf) and log.json; one run at a time (a lock file); "
                        f"default ${LOG_DIR_ENV} where set (the project's images: /results), else results")
    g.add_argument("--save_ckpt_path", default=d.save_ckpt_path, help="checkpoint file to write ('' = none)")
    g.add_argument("--load_ckpt_path", nargs="+", default=d.load_ckpt_path,
                   help="checkpoint to load (evaluate, or warm start); predict takes several (new): an ensemble "
                        "averaging their softmax probabilities (docs/predict.md)")
    g.add_argument("--pretrained_weights", default=d.pretrained_weights, metavar="CHECKPOINT",
                   help="(new) train starting from this checkpoint's weights, as nnU-Net's -pretrained_weights: "
                        "on data of another label set every layer but the output, which starts anew; the run "
                        "is open (docs/own-data.md)")
    g.add_argument("--resume", action="store_true", help="(new) continue the run saved at --save_ckpt_path")
    g.add_argument("--ckpt_during_run", action="store_true",
                   help="(new) also write --save_ckpt_path during the run: at every evaluation, every "
                        "--ckpt_every_epochs / --ckpt_every_minutes, on SIGTERM/SIGUSR1; these writes are on "
                        "the MLPerf clock, so the run is not a result (its log says checkpoints_on_the_clock). "
                        "Without it the checkpoint is written once, after run_stop (a signal's too)")
    g.add_argument("--ckpt_every_epochs", type=int, default=d.ckpt_every_epochs,
                   help="(new) with --ckpt_during_run (N > 0 implies it), also save --save_ckpt_path every N "
                        "epochs between evaluations (0 = off)")
    g.add_argument("--ckpt_every_minutes", type=float, default=d.ckpt_every_minutes,
                   help="(new) with --ckpt_during_run, also save --save_ckpt_path when this many minutes of "
                        "training passed since the last save (0 = off)")
    g.add_argument("--loader", default=d.loader, choices=list(LOADERS),
                   help="real data pipeline, or random tensors for pure compute benchmarks")
    g.add_argument("--cache", default=d.cache, choices=list(CACHES),
                   help="(new) where training volumes live: re-read per sample, memory-mapped in RAM, "
                        "or on the GPU with augmentations there; auto = device on CUDA, memory on CPU")
    g.add_argument("--num_workers", type=int, default=d.num_workers, help="CPU data-loading workers")
    g.add_argument("--prefetch", type=int, default=d.prefetch,
                   help="(new) batches prepared ahead in a background thread (0 = off)")
    g.add_argument("--brightness", default=d.brightness, choices=list(BRIGHTNESS),
                   help="(new) brightness augmentation factor: reference = x(1+U(0.7,1.3)) as the "
                        "MLCommons code does; centered = xU(0.7,1.3)")


def _process_flags(g, d: Config) -> None:
    g.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="GPU index on this node (torchrun sets LOCAL_RANK)")
    g.add_argument("--device", default=d.device, choices=list(DEVICES),
                   help="(new) auto = CUDA/ROCm when available, else CPU")
    g.add_argument("--exec_mode", default=d.exec_mode, choices=exec_modes(),
                   help="train to the target, evaluate --load_ckpt_path on the evaluation cases, or "
                        "predict: segment the raw NIfTI scans of --input into --output_dir")
    g.add_argument("--benchmark", action="store_true",
                   help="time iterations and print the predicted MLPerf time to train (training: the steps, then "
                        "one evaluation pass); no evaluation schedule, no checkpoints; with --log_dir given, its "
                        "numbers in <log_dir>/log.json under the reference's keys")
    _benchmark_budget_flags(g, d)
    g.add_argument("--seed", type=int, default=d.seed, help="master seed; -1 = random from the OS")
    g.add_argument("--verbose", "-v", action="store_true", help="progress bars")
    g.add_argument("--plot", action="store_true",
                   help="(new) redraw <log_dir>/curves.png after each evaluation (rank 0, in the "
                        "background; needs matplotlib)")


# --benchmark's budget (new): given without a value, a budget that suits a CPU; absent, --benchmark
# times every step of --epochs as it always did. Checked against the mode in runtime.resolve.
BENCHMARK_STEPS_CPU = 20
BENCHMARK_SECONDS_CPU = 300.0


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return seconds


def _benchmark_budget_flags(g, d: Config) -> None:
    g.add_argument("--benchmark_steps", type=positive_int, nargs="?", const=BENCHMARK_STEPS_CPU,
                   default=d.benchmark_steps, metavar="N",
                   help=f"(new) --benchmark: stop after N timed training steps (evaluate: volumes; training's "
                        f"evaluation pass then times one volume per rank, extrapolated by windows); without N: "
                        f"{BENCHMARK_STEPS_CPU}; absent (0): every step of --epochs")
    g.add_argument("--benchmark_seconds", type=_positive_seconds, nargs="?", const=BENCHMARK_SECONDS_CPU,
                   default=d.benchmark_seconds, metavar="S",
                   help=f"(new) --benchmark: stop timing once S seconds of timed steps have run (the step "
                        f"under way completed), and training's evaluation pass after S more (at least one "
                        f"volume); without S: {BENCHMARK_SECONDS_CPU:g}; absent (0): no time limit")


def epochs_value(value: str) -> int | str:
    """argparse ``type=`` of ``--epochs``: an integer (checked later) or ``auto``."""
    if value == EPOCHS_AUTO:
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or auto, got {value!r}") from None


def _schedule_flags(g, d: Config) -> None:
    g.add_argument("--epochs", type=epochs_value, default=d.epochs,
                   help="maximum number of epochs; auto: the MLPerf non-convergence limit "
                        "ceil(10000*168/samples_per_epoch) at the run's global batch")
    g.add_argument("--quality_threshold", type=float, default=d.quality_threshold, help="target mean_dice")
    g.add_argument("--ga_steps", type=positive_int, default=d.ga_steps, help="gradient accumulation steps")
    g.add_argument("--warmup_steps", type=int, default=d.warmup_steps, help="untimed iterations in --benchmark")
    g.add_argument("--batch_size", type=positive_int, default=d.batch_size, help="per-process batch size")
    g.add_argument("--evaluate_every", "--eval_every", dest="evaluate_every", type=int, default=None,
                   help="epochs between evaluations (default from samples_per_epoch, as MLPerf)")
    g.add_argument("--start_eval_at", type=int, default=None,
                   help="first epoch evaluated (default from samples_per_epoch, as MLPerf)")


def _shape_flags(g, d: Config) -> None:
    g.add_argument("--layout", default="NCDHW", choices=["NCDHW"],
                   help="accepted for the reference's scripts, which pass it; --channels_last picks the "
                        "memory layout")
    g.add_argument("--pad_mode", default="reflect", choices=["constant", "edge", "reflect", "median", "symmetric"],
                   help="accepted for the reference's scripts and read by no mode, as in the reference, whose "
                        "sliding window pads with a constant whatever it says")
    g.add_argument("--input_shape", nargs="+", type=int, default=list(d.input_shape), help="training patch")
    g.add_argument("--val_input_shape", nargs="+", type=int, default=list(d.val_input_shape),
                   help="sliding-window size; predict's default is the checkpoint's training patch "
                        "(its --input_shape; 128 128 128 when the checkpoint records none), evaluate's "
                        "the benchmark's 128 128 128")


def _optimisation_flags(g, d: Config) -> None:
    g.add_argument("--optimizer", default=d.optimizer, choices=list(OPTIMIZERS),
                   help="sgd = SGD with Nesterov momentum; lamb in pure PyTorch")
    g.add_argument("--learning_rate", type=float, default=d.learning_rate, help="base learning rate after warm-up")
    g.add_argument("--init_learning_rate", type=float, default=d.init_learning_rate, help="warm-up start")
    g.add_argument("--lr_warmup_epochs", type=int, default=d.lr_warmup_epochs,
                   help="epochs of linear warm-up from --init_learning_rate")
    g.add_argument("--lr_decay_epochs", nargs="*", type=int, default=list(d.lr_decay_epochs),
                   help="MultiStepLR milestones (epochs)")
    g.add_argument("--lr_decay_factor", type=float, default=d.lr_decay_factor,
                   help="multiplier applied at each --lr_decay_epochs milestone")
    g.add_argument("--lamb_betas", nargs=2, type=float, default=list(d.lamb_betas),
                   help="LAMB betas (floats; the reference's type=int was a defect); Adam keeps torch's defaults")
    g.add_argument("--momentum", type=float, default=d.momentum, help="SGD (Nesterov) momentum")
    g.add_argument("--weight_decay", type=float, default=d.weight_decay, help="L2 weight decay")


def _model_flags(g, d: Config) -> None:
    g.add_argument("--normalization", default=d.normalization, choices=list(NORMALIZATIONS),
                   help="norm after every 3x3x3 convolution (the benchmark uses instancenorm)")
    g.add_argument("--activation", default=d.activation, choices=list(ACTIVATIONS),
                   help="activation after every norm (leaky_relu slope 0.01)")
    g.add_argument("--filters", nargs="+", type=int, default=list(d.filters),
                   help="(new) channel widths; the default is the benchmark's model")
    g.add_argument("--include_background", action="store_true", help="count background in the Dice loss")


def _augmentation_and_evaluation_flags(g, d: Config) -> None:
    g.add_argument("--oversampling", type=float, default=d.oversampling,
                   help="probability of a foreground-centred crop")
    g.add_argument("--overlap", type=float, default=d.overlap, help="sliding-window overlap in [0, 1)")
    g.add_argument("--semantics", default=d.semantics, choices=list(SEMANTICS),
                   help="(new) reference: the MLCommons code's crop sampler (its randrange never draws the last "
                        "position; its foreground rule) and, with --last_batch drop, the epoch's last partial "
                        "gradient accumulation dropped (a closed run needs the sampler); project: this project's "
                        "fixes (every crop position; a long "
                        "foreground box's patch kept over the component; the partial accumulation stepped): an open "
                        "run. Both evaluate at --start_eval_at and every --evaluate_every epochs after it")
    g.add_argument("--last_batch", default=d.last_batch, choices=list(LAST_BATCHES),
                   help="(new) where the global batch does not divide the training cases: pad = every case "
                        "once per epoch, the last step padded with repeated cases of weight 0 in the loss (the "
                        "rules); drop = the reference's drop_last, the remainder not trained (an open run)")
    g.add_argument("--sw_batch_size", type=positive_int, default=d.sw_batch_size,
                   help="(new) sliding windows per forward pass (same result, faster)")


def _speed_flags(g, d: Config) -> None:
    g.add_argument("--amp", action="store_true",
                   help="mixed precision (autocast); CPU training: bf16 only where the CPU has native bf16 dot "
                        "products (avx512_bf16/amx_bf16), else float32 (one line says which)")
    g.add_argument("--amp_dtype", default=d.amp_dtype, choices=list(AMP_DTYPES),
                   help="(new) autocast type; auto = fp16 + grad scaler on CUDA, bf16 on CPU")
    g.add_argument("--channels_last", action="store_true", help="(new) channels-last 3-D memory format; CPU training also fuses each instance norm + "
                        "activation (compiled once; docs/performance.md, \"CPU training step\")")
    g.add_argument("--compile", action="store_true", help="(new) torch.compile the model and loss")
    g.add_argument("--cuda_graphs", action="store_true", help="(new) capture the training step in a CUDA graph")
    g.add_argument("--fused_optimizer", action="store_true", help="(new) fused optimizer step where torch has one for the device (CUDA; the CPU's fused SGD and Adam in recent torch), else the default step")
    g.add_argument("--cudnn_benchmark", action="store_true", help="let cuDNN pick the fastest kernels")
    g.add_argument("--cudnn_deterministic", action="store_true", help="deterministic cuDNN kernels")


def _submission_flags(g, d: Config) -> None:
    g.add_argument("--submission_org", default=d.submission_org, help="MLPerf submitter")
    g.add_argument("--submission_platform", default=d.submission_platform, help="MLPerf system name")
    g.add_argument("--submission_division", default=d.submission_division, choices=list(DIVISIONS),
                   help="MLPerf division; auto (new): closed when the run is the reference's benchmark (model, loss, "
                        "SGD, the fixed values, --semantics reference, --last_batch pad, the rules' evaluation schedule, "
                        "KiTS19's 168/42 cases), else open with one "
                        "line saying why; closed on any other run is refused")
    g.add_argument("--submission_status", default=d.submission_status,
                   choices=list(STATUSES), help="MLPerf system status")


def _predict_flags(g, d: Config) -> None:
    g.add_argument("--input", default=d.input,
                   help="(new) predict: a CT scan (.nii/.nii.gz; .nrrd/.nhdr/.mha/.mhd or a DICOM series' folder or "
                        "file with SimpleITK), a folder of scan files, or a KiTS19 tree; any orientation "
                        "(docs/scans.md)")
    g.add_argument("--output_dir", default=d.output_dir,
                   help="(new) predict: folder for <case>.nii.gz segmentations and summary.csv/.jsonl")
    g.add_argument("--truth", default=d.truth, metavar="DIR",
                   help="(new) predict: the ground truths to score against, <case>.nii.gz (nnU-Net's labelsTr; a "
                        "scan <case>_0000.nii.gz finds <case>.nii.gz) or <case>/segmentation.nii.gz; without it, "
                        "a labelsTr folder beside the scans' imagesTr, or a KiTS case's segmentation.nii.gz")
    g.add_argument("--tta", action="store_true",
                   help="(new) predict: test-time mirroring, softmax averaged over the 8 flips of the 3 axes")
    g.add_argument("--preview", action="store_true",
                   help="(new) predict: a PNG per case, axial, coronal and sagittal views through the most tumour "
                        "(needs matplotlib)")
    g.add_argument("--force", action="store_true",
                   help="(new) predict: segment every scan again, replacing the outputs of another model too "
                        "(default: an existing output is reused when its record says it was made the way "
                        "this run would make it, segmented again when made otherwise by the same weights, "
                        "and kept when other weights made it)")
    g.add_argument("--save_probabilities", action="store_true",
                   help="(new) predict: also write <case>.npz, the softmax (key 'probabilities', float16, classes "
                        "first) in the scan's own grid and axis order, whose argmax is the segmentation")
    g.add_argument("--int8", action="store_true",
                   help="(new) predict on a CPU: int8 windows on the OpenVINO backend (NNCF, calibrated on each "
                        "scan alone unless --int8_calibration names a set; needs requirements-openvino.txt): faster, "
                        "with int8 rounding (docs/predict.md)")
    g.add_argument("--int8_calibration", default=d.int8_calibration, metavar="PATH",
                   help="(new) predict --int8: calibrate once on these scans (a scan file or a folder, as --input "
                        "takes) instead of on each scan alone; the record names them (docs/predict.md)")


def _backend_flags(g, d: Config) -> None:
    g.add_argument("--backend", default=d.backend, choices=list(BACKENDS),
                   help="(new) predict and evaluate: who runs the network's windows. auto: predict takes "
                        "OpenVINO on the CPU when installed (pip install -r requirements-openvino.txt) and no "
                        "PyTorch lever (--amp, --compile, --channels_last) is given, else PyTorch (both fp32); "
                        "evaluate takes PyTorch, the network as trained. Training is PyTorch")
    g.add_argument("--max_memory_gb", type=float, default=d.max_memory_gb,
                   help="(new) predict: lower the window batch so the estimated peak memory fits this "
                        "many GB (0: the memory available at start)")
    g.add_argument("--cache_dir", default=d.cache_dir,
                   help="(new) predict and evaluate with OpenVINO: the folder for its converted networks (default: "
                        "$XDG_CACHE_HOME/unet3d-kits19, else ~/.cache/unet3d-kits19); never beside an input")


# The command line, one argparse group per entry, in the order ``--help`` shows them.
FLAG_GROUPS = (
    ("data and files", _data_flags),
    ("process", _process_flags),
    ("schedule", _schedule_flags),
    ("shapes", _shape_flags),
    ("optimisation", _optimisation_flags),
    ("model", _model_flags),
    ("augmentation and evaluation", _augmentation_and_evaluation_flags),
    ("speed", _speed_flags),
    ("MLPerf submission metadata (new)", _submission_flags),
    ("predict (new)", _predict_flags),
    ("inference backend (new)", _backend_flags),
)


def build_parser(prog: str = "main.py") -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, version=__version__, description="3D U-Net on KiTS19 (MLPerf Training image "
                           "segmentation): train, evaluate, benchmark and predict.",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = Config()
    for title, add_flags in FLAG_GROUPS:
        add_flags(parser.add_argument_group(title), defaults)
    return parser


def _count_errors(cfg: Config) -> list[str]:
    """Epochs, workers, warm-up and evaluation schedule: counts of every mode."""
    if cfg.epochs == EPOCHS_AUTO:
        # plain evaluate reads no --epochs (a script's shared flag set passes): only evaluate
        # --benchmark, which trains nothing, counts passes with it
        errors = _problems((not (cfg.mode.uses("epochs") and not cfg.mode.trains),
                            "--epochs auto is training's non-convergence limit; give evaluate --benchmark a number "
                            "of passes"))
    else:
        errors = _problems((cfg.epochs >= 1, f"--epochs must be >= 1, got {cfg.epochs}"))
    for name in ("num_workers", "prefetch", "warmup_steps", "lr_warmup_epochs"):
        errors += _problems((getattr(cfg, name) >= 0, f"--{name} must be >= 0, got {getattr(cfg, name)}"))
    for name in ("evaluate_every", "start_eval_at"):
        value = getattr(cfg, name)
        errors += _problems((value is None or value >= 1, f"--{name} must be >= 1, got {value}"))
    return errors


def _shape_errors(cfg: Config) -> list[str]:
    """Patch and window sizes the network can take, and its channel widths."""
    errors = []
    for name in ("input_shape", "val_input_shape"):
        shape = getattr(cfg, name)
        errors += _problems(
            (len(shape) == 3, f"--{name} needs 3 sizes, got {len(shape)}"),
            (all(s > 0 and s % SHAPE_DIVISOR == 0 for s in shape),
             f"--{name} sizes must be positive multiples of {SHAPE_DIVISOR}, got {list(shape)}"))
    if cfg.mode.trains:
        errors += _training_shape_errors(cfg)
    levels = len(DEFAULT_FILTERS)
    errors += _problems((len(cfg.filters) == levels and all(f > 0 for f in cfg.filters),
                         f"--filters needs {levels} positive widths, got {list(cfg.filters)}"))
    return errors


def _training_shape_errors(cfg: Config) -> list[str]:
    """Training normalises each sample's bottleneck: instance norm needs more than one voxel there."""
    if cfg.normalization != "instancenorm" or len(cfg.input_shape) != 3:
        return []
    bottleneck = [s // SHAPE_DIVISOR for s in cfg.input_shape]
    return _problems((bottleneck[0] * bottleneck[1] * bottleneck[2] > 1,
                      f"--input_shape {list(cfg.input_shape)} leaves a single bottleneck voxel, which "
                      f"instance norm cannot normalise in training: use at least one size >= 64 or "
                      f"--normalization batchnorm"))


def _range_errors(cfg: Config) -> list[str]:
    """Values with a range: sampling, optimiser, target, seed, rank, memory limit."""
    return _problems(
        (0.0 <= cfg.overlap < 1.0, f"--overlap must be in [0, 1), got {cfg.overlap}"),
        (0.0 <= cfg.oversampling <= 1.0, f"--oversampling must be in [0, 1], got {cfg.oversampling}"),
        (all(0.0 <= b < 1.0 for b in cfg.lamb_betas),
         f"--lamb_betas must be in [0, 1), got {list(cfg.lamb_betas)}"),
        (0.0 <= cfg.momentum < 1.0, f"--momentum must be in [0, 1), got {cfg.momentum}"),
        (cfg.learning_rate > 0, f"--learning_rate must be > 0, got {cfg.learning_rate}"),
        (cfg.init_learning_rate >= 0, f"--init_learning_rate must be >= 0, got {cfg.init_learning_rate}"),
        (cfg.weight_decay >= 0, f"--weight_decay must be >= 0, got {cfg.weight_decay}"),
        (cfg.lr_decay_factor > 0, f"--lr_decay_factor must be > 0, got {cfg.lr_decay_factor}"),
        (all(e >= 1 for e in cfg.lr_decay_epochs),
         f"--lr_decay_epochs must be >= 1, got {list(cfg.lr_decay_epochs)}"),
        (0.0 < cfg.quality_threshold <= 1.0,
         f"--quality_threshold must be in (0, 1], got {cfg.quality_threshold}"),
        (-1 <= cfg.seed < 2**63, f"--seed must be -1 (random) or in [0, 2^63), got {cfg.seed}"),
        (cfg.local_rank >= 0, f"--local_rank must be >= 0, got {cfg.local_rank}"),
        (cfg.max_memory_gb >= 0, f"--max_memory_gb must be >= 0, got {cfg.max_memory_gb}"))


def _file_and_device_errors(cfg: Config) -> list[str]:
    """Paths that must exist, checkpoints, and a CUDA device when asked for."""
    errors = []
    if cfg.loader == "pytorch" and cfg.mode.scores:
        errors += _problems((os.path.isdir(cfg.data_dir),
                             f"--data_dir {cfg.data_dir!r} does not exist or is not a folder"))
    for path in cfg.checkpoints:
        errors += _problems((os.path.isfile(path), checkpoint_path_problem(path, "--load_ckpt_path")))
    if cfg.truth:
        errors += _problems((os.path.isdir(cfg.truth), f"--truth {cfg.truth!r} does not exist or is not a folder"))
    if cfg.pretrained_weights:
        errors += _problems((os.path.isfile(cfg.pretrained_weights),
                             checkpoint_path_problem(cfg.pretrained_weights, "--pretrained_weights")),
                            (not cfg.load_ckpt_path, "--pretrained_weights and --load_ckpt_path are two starting "
                                                     "points: give one"))
    if len(cfg.checkpoints) > 1 and not cfg.mode.predicts:
        errors.append(f"--load_ckpt_path takes one checkpoint for --exec_mode {cfg.mode.name}, got "
                      f"{len(cfg.checkpoints)} (several: an ensemble, predict only)")
    if cfg.resume:
        errors += _problems((bool(cfg.save_ckpt_path),
                             "--resume needs --save_ckpt_path (the checkpoint to continue)"))
    if cfg.device == "cuda":
        errors += _problems((cuda_available(),
                             "--device cuda: no CUDA or ROCm GPU is visible here; use --device cpu or auto"))
    return errors + _problems(
        (cfg.ckpt_every_epochs >= 0, f"--ckpt_every_epochs must be >= 0, got {cfg.ckpt_every_epochs}"),
        (cfg.ckpt_every_minutes >= 0, f"--ckpt_every_minutes must be >= 0, got {cfg.ckpt_every_minutes}"))


def _mode_names(flag: str) -> str:
    """The modes that use ``flag``, in the table's order."""
    return ", ".join(mode.name for mode in MODES.values() if mode.uses(flag))


def _unused_text(names: Sequence[str], mode: str) -> str:
    """``--a, --b do nothing in --exec_mode M (where they apply)`` for the flags ``names``."""
    groups: dict[str, list[str]] = {}  # the modes that use them -> the flags
    for name in names:
        groups.setdefault(_mode_names(name) or "no mode", []).append(f"--{name}")
    flags = ", ".join(f"--{name}" for name in names)
    verb = "does" if len(names) == 1 else "do"
    if len(groups) == 1:
        where = f"{'it applies' if len(names) == 1 else 'they apply'} to {next(iter(groups))}"
    else:
        where = "; ".join(f"{', '.join(flags_of)}: {modes}" for modes, flags_of in groups.items())
    return f"{flags} {verb} nothing in --exec_mode {mode} ({where})"


def unused_flag_errors(cfg: Config) -> list[str]:
    """One message naming every flag of this project's own (not :data:`REFERENCE_FLAGS`) given
    explicitly that does nothing in this run's mode, and the mode; none when there is none."""
    unused = [name for name in unused_flags(cfg) if name not in REFERENCE_FLAGS]
    if not unused:
        return []
    return [f"{_unused_text(unused, cfg.mode.name)}; drop {'it' if len(unused) == 1 else 'them'}"]


def used_in(mode: str, argv: Sequence[str]) -> list[str]:
    """``argv`` (main.py's flags) without the flags, and their values, that do nothing in ``mode``
    (a name of :data:`runtime.mode.MODES`): one set of flags for runs of several modes (a tool's, a test's)."""
    dests = {option: action.dest for action in build_parser()._actions for option in action.option_strings}
    kept, keep = [], True
    for token in argv:
        if token.startswith("--"):
            flag = dests.get(token.split("=")[0], "")
            keep = flag not in FLAG_USES or MODES[mode].uses(flag)
        if keep:
            kept.append(token)
    return kept


def validate(cfg: Config) -> list[str]:
    """Every problem with ``cfg``, as one message each naming the flag: the checks every mode
    shares, then those of its mode (``Mode.checks``), then the flags given that do nothing in
    this mode (:data:`runtime.mode.FLAG_USES`)."""
    errors = _count_errors(cfg) + _shape_errors(cfg) + _range_errors(cfg) + _file_and_device_errors(cfg)
    return errors + cfg.mode.errors(cfg) + unused_flag_errors(cfg)


# The reference's flags accepted for its scripts and kept in no Config field: --layout (one
# choice, NCDHW; --channels_last picks the memory layout) and --pad_mode (the reference reads it
# nowhere: its sliding window pads with a constant).
ACCEPTED_ONLY = ("layout", "pad_mode")


def config_from_namespace(ns: argparse.Namespace, explicit: frozenset = frozenset()) -> Config:
    values = {name: value for name, value in vars(ns).items() if name not in ACCEPTED_ONLY}
    values["explicit"] = explicit
    for name in ("input_shape", "val_input_shape", "filters", "lr_decay_epochs", "lamb_betas"):
        values[name] = tuple(values[name])
    if isinstance(values["load_ckpt_path"], (list, tuple)):  # nargs="+": the first, and (several) all of them
        paths = tuple(values["load_ckpt_path"])
        values["load_ckpt_path"], values["load_ckpt_paths"] = paths[0], (paths if len(paths) > 1 else ())
    return Config(**values)


def explicit_flags(argv: Sequence[str] | None = None,
                   parser: argparse.ArgumentParser | None = None) -> frozenset[str]:
    """The Config fields (argparse ``dest``) given on the command line ``argv`` (default
    ``sys.argv[1:]``), whatever their value: a flag given with its default value counts.

    Parses ``argv`` again with every default suppressed, so only given flags appear; aliases
    (``--eval_every``) map to their field. Unknown arguments are ignored; ``argv`` is expected
    to parse (``parse_args`` parses it first and reports bad values).
    """
    parser = copy.deepcopy(parser) if parser is not None else build_parser()  # never the caller's
    for action in parser._actions:
        action.default = argparse.SUPPRESS
        action.required = False
    namespace, _ = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    return frozenset(vars(namespace))


def given_flags(values: Mapping[str, object], given: Iterable[str], actions: Sequence) -> list[str]:
    """main.py's command line rebuilt from the parsed ``values`` ({dest: value}) of the flags
    ``given`` (argparse dests), in the parser's order (``actions``: its ``_actions``)."""
    flags: list[str] = []
    for action in actions:
        if action.dest not in given or not action.option_strings or action.dest not in values:
            continue
        option = f"--{action.dest}" if f"--{action.dest}" in action.option_strings else action.option_strings[0]
        value = values[action.dest]
        if action.nargs == 0:  # store_true / store_false / BooleanOptionalAction
            negative = [o for o in action.option_strings if o.startswith("--no-") or o.startswith("--no_")]
            if value == action.const or (action.const is None and value):
                flags.append(option)
            elif negative and not value:
                flags.append(negative[0])
            continue
        flags.append(option)
        if isinstance(value, (list, tuple)):
            flags += [str(v) for v in value]
        else:
            flags.append(str(value))
    return flags


def recipe_flags(config: Config) -> tuple[str, ...]:
    """main.py's command line rebuilt from the parsed ``config``: the flags given, in the parser's
    order (what ``run_description.json`` records as the run's recipe: ``runtime.host.record_run``)."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return tuple(given_flags(values, config.explicit, build_parser()._actions))


def parse_args(argv: Sequence[str] | None = None, prog: str = "main.py") -> Config:
    """Parse and validate; on any bad value print one line naming the flag and exit 2."""
    parser = build_parser(prog)
    cfg = config_from_namespace(parser.parse_args(argv), explicit_flags(argv, parser))
    errors = validate(cfg)
    if errors:
        parser.exit(2, f"{prog}: error: {errors[0]}\n")
    return cfg


def replace(cfg: Config, **changes) -> Config:
    """A new Config with ``changes`` (the config itself is never mutated)."""
    return dataclasses.replace(cfg, **changes)


if __name__ == "__main__":  # pragma: no cover - convenience
    print(parse_args(sys.argv[1:]))
