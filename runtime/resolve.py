"""Every "auto" and every derived value of a run, decided once, in two stages, into one value:
the :class:`~runtime.plan.RunPlan`, in sections.

* ``resolve(config, dist_info, None, checkpoint)``: everything that needs no data, right after
  the process group starts and before any MLPerf event (nothing here lists, opens or maps a
  file of ``--data_dir``: the MLPerf clock has not started);
* ``resolve_data(plan, dist_info, summary)``: the values that need the data (case counts,
  samples per epoch and the evaluation schedule, the cache mode), right after ``run_start``,
  from the data source's ``summary(use)``: a new plan (its data section, training's schedule).

Tools with no MLPerf clock (the benchmarks) pass the data source to ``resolve`` and get both
stages at once. The parsed :class:`~runtime.config.Config` is never changed: each decision is
one pure ``decide_*`` function whose arguments name what it depends on (the flags, the device,
the checkpoint, and the earlier decisions it needs), returning the decided value and its
:class:`~runtime.plan.Decision` (what runs, why, what was asked). Each section of the plan has
its composer, chosen by what the mode does: :func:`decide_network` and :func:`decide_precision`
for every run, :func:`decide_training` where the mode trains, :func:`decide_inference` for the
windows every mode computes (training's evaluations, evaluate, predict); :func:`resolve` calls
them in a visible order and builds the plan from them, which the checkpoint saves. Predict's
Python API plans from its :class:`~runtime.config.PredictOptions` (:func:`resolve_predict`), with
no command line; ``--exec_mode predict`` plans through it too. Nothing after decides again. The
one process-wide effect of a decision, the host-memory reuse, is :func:`apply_host_memory`,
called right after ``resolve``. A flag combination that cannot run
here raises :class:`UsageError` (one line).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from types import SimpleNamespace
from typing import Collection

import torch

from runtime import distributed as D
from runtime.config import CACHES, Config, PredictOptions, UsageError, no_effect_line
from runtime.checkpoint import ARCHITECTURE, Saved, TrainedNetwork, saved_seed, trained_network
from runtime.compiling import compile_unavailable
from runtime.division import data_reasons, decide, flag_reasons, own_data_reason
from runtime.inference.backends import decide_backend
from runtime.inference.memory_budget import bounded_window_batch
from runtime.labels import LabelError, LabelSet, decide_label_set, of_description
from runtime.levers.cpu.host_memory import reuse_freed_memory
from runtime.levers.cpu.isa import int8_pairs_saturate, native_bf16
from runtime.optimizers import default_step, fused_step
from runtime.mode import MODES, Mode
from runtime.plan import DataPlan, Decision, InferencePlan, NetworkPlan, PrecisionPlan, RunPlan, TrainingPlan
from runtime.schedule import eval_schedule, rules_schedule, samples_per_epoch, samples_trained_per_epoch
from runtime.spacing import KITS19_SPACING, SpacingError, decide_spacing


def recorded(decisions: tuple[Decision, ...], *made: Decision | None) -> tuple[Decision, ...]:
    """``decisions`` with ``made`` recorded (None: nothing decided); a later stage deciding a name
    again (the data stage's division) replaces the earlier record, so each is recorded once."""
    made = tuple(d for d in made if d is not None)
    names = {d.name for d in made}
    return tuple(d for d in decisions if d.name not in names) + made


def amp_dtype_for(amp_dtype: str, device: torch.device) -> str:
    """The autocast type ``--amp_dtype`` means on ``device``: auto = fp16 on CUDA, bf16 elsewhere."""
    if amp_dtype == "auto":
        return "fp16" if device.type == "cuda" else "bf16"
    if amp_dtype == "fp16" and device.type != "cuda":
        raise UsageError("--amp_dtype fp16 needs a GPU; use --amp_dtype bf16 on the CPU")
    return amp_dtype


def check_device_support(normalization: str, dist_info: D.DistInfo) -> None:
    if normalization == "syncbatchnorm" and dist_info.device.type != "cuda" and dist_info.distributed:
        raise UsageError("--normalization syncbatchnorm needs GPUs; use batchnorm on the CPU")


def precision_text(amp: bool, amp_dtype: str) -> str:
    return f"{amp_dtype} autocast" if amp else "float32"


def decide_device(asked: str, device: torch.device) -> Decision:
    """The device the run computes on (``runtime.distributed.select_device``, before resolve)."""
    why = "" if asked == device.type else f"--device {asked}: {device}"
    return Decision("device", device.type, why, asked)


def trains_bf16_on_cpu(trains: bool, amp: bool, amp_dtype: str, device: torch.device) -> bool:
    """Whether the run trains in bf16 autocast on the CPU: :func:`decide_amp` then asks the CPU for
    native bf16, and the run says its answer (:func:`said_lines`)."""
    return trains and amp and amp_dtype == "bf16" and device.type == "cpu"


def decide_amp(amp: bool, amp_dtype: str, int8: bool, trains: bool, device: torch.device) -> tuple[bool, str, Decision]:
    """``(amp, amp_dtype, decision)``: ``--amp``'s type on ``device`` (:func:`amp_dtype_for`),
    training's float32 fallback on a CPU without native bf16 (oneDNN emulates bf16 there, slower
    than float32; docs/performance.md; its ``why`` said by :func:`said_lines`), predict's ``--int8``."""
    asked = f"--amp --amp_dtype {amp_dtype}" if amp else "float32"
    runs, dtype = amp, amp_dtype_for(amp_dtype, device) if amp else amp_dtype
    why = f"--amp_dtype auto on {device.type}" if amp and amp_dtype == "auto" else ""
    if trains_bf16_on_cpu(trains, amp, dtype, device):
        native, reason = native_bf16()
        why = f"bf16: {reason}; " + ("training in bf16 autocast" if native else "training in float32 instead")
        runs = native
    if int8:
        return runs, dtype, Decision("precision", "int8", "", "--int8")
    return runs, dtype, Decision("precision", precision_text(runs, dtype), why, asked)


def decide_fused_optimizer(config: Config, device: torch.device) -> tuple[bool, bool, Decision | None]:
    """``(fused, foreach, decision)``: ``--fused_optimizer`` as it runs here (training): torch's
    fused step where it has one for ``--optimizer`` on ``device`` (:func:`runtime.optimizers.fused_step`,
    which tries one step), else the default step, multi-tensor (foreach) on CUDA
    (:func:`runtime.optimizers.default_step`); the optimizer is built, and a resumed one kept,
    with this choice."""
    if not config.mode.trains:
        return config.fused_optimizer, False, None
    foreach, default = default_step(config.optimizer, device)
    if not config.fused_optimizer:
        return False, foreach, Decision("fused_optimizer", False, default, False)
    runs, why = fused_step(config.optimizer, device)
    if not runs:
        why = f"{why} ({default.removeprefix('the default step: ')})" if foreach else why
    return runs, foreach and not runs, Decision("fused_optimizer", runs, why, True)


def reuses_host_memory(trains: bool, device: torch.device) -> bool:
    """Training on the CPU, evaluation and predict reuse freed host memory: every step's
    activations and gradients are the same large blocks again (docs/performance.md,
    "The fast CPU settings"); a GPU training run's tensors are not host memory."""
    return not trains or device.type == "cpu"


def decide_host_memory(trains: bool, device: torch.device) -> Decision:
    """The host-memory decision (value: whether freed blocks are reused; :func:`apply_host_memory`)."""
    reuse = reuses_host_memory(trains, device)
    why = ("freed blocks reused: the same large blocks every step" if reuse else
           "training on the GPU: its tensors are not host memory")
    return Decision("host_memory", reuse, why)


def apply_host_memory(plan: RunPlan, verbose: bool = False) -> None:
    """The host-memory decision put into effect (glibc's ``mallopt``: process-wide, so not in
    :func:`resolve` itself): call it right after ``resolve``, before the model is built. Says why
    it cannot (``verbose``: ``--verbose``)."""
    if not plan.host_memory:
        return
    why_not = reuse_freed_memory()
    if why_not and verbose:
        print(f"host memory: freed blocks go back to the system ({why_not})")


def decide_cuda_graphs(config: Config, dist_info: D.DistInfo, amp: bool, amp_dtype: str) -> Decision:
    """``--cuda_graphs`` as it can run here with the run's precision, with why it is off (said
    by :func:`said_lines`)."""
    if not config.cuda_graphs:
        return Decision("cuda_graphs", False, "", False)
    from runtime.levers.gpu.graphs import cuda_graphs_supported

    # what the capture depends on: the flags, with the precision that runs
    step = SimpleNamespace(ga_steps=config.ga_steps, amp=amp, amp_dtype=amp_dtype, optimizer=config.optimizer)
    ok, reason = cuda_graphs_supported(dist_info.device, step, dist_info.world_size)
    return Decision("cuda_graphs", ok, reason if not ok else "", True)


def decide_compile(asked: bool, unavailable: str | None) -> Decision:
    """``--compile`` as it runs here: off, with why, where this torch cannot compile
    (``unavailable``: :func:`runtime.compiling.compile_unavailable`); the builders (the model,
    the loss, the inference copy, the levers' fused norm) and the warm-up obey it."""
    if not asked:
        return Decision("compile", False, "", False)
    if unavailable:
        return Decision("compile", False, f"--compile ignored: {unavailable}; running eagerly", True)
    return Decision("compile", True, "", True)


def decide_seed(asked: int, device: torch.device, saved: Saved | None) -> Decision:
    """The master seed: the resumed run's, else ``--seed``, else drawn on rank 0 and broadcast (a
    collective)."""
    seed = saved_seed(saved.checkpoint) if saved is not None and saved.resume else None
    why = "the resumed run's"
    if seed is None:
        seed = D.resolve_master_seed(asked, device)
        why = "--seed" if asked != -1 else "drawn at random on rank 0"
    return Decision("seed", seed, why, asked)


def decide_inference_backend(options: PredictOptions, mode: Mode, device: torch.device,
                             benchmark: bool = True) -> Decision:
    """The inference backend (``runtime.inference.backends.decide_backend``), recorded with why:
    evaluate on own data (not ``benchmark``) chooses as predict does."""
    backend, why = decide_backend(options, mode, device, benchmark)
    return Decision("backend", backend, why, options.backend)


def decide_inference_copy(predicts: bool) -> Decision:
    """Whether the PyTorch backend runs the network's inference copy (predict:
    ``runtime.levers.cpu.convert.prepare_for_inference`` with ``--channels_last``, compiled with
    ``--compile``) or the network as trained (evaluate and training: its logits are the benchmark's)."""
    copy = predicts
    return Decision("inference_copy", copy, "predict: the network's inference copy" if copy else
                    "the network as trained: its logits are the benchmark's")


def decide_tta(tta: bool, predicts: bool) -> Decision | None:
    """Predict's ``--tta`` (the 8 flips' mean softmax); evaluation scores the logits."""
    if not predicts:
        return None
    return Decision("tta", tta, "--tta: the softmax averaged over the 8 flips" if tta else "", tta)


def decide_cache_dir(asked: str, chooses_backend: bool) -> Decision | None:
    """OpenVINO's cache: ``--cache_dir``, else the user's cache folder
    (:func:`runtime.inference.openvino.cache.default_cache_dir`), never beside an input; decided
    only where the mode chooses a backend (evaluate, predict), so that a training checkpoint
    records no cache path of the user's."""
    from runtime.inference.openvino.cache import default_cache_dir

    if not chooses_backend:
        return None
    if asked:
        return Decision("cache_dir", os.path.abspath(asked), "--cache_dir", asked)
    return Decision("cache_dir", default_cache_dir(), "the user's cache folder", None)


def decide_levers(trains: bool, channels_last: bool, dist_info: D.DistInfo, architecture: dict, amp: bool,
                  amp_dtype: str, compile: bool) -> tuple[Decision, tuple[str, ...]]:
    """``(decision, lines)``: the speed levers (:func:`runtime.levers.cpu.convert.choose_levers`)
    for a run that ``trains`` or not, in ``--channels_last`` or not, at the precision that runs
    (:func:`decide_amp`: float32 on a CPU without native bf16), the network and ``compile``
    (:func:`decide_compile`), and each lever's line (said by :func:`say_decided`)."""
    from runtime.levers.cpu.convert import choose_levers

    levers = choose_levers(trains, dist_info.device.type, channels_last, amp_dtype if amp else None,
                           architecture["normalization"], compile, tuple(architecture["filters"]))
    names = tuple(lever.name for lever in levers if lever.applied)
    why = "; ".join(lever.why for lever in levers) or "none applies to this device, layout and precision"
    return Decision("levers", names, why), tuple(lever.why for lever in levers)


def decide_epochs(config: Config, world_size: int) -> Decision | None:
    """``--epochs auto``: the rules' non-convergence limit ``ceil(10000 * 168 / spe)`` at the run's
    global batch (``runtime.schedule.rules_schedule``), recorded with its reason; a number stays."""
    if config.epochs != "auto":
        return None
    global_batch = config.batch_size * world_size * config.ga_steps
    epochs = rules_schedule(global_batch).fail_epoch
    why = f"--epochs auto: the MLPerf non-convergence limit ceil(10000*168/samples_per_epoch) at global batch {global_batch}"
    return Decision("epochs", epochs, why, "auto")


def schedule_fields(config: Config, num_train: int, world_size: int) -> dict:
    """Samples per epoch (``--last_batch pad``: padded, as the rules count them), samples trained
    per epoch (padding not counted: the MLPerf log's unit) and the MLPerf evaluation schedule: the
    training section's fields of the data stage."""
    spe = samples_per_epoch(num_train, world_size, config.batch_size, config.ga_steps, config.last_batch)
    if spe <= 0:
        from data_loading.dataset import DataError

        raise DataError(f"{num_train} training cases make no full batch of {config.batch_size} on each "
                        f"of {world_size} ranks")
    schedule = eval_schedule(spe, num_train, config.start_eval_at, config.evaluate_every)
    trained = samples_trained_per_epoch(num_train, world_size, config.batch_size, config.ga_steps, config.last_batch,
                                        config.semantics)
    return dict(samples_per_epoch=spe, samples_trained_per_epoch=trained, start_eval_at=schedule.start_eval_at,
                evaluate_every=schedule.evaluate_every, fail_epoch=schedule.fail_epoch)


def _flag_text(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def architecture_text(architecture: dict) -> str:
    return ", ".join(f"--{name} {_flag_text(architecture[name])}" for name in ARCHITECTURE)


def asked_architecture(config: Config) -> tuple[dict, frozenset]:
    """``(flags, given)``: the network flags of ``config`` and the names given on its command line."""
    return {name: getattr(config, name) for name in ARCHITECTURE}, frozenset(config.explicit) & set(ARCHITECTURE)


def decide_architecture(flags: dict, given: Collection[str], network: TrainedNetwork | None, predicts: bool = False,
                        distributed: bool = False) -> tuple[dict, Decision]:
    """``({filters, normalization, activation}, decision)``: the network flags (``flags``; those
    ``given`` on the command line or in predict's options) where the checkpoint records none, else
    the ones it was trained with (a given flag that differs is a :class:`UsageError`), and for
    predict batch norm for a sync-batch-norm network (the same weights; inference needs no
    cross-rank statistics). A sync-batch-norm network of one process (not ``distributed``) runs
    batch norm in every mode: recorded here, ``runtime.build.build_model`` converts only a
    distributed one (the flag stays, so a resumed run and its checkpoint agree)."""
    trained = network.architecture if network is not None else {}
    architecture, taken = {name: flags[name] for name in ARCHITECTURE}, []
    for name in ARCHITECTURE:
        if name not in trained:
            continue  # a reference checkpoint: the flags (or their defaults) decide
        value = trained[name]
        if name in given and flags[name] != value:
            raise UsageError(f"--{name} {_flag_text(flags[name])} conflicts with {network.path!r}, "
                             f"trained with --{name} {_flag_text(value)}; drop the flag to use the checkpoint's")
        architecture[name] = value
        taken.append(f"--{name}")
    why = f"{', '.join(taken)} from {network.path!r}" if taken else ""
    if predicts and architecture["normalization"] == "syncbatchnorm":
        architecture["normalization"] = "batchnorm"
        why = "; ".join(filter(None, (why, "predict: batchnorm for syncbatchnorm (the same weights, one process)")))
    elif architecture["normalization"] == "syncbatchnorm" and not distributed:
        why = "; ".join(filter(None, (why, "one process: syncbatchnorm runs as batchnorm (no other rank to "
                                           "synchronise with; the same weights)")))
    architecture["filters"] = tuple(architecture["filters"])
    return architecture, Decision("architecture", architecture_text(architecture), why, architecture_text(flags))


def decide_labels(network: TrainedNetwork | None, dataset, predicts: bool,
                  fine_tune: bool = False) -> tuple[LabelSet, tuple[Decision, ...]]:
    """``(label_set, decisions)``: the run's classes and Dice (``runtime.labels.decide_label_set``)
    from the trained ``network``'s (its checkpoint's; None: none) and the data's: the description
    of the preprocessed folder (``dataset``, read before ``run_start``: no training data), KiTS19's
    benchmark for a folder without one; predict reads no data folder (the network's). The
    ``labels``, ``dice`` and, with nnU-Net's ignore label, ``ignore_label`` decisions."""
    data = None if predicts else of_description(dataset)
    try:
        label_set, why = decide_label_set(network.label_set if network is not None else None, data,
                                          network.path if network is not None else "",
                                          dataset.path if dataset is not None else "", fine_tune)
    except LabelError as err:
        raise UsageError(str(err)) from None
    made = (Decision("labels", label_set.labels, why), Decision("dice", label_set.dice, label_set.scored_as()))
    if label_set.ignore is not None:
        made += (Decision("ignore_label", label_set.ignore, "nnU-Net's ignore label: no class, no loss and no Dice "
                                                            "in its voxels"),)
    return label_set, made


def decide_pretrained(saved: Saved | None, network: TrainedNetwork | None, label_set: LabelSet) -> Decision | None:
    """``--pretrained_weights`` (a new training run from another run's weights): every layer, or,
    where the network's classes are not the data's, every layer but the output, which starts
    anew (nnU-Net's ``-pretrained_weights``); None without the flag (or when ``--resume`` found
    the run's own checkpoint)."""
    if saved is None or not saved.pretrained:
        return None
    same = network.label_set.labels == label_set.labels and network.label_set.ignore == label_set.ignore
    value = "every layer" if same else "every layer but the output"
    why = f"--pretrained_weights {saved.path}: the weights of {value}" + ("" if same else (
        f"; the output layer starts anew (trained on {network.label_set.text()}, this data has {label_set.text()})"))
    return Decision("pretrained_weights", value, why, saved.path)


def decide_target_spacing(network: TrainedNetwork | None, dataset, predicts: bool, trains: bool) -> Decision:
    """The run's target spacing (``runtime.spacing.decide_spacing``): the data's (its description's;
    KiTS19's for a folder without one), a checkpoint at another spacing refused unless the run
    ``trains``; predict's is the network's (KiTS19's for one that records none)."""
    saved = network.target_spacing if network is not None else None
    data = None if predicts else (dataset.target_spacing if dataset is not None else KITS19_SPACING)
    try:
        spacing, why = decide_spacing(saved, data, network.path if network is not None else "",
                                      dataset.path if dataset is not None else "", trains)
    except SpacingError as err:
        raise UsageError(str(err)) from None
    return Decision("target_spacing", spacing, why)


def shape_text(shape) -> str:
    return "x".join(map(str, shape))


def window_line(plan: RunPlan) -> str:
    """"window 64x64x64 from the checkpoint's training patch" (a resolved plan)."""
    return f"window {shape_text(plan.inference.window)} {plan.why('window')}".rstrip()


def _tensor_shapes(network: TrainedNetwork) -> dict:
    return {name: tuple(value.shape) for name, value in network.weights.items() if torch.is_tensor(value)}


def ensemble_problem(architecture: dict, window_given: bool, first: TrainedNetwork,
                     other: TrainedNetwork) -> str | None:
    """Why ``other`` cannot be averaged with ``first`` (the run's network ``architecture``, and
    its window): another network flag recorded, other classes, other tensors, or (no
    ``--val_input_shape``: ``window_given`` False) another training patch, so another window."""
    names = f"{other.path!r} and {first.path!r}"
    for name in ARCHITECTURE:
        value = other.architecture.get(name)
        if value is not None and value != architecture[name]:
            return (f"{names} are different networks (--{name} {_flag_text(value)} in {other.path!r}, "
                    f"{_flag_text(architecture[name])} in {first.path!r})")
    if other.label_set != first.label_set:
        return (f"{names} segment different labels ({other.label_set.text()} in {other.path!r}, "
                f"{first.label_set.text()} in {first.path!r})")
    shapes, others = _tensor_shapes(first), _tensor_shapes(other)
    if shapes != others:
        differ = sorted(set(shapes) ^ set(others)) or sorted(n for n in shapes if shapes[n] != others[n])
        name = differ[0]
        return (f"{names} are different networks (tensor {name}: {list(others.get(name, ())) or 'absent'} in "
                f"{other.path!r}, {list(shapes.get(name, ())) or 'absent'} in {first.path!r})")
    if not window_given and first.patch != other.patch:
        text = lambda p: f"{shape_text(p)} patches" if p else "no recorded patch"  # noqa: E731
        return (f"{names} were trained with different windows ({text(other.patch)} in {other.path!r}, "
                f"{text(first.patch)} in {first.path!r}); give --val_input_shape to predict both with one window")
    return None


def decide_weights(architecture: dict, window_given: bool, network: TrainedNetwork | None,
                   ensemble: tuple[TrainedNetwork, ...]) -> Decision | None:
    """Predict's weights: the digest of each checkpoint's, in order (value: a tuple, one per
    checkpoint). Every checkpoint after the first must be the same network, predicted with the
    same window (``window_given``: ``--val_input_shape`` given, else each its training patch;
    else a :class:`UsageError` naming both)."""
    if network is None:
        return None
    for other in ensemble:
        problem = ensemble_problem(architecture, window_given, network, other)
        if problem is not None:
            raise UsageError(f"--load_ckpt_path: {problem}")
    digests = tuple(n.weights_sha256 for n in (network, *ensemble))
    return Decision("weights", digests, f"an ensemble of {len(digests)}" if ensemble else "")


def decide_calibration(int8: bool, int8_calibration: str, pairs_saturate: bool) -> tuple[str | None, Decision | None]:
    """``(overflow_fix, decision)``: predict ``--int8``'s calibration set, the scans of
    ``--int8_calibration`` or each scan alone (the set itself is read per run or per scan:
    ``runtime.predict.api.Segmenter``), and NNCF's overflow fix for every set: on every layer
    ("enable") where this CPU's int8 pairs saturate (``pairs_saturate``:
    :func:`runtime.levers.cpu.isa.int8_pairs_saturate`, no VNNI), else on the first layer only."""
    if not int8:
        return None, None
    why = "--int8_calibration" if int8_calibration else "no --int8_calibration: each scan calibrates its own"
    fix = "enable" if pairs_saturate else "first_layer"
    why += ("; NNCF's overflow fix on every layer: this CPU's int8 pairs saturate (no VNNI)" if pairs_saturate
            else "; NNCF's overflow fix on the first layer only: VNNI int8 dot products")
    return fix, Decision("calibration", int8_calibration or "each scan", why, int8_calibration or None)


def decide_window_batch(asked: int, max_memory_gb: float, predicts: bool, backend: str, filters,
                        window: tuple) -> Decision:
    """The window batch: ``--sw_batch_size`` (``asked``); predict lowers it to fit memory
    (:func:`runtime.inference.memory_budget.bounded_window_batch`, ``--max_memory_gb``, for the
    network's ``filters`` and the window that run), one line saying why."""
    if not predicts:
        return Decision("window_batch", asked, "", asked)
    notes: list[str] = []
    batch = bounded_window_batch(asked, max_memory_gb, tuple(filters), window, backend, say=notes.append)
    return Decision("window_batch", batch, " ".join(notes), asked)


def check_benchmark_budget(config: Config) -> None:
    """``--benchmark_steps`` / ``--benchmark_seconds`` budget ``--benchmark`` only."""
    for name in ("benchmark_steps", "benchmark_seconds"):
        if getattr(config, name) and not config.mode.benchmark:
            raise UsageError(f"--{name} is the budget of --benchmark (train or evaluate); add --benchmark or drop it")


# ------------------------------------------------------------------------------- the sections


def decide_network(flags: dict, given: Collection[str], network: TrainedNetwork | None, dataset, mode: Mode,
                   patch: tuple[int, ...], fine_tune: bool = False,
                   distributed: bool = False) -> tuple[NetworkPlan, tuple[Decision, ...]]:
    """The network section: its flags (:func:`decide_architecture`: ``flags``, those ``given``, the
    checkpoint's), its label set (:func:`decide_labels`: the trained ``network``'s and the data's,
    ``fine_tune``: ``--pretrained_weights``), its target spacing (:func:`decide_target_spacing`)
    and the patch it is trained on (``patch``, training's ``--input_shape``, where the mode trains;
    else the checkpoint's, None when it records none)."""
    architecture, made_architecture = decide_architecture(flags, given, network, mode.predicts, distributed)
    label_set, made_labels = decide_labels(network, dataset, mode.predicts, fine_tune)
    spacing = decide_target_spacing(network, dataset, mode.predicts, mode.trains)
    trained_on = tuple(patch) if mode.trains else (network.patch if network is not None else None)
    return (NetworkPlan(**architecture, label_set=label_set, target_spacing=spacing.value, patch=trained_on),
            (made_architecture, *made_labels, spacing))


def network_of_flags(config: Config) -> NetworkPlan:
    """The network the flags alone describe (no checkpoint, no data: KiTS19's labels and spacing),
    for a tool that plans nothing (a FLOP count, a test's network); a builder takes no flags."""
    flags, given = asked_architecture(config)
    return decide_network(flags, given, None, None, config.mode, config.input_shape)[0]


def decide_precision(options: PredictOptions, mode: Mode, dist_info: D.DistInfo,
                     network: NetworkPlan) -> tuple[PrecisionPlan, tuple[Decision | None, ...], tuple[str, ...]]:
    """``(section, decisions, lever lines)``: the precision section: ``--amp`` as it runs here
    (:func:`decide_amp`), ``--compile`` where this torch compiles (:func:`decide_compile`; one
    warning on each process where it cannot), the channels-last layout, predict's ``--int8``, and
    the speed levers for ``network`` (:func:`decide_levers`; none in predict, whose backend converts
    the network). ``options``: the flags' (:meth:`~runtime.config.PredictOptions.of`) or predict's."""
    amp, amp_dtype, made_amp = decide_amp(options.amp, options.amp_dtype, options.int8, mode.trains, dist_info.device)
    compiled = decide_compile(options.compile, compile_unavailable() if options.compile else None)
    if compiled.asked and not compiled.value:  # one warning on each process, as torch's own
        warnings.warn(compiled.why, RuntimeWarning, stacklevel=3)
    levers, lines = None, ()
    if not mode.predicts:
        levers, lines = decide_levers(mode.trains, options.channels_last, dist_info, network.architecture, amp,
                                      amp_dtype, compiled.value)
    section = PrecisionPlan(amp=amp, amp_dtype=amp_dtype, int8=options.int8, channels_last=options.channels_last,
                            compile=compiled.value, levers=levers.value if levers else ())
    return section, (made_amp, compiled, levers), lines


def decide_training(config: Config, dist_info: D.DistInfo, precision: PrecisionPlan, saved: Saved | None,
                    network: TrainedNetwork | None,
                    label_set: LabelSet) -> tuple[TrainingPlan, tuple[Decision | None, ...]]:
    """The training section (a mode that trains): the layers ``--pretrained_weights`` loads
    (:func:`decide_pretrained`), the optimizer's step (:func:`decide_fused_optimizer`), the CUDA
    graph of the step at the precision that runs (:func:`decide_cuda_graphs`) and the epochs
    (:func:`decide_epochs`); the schedule is the data stage's (:func:`resolve_data`)."""
    pretrained = decide_pretrained(saved, network, label_set)
    fused, foreach, made_fused = decide_fused_optimizer(config, dist_info.device)
    graphs = decide_cuda_graphs(config, dist_info, precision.amp, precision.amp_dtype)
    epochs = decide_epochs(config, dist_info.world_size)
    section = TrainingPlan(fused_optimizer=fused, foreach_optimizer=foreach, cuda_graphs=graphs.value,
                           epochs=epochs.value if epochs else config.epochs,
                           pretrained=pretrained.value if pretrained else "",
                           start_eval_at=config.start_eval_at, evaluate_every=config.evaluate_every)
    return section, (pretrained, made_fused, graphs, epochs)


def decide_window(given: tuple[int, ...] | None, default: tuple[int, ...], network: TrainedNetwork | None,
                  mode: Mode, patch: tuple[int, ...], benchmark: bool = True) -> Decision:
    """The sliding window, its ``why`` saying where it comes from (:func:`window_line`).

    A ``given`` window (``--val_input_shape``) wins. Otherwise the patch the network learns on:
    predict takes the checkpoint's training patch (a network has not seen windows larger than its
    patches, mostly pad), or the ``default`` when the checkpoint records none; on own data (not
    ``benchmark``) evaluate takes it too and training's evaluations its ``patch``
    (``--input_shape``), so that evaluate and predict score one network with one window; on the
    benchmark's data evaluate (and training's evaluations) keep the default, the benchmark's
    window, since they compute the benchmark's number."""
    trained_on = network.patch if network is not None else None
    why_not = network.patch_problem if network is not None else "no checkpoint"
    window = tuple(given) if given is not None else tuple(default)
    other = trained_on is not None and trained_on != window
    trained = f"the checkpoint was trained on {shape_text(trained_on)} patches" if other else ""
    if given is not None:
        source = "from --val_input_shape" + (f" ({trained})" if trained else "")
    elif not mode.predicts and benchmark:
        source = "(the default, the benchmark's" + (f"; {trained}" if trained else "") + ")"
    elif mode.trains and not benchmark:
        window, source = tuple(patch), "from --input_shape (own data: the window predict will use)"
    elif trained_on is not None:
        window, source = trained_on, "from the checkpoint's training patch"
    else:
        source = f"(the default: {why_not})"
    return Decision("window", window, source, window if given is not None else None)


def decide_inference(options: PredictOptions, default_window: tuple[int, ...], mode: Mode, dist_info: D.DistInfo,
                     network: NetworkPlan, trained: TrainedNetwork | None, ensemble: tuple[TrainedNetwork, ...] = (),
                     checkpoints: tuple[str, ...] = (),
                     patch: tuple[int, ...] = ()) -> tuple[InferencePlan, tuple[Decision | None, ...]]:
    """The inference section (every mode computes windows: training's evaluations, evaluate,
    predict), from ``options`` (the flags': :meth:`~runtime.config.PredictOptions.of`, or
    predict's Python API's): the window (:func:`decide_window`; ``default_window`` where none is
    given and none is the checkpoint's; ``patch``: training's own-data window), predict's weights
    of ``checkpoints`` (:func:`decide_weights`: ``trained`` and its ``ensemble``), the backend,
    OpenVINO's cache folder, ``--int8``'s calibration, the window batch, the inference copy and
    ``--tta``. The benchmark's data (KiTS19's folder, no description) keeps the benchmark's
    window and backend in evaluate; own data and predict choose alike."""
    device, predicts = dist_info.device, mode.predicts
    if predicts and options.int8 and device.type != "cpu":
        raise UsageError(f"--int8 runs on the CPU only; this run's device is {device.type}")
    benchmark = network.label_set.benchmark_data or predicts
    window = decide_window(options.window, default_window, trained, mode, patch, benchmark)
    weights = decide_weights(network.architecture, options.window is not None, trained, ensemble) if predicts else None
    backend = decide_inference_backend(options, mode, device, benchmark)
    cache_dir = decide_cache_dir(options.cache_dir, mode.chooses_backend)
    overflow_fix, calibration = (decide_calibration(options.int8, options.int8_calibration,
                                                    options.int8 and int8_pairs_saturate())
                                 if predicts else (None, None))
    window_batch = decide_window_batch(options.sw_batch_size, options.max_memory_gb, predicts, backend.value,
                                       network.filters, window.value)
    inference_copy, tta = decide_inference_copy(predicts), decide_tta(options.tta, predicts)
    section = InferencePlan(
        backend=backend.value, window=window.value, overlap=options.overlap, window_batch=window_batch.value,
        tta=bool(tta and tta.value), inference_copy=inference_copy.value,
        cache_dir=cache_dir.value if cache_dir else "", calibration=calibration.value if calibration else None,
        overflow_fix=overflow_fix, checkpoints=tuple(checkpoints), weights=weights.value if weights else ())
    return section, (window, weights, backend, cache_dir, calibration, window_batch, inference_copy, tta)


# ------------------------------------------------------------------------------- the stages


def resolve(config: Config, dist_info: D.DistInfo, data=None, saved: Saved | None = None, ensemble=(),
            dataset=None) -> RunPlan:
    """The run's plan from its parsed flags: every value decided that needs no data (the first
    stage; predict's plan is then whole).

    ``data``: None for a run with an MLPerf clock (train, evaluate, benchmark: the data stage,
    :func:`resolve_data`, runs after ``run_start``) and for predict; a data source
    (``summary(use)``; see ``data_loading.data_loader``) for a tool with no clock, which
    then gets both stages. ``dataset``: what the data says of itself before the clock, its
    description (``data_loading.description.folder_description``: labels, target spacing; None
    for KiTS19's folder, which has none; a given ``data``'s own ``description()`` by default):
    it chooses the label set, the Dice and the spacing, so the network is built once, with
    them. ``saved``: the checkpoint the run starts from (read once into a
    :class:`~runtime.checkpoint.TrainedNetwork`: its network flags fill those not given, its
    training patch predict's window: :func:`decide_window`; a resumed run also keeps its master
    seed), or None; ``ensemble``: predict's further checkpoints (:func:`decide_weights`). The
    seed is drawn on rank 0 and broadcast, so this is a collective: call it on every rank.
    ``config`` is not changed.
    """
    check_benchmark_budget(config)
    say_no_effect(config, dist_info)
    if dataset is None and data is not None:
        dataset = data.description()
    plan = compose_plan(PredictOptions.of(config), config.mode, dist_info, saved, ensemble, dataset, config)
    return plan if data is None else resolve_data(plan, dist_info, data.summary(data_use(plan)))


def resolve_predict(options: PredictOptions, dist_info: D.DistInfo, saved: Saved | None = None,
                    ensemble=()) -> RunPlan:
    """Predict's plan from the Python API's ``options`` (:class:`~runtime.config.PredictOptions`,
    no command line: the plan's ``config`` is None) and its checkpoint(s): ``saved`` (the network,
    its label set, spacing and training patch) and ``ensemble`` (further checkpoints, averaged),
    or None for a network given as it is."""
    return compose_plan(options, MODES["predict"], dist_info, saved, ensemble)


def compose_plan(options: PredictOptions, mode: Mode, dist_info: D.DistInfo, saved: Saved | None = None,
                 ensemble=(), dataset=None, config: Config | None = None) -> RunPlan:
    """The first stage's plan, its sections chosen by what ``mode`` does: the network and the
    precision for every run, the training section where it trains (from the flags ``config``),
    the inference section for the windows every mode computes (from ``options``, the flags' or
    predict's), the master seed and the division where it reads the data (the flags'). Predict
    draws no seed, reads no data: its plan is whole, said with ``--verbose``."""
    device = dist_info.device
    trained = trained_network(saved) if saved is not None else None
    members = tuple(trained_network(other) for other in ensemble)
    flags, given = asked_architecture(config) if config is not None else options.architecture()
    patch = tuple(config.input_shape) if config is not None else ()
    network, made_network = decide_network(flags, given, trained, dataset, mode, patch,
                                           saved is not None and saved.pretrained, dist_info.distributed)
    if not mode.predicts:
        check_device_support(network.normalization, dist_info)
    precision, made_precision, lever_lines = decide_precision(options, mode, dist_info, network)
    seed = decide_seed(config.seed, device, saved) if mode.scores else None
    training, made_training = ((None, ()) if not mode.trains else
                               decide_training(config, dist_info, precision, saved, trained, network.label_set))
    default_window = tuple(config.val_input_shape) if config is not None else Config.val_input_shape
    checkpoints = (config.checkpoints if config is not None else
                   tuple(one.path for one in (saved, *ensemble) if one is not None))
    inference, made_inference = decide_inference(options, default_window, mode, dist_info, network, trained, members,
                                                 checkpoints, patch)
    host_memory = decide_host_memory(mode.trains, device)
    decisions = recorded((), decide_device(options.device, device), host_memory, *made_network, *made_precision,
                         seed, *made_training, *made_inference)
    plan = RunPlan(config=config, decisions=decisions, device=device.type, host_memory=host_memory.value,
                   network=network, precision=precision, inference=inference, training=training,
                   seed=seed.value if seed else None)
    if not mode.scores:  # predict: no data stage, the plan is whole
        return say_plan(plan, dist_info, config is not None and config.verbose)
    # the division reads the network, the window and the data's description decided above
    own = [own_data_reason(dataset)] if dataset is not None else []
    plan = with_division(plan, own + flag_reasons(config, network.architecture, inference.window,
                                                  dist_info.world_size), dist_info)
    say_decided(said_lines(plan, lever_lines), dist_info)
    return plan


def data_use(plan: RunPlan):
    """What ``plan``'s run reads of its data (``data_loading.source.DataUse``: ``summary`` checks it)."""
    from data_loading.source import DataUse

    mode = plan.config.mode
    return DataUse(trains=mode.trains, evaluates=not mode.benchmark, patch=tuple(plan.config.input_shape))


def said_lines(plan: RunPlan, lever_lines: tuple[str, ...]) -> list[str]:
    """The lines a run says of its first stage's plan, in the order decided (rank 0's stdout,
    :func:`say_decided`): training's bf16 answer on the CPU, why ``--pretrained_weights`` loads
    what it loads, why ``--cuda_graphs`` is off, each lever's line and why the run is open (an
    MLPerf run)."""
    config, device = plan.config, torch.device(plan.device)
    amp_dtype = plan.precision.amp_dtype
    lines = [plan.why("precision")] if trains_bf16_on_cpu(config.mode.trains, config.amp, amp_dtype, device) else []
    lines += [plan.why("pretrained_weights")] if plan.training is not None and plan.training.pretrained else []
    graphs = plan.decision("cuda_graphs")
    if graphs is not None and graphs.asked and not graphs.value:
        lines.append(f"--cuda_graphs off: {graphs.why}")
    return lines + list(lever_lines) + division_lines(plan)


def division_lines(plan: RunPlan) -> list[str]:
    """Why the run is open, said by an MLPerf run (:func:`decide_division`)."""
    return [plan.why("division")] if plan.why("division") and plan.config.mode.mlperf_run else []


def say_decided(lines: list[str], dist_info: D.DistInfo) -> None:
    """The lines of a stage's decisions (:func:`said_lines`), said on rank 0's stdout once the plan
    is built: the decide_* functions say nothing."""
    if dist_info.is_main:
        for line in lines:
            print(line)


def say_no_effect(config: Config, dist_info: D.DistInfo) -> None:
    """The one line naming the reference's flags given that do nothing in this mode (accepted, as
    its one parser accepts them: ``runtime.config.no_effect_line``), on rank 0's stderr (stdout
    is evaluate's result)."""
    line = no_effect_line(config)
    if line and dist_info.is_main:
        print(f"note: {line}", file=sys.stderr)


def decide_division(plan: RunPlan, reasons: list, dist_info: D.DistInfo, logged: bool) -> tuple[Decision, Decision | None]:
    """``(division, not_closed)``: the MLPerf division (``runtime.division``) from ``reasons``
    (the stage's reasons the run is open): closed, or open with one line saying why (said once,
    by an MLPerf run: :func:`division_lines`); ``--submission_division closed`` on an open run is a :class:`UsageError`.
    The flag as given stays the decision's ``asked``. ``logged``: the MLPerf log already holds
    the division (the data stage: it must precede ``init_stop``), so a run found open only now
    says that its log's "closed" is no result, and records the reasons as the ``not_closed``
    decision for the log's ``not_closed`` event (``runtime.clocked.start.start_run``)."""
    asked = plan.config.submission_division
    try:
        division, why = decide(asked, reasons)
    except ValueError as err:
        raise UsageError(str(err)) from None
    not_closed = bool(why) and logged and plan.division == "closed"  # what the log said
    if not_closed:
        why += ("; the MLPerf log, whose division precedes init_stop, says closed: it records not_closed "
                "after run_start, and the run is no closed result")
    made = Decision("division", division, why, asked)
    return made, Decision("not_closed", "; ".join(reasons), "the MLPerf log already says closed") if not_closed else None


def with_division(plan: RunPlan, reasons: list, dist_info: D.DistInfo, logged: bool = False) -> RunPlan:
    """``plan`` with its division decided (:func:`decide_division`); a run already open by its
    flags stays as it is (the data adds nothing to say)."""
    if plan.why("division"):
        return plan
    division, not_closed = decide_division(plan, reasons, dist_info, logged)
    return dataclasses.replace(plan, division=division.value, decisions=recorded(plan.decisions, division, not_closed))


# `auto` keeps the training set on the GPU only if it takes at most this share of the free
# device memory (the rest is for the model, activations and evaluation).
DEVICE_CACHE_MAX_SHARE = 0.5


def resolve_cache(cache: str, device: torch.device | None, dataset_bytes: int | None = None) -> str:
    """The cache mode actually used: ``auto`` -> ``device`` on CUDA/ROCm when the training set
    (``dataset_bytes``, if given) fits in half the free device memory, else ``memory``."""
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
    if cache != "auto":
        return cache
    if device is None or device.type != "cuda":
        return "memory"
    if dataset_bytes is not None:
        free, _ = torch.cuda.mem_get_info(device)
        if dataset_bytes > DEVICE_CACHE_MAX_SHARE * free:
            return "memory"
    return "device"


def decide_cache(asked: str, device: torch.device, train_bytes) -> Decision:
    """The cache mode (``auto``: on the device when the training set fits: :func:`resolve_cache`)."""
    cache = resolve_cache(asked, device, train_bytes)
    return Decision("cache", cache, "" if cache == asked else
                    "--cache auto: on the GPU when the training set fits, else in memory", asked)


def resolve_data(plan: RunPlan, dist_info: D.DistInfo, summary) -> RunPlan:
    """The second stage: a new plan with the values that need the data, from its ``summary`` (a
    ``data_loading.source.DataSummary``; the source's ``summary(use)`` lists and checks the
    cases, so it runs after the MLPerf ``run_start``): the data section (the case counts, and the
    cache mode: ``auto`` on the device when the training set fits) and, where the run trains, the
    training section's schedule (samples per epoch, the evaluation epochs). The label set and the
    target spacing were decided in the first stage, from the data's description. ``plan``: from
    :func:`resolve`. The same on every rank (no collective)."""
    config = plan.config
    cache = decide_cache(config.cache, dist_info.device, summary.train_bytes)
    training = plan.training
    if training is not None:
        training = dataclasses.replace(training, **schedule_fields(config, summary.num_train, dist_info.world_size))
    # The division's data part: a closed run needs KiTS19's 168/42 split, not synthetic (runtime.division).
    reasons = data_reasons(summary.num_train, summary.num_eval, summary.synthetic)
    plan = dataclasses.replace(plan, data=DataPlan(cache.value, summary.num_train, summary.num_eval),
                               training=training, decisions=recorded(plan.decisions, cache))
    decided = with_division(plan, reasons, dist_info, logged=True)
    if decided is not plan:  # open by the data only: said now
        say_decided(division_lines(decided), dist_info)
    return say_plan(decided, dist_info, config.verbose)


def say_plan(plan: RunPlan, dist_info: D.DistInfo, verbose: bool) -> RunPlan:
    """With ``--verbose``, every decision of the resolved ``plan`` in one line each, on rank 0's
    stderr (stdout is evaluate's result); the lines a run says anyway are said where decided."""
    if verbose and dist_info.is_main:
        for made in plan.decisions:
            print(f"plan: {made.line()}", file=sys.stderr)
    return plan
