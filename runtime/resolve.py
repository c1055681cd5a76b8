"""Every "auto" and every derived value of a run, decided once, in two stages:

* ``resolve(config, dist_info, None, checkpoint)``: everything that needs no data, right after
  the process group starts and before any MLPerf event (nothing here lists, opens or maps a
  file of ``--data_dir``: the MLPerf clock has not started);
* ``resolve_data(config, dist_info, summary)``: the values that need the data (case counts,
  samples per epoch and the evaluation schedule, the cache mode), right after ``run_start``,
  from the data source's ``summary(config)``.

Tools with no MLPerf clock (the benchmarks) pass the data source to ``resolve`` and get both
stages at once. Everything after reads the resolved :class:`~runtime.arguments.Config`; nothing
derives these values again, and nothing replaces it. Each decision is also recorded in the
config's plan (:mod:`runtime.plan`: what runs, why, what was asked), which the checkpoint
saves; a new decision is one :func:`~runtime.plan.decided` call here. The one process-wide
effect of a decision, the host-memory reuse, is :func:`apply_host_memory`, called right after
``resolve``. A flag combination that cannot run here raises :class:`UsageError` (one line).
"""
from __future__ import annotations

import os
import sys

import torch

from runtime import distributed as D
from runtime.arguments import Config, UsageError, no_effect_line, replace
from runtime.checkpoint import Saved, model_state_from, saved_config, saved_seed, weights_digest
from runtime.division import data_reasons, decide, flag_reasons
from runtime.inference.backends import decide_backend
from runtime.inference.memory_budget import bounded_window_batch
from runtime.levers.cpu.host_memory import reuse_freed_memory
from runtime.levers.cpu.isa import native_bf16
from runtime.optimizers import fused_step
from runtime.plan import decided
from runtime.schedule import eval_schedule, rules_schedule, samples_per_epoch


def amp_dtype_for(amp_dtype: str, device: torch.device) -> str:
    """The autocast type ``--amp_dtype`` means on ``device``: auto = fp16 on CUDA, bf16 elsewhere."""
    if amp_dtype == "auto":
        return "fp16" if device.type == "cuda" else "bf16"
    if amp_dtype == "fp16" and device.type != "cuda":
        raise UsageError("--amp_dtype fp16 needs a GPU; use --amp_dtype bf16 on the CPU")
    return amp_dtype


def check_device_support(config: Config, dist_info: D.DistInfo) -> None:
    if config.normalization == "syncbatchnorm" and dist_info.device.type != "cuda" and dist_info.distributed:
        raise UsageError("--normalization syncbatchnorm needs GPUs; use batchnorm on the CPU")


def precision_text(config: Config) -> str:
    return f"{config.amp_dtype} autocast" if config.amp else "float32"


def precision_from(config: Config, device: torch.device, say: bool) -> Config:
    """The run's precision decided: ``--amp``'s type on ``device`` (:func:`amp_dtype_for`), and
    training's float32 fallback on a CPU without native bf16 (:func:`cpu_training_precision`)."""
    asked = f"--amp --amp_dtype {config.amp_dtype}" if config.amp else "float32"
    if config.amp:
        config = replace(config, amp_dtype=amp_dtype_for(config.amp_dtype, device))
    why = f"--amp_dtype auto on {device.type}" if config.amp and asked.endswith(" auto") else ""
    return cpu_training_precision(decided(config, "precision", precision_text(config), why, asked), device, say)


def cpu_training_precision(config: Config, device: torch.device, say: bool) -> Config:
    """``--amp`` (bf16) training on a CPU without native bf16 dot products trains in float32:
    there oneDNN emulates bf16, slower than float32 (docs/performance.md). One line says which
    the run chose and why (``say``), recorded as the precision decision; anything else is
    returned unchanged."""
    if not (config.mode.trains and config.amp and config.amp_dtype == "bf16" and device.type == "cpu"):
        return config
    native, why = native_bf16()
    line = f"bf16: {why}; " + ("training in bf16 autocast" if native else "training in float32 instead")
    if say:
        print(line)
    chosen = config if native else replace(config, amp=False)
    made = config.decision("precision")
    return decided(chosen, "precision", precision_text(chosen), line, made.asked if made else "--amp")


def fused_optimizer_from(config: Config, device: torch.device) -> Config:
    """``--fused_optimizer`` as it runs here (training): torch's fused step where it has one for
    ``--optimizer`` on ``device`` (:func:`runtime.optimizers.fused_step`), else the default step.
    The optimizer is built, and a resumed one kept, with this choice."""
    if not config.mode.trains:
        return config
    if not config.fused_optimizer:
        return decided(config, "fused_optimizer", False, "the default step", asked=False)
    runs, why = fused_step(config.optimizer, device)
    return decided(replace(config, fused_optimizer=runs), "fused_optimizer", runs, why, asked=True)


def reuses_host_memory(config: Config, device: torch.device) -> bool:
    """Training on the CPU, evaluation and predict reuse freed host memory: every step's
    activations and gradients are the same large blocks again (docs/performance.md,
    "The fast CPU settings"); a GPU training run's tensors are not host memory."""
    return not config.mode.trains or device.type == "cpu"


def host_memory_from(config: Config, device: torch.device) -> Config:
    """The host-memory decision (value: whether freed blocks are reused; :func:`apply_host_memory`)."""
    reuse = reuses_host_memory(config, device)
    why = "freed blocks reused: the same large blocks every step" if reuse else \
        "training on the GPU: its tensors are not host memory"
    return decided(config, "host_memory", reuse, why)


def apply_host_memory(config: Config) -> None:
    """The host-memory decision put into effect (glibc's ``mallopt``: process-wide, so not in
    :func:`resolve` itself): call it right after ``resolve``, before the model is built. Says why
    it cannot (``--verbose``)."""
    made = config.decision("host_memory")
    if made is None or not made.value:
        return
    why_not = reuse_freed_memory()
    if why_not and config.verbose:
        print(f"host memory: freed blocks go back to the system ({why_not})")


def cuda_graphs_from(config: Config, dist_info: D.DistInfo) -> Config:
    """``--cuda_graphs`` as it can run here (``config``: its AMP type resolved); says once
    (rank 0) why it is off."""
    if not config.cuda_graphs:
        return decided(config, "cuda_graphs", False, asked=False)
    from runtime.levers.gpu.graphs import cuda_graphs_supported

    ok, reason = cuda_graphs_supported(dist_info.device, config, dist_info.world_size)
    if not ok and dist_info.is_main:
        print(f"--cuda_graphs off: {reason}")
    return decided(replace(config, cuda_graphs=ok), "cuda_graphs", ok, reason if not ok else "", asked=True)


def seed_from(config: Config, device: torch.device, saved: Saved | None) -> Config:
    """The master seed: the resumed run's, else ``--seed``, else drawn on rank 0 and broadcast (a
    collective)."""
    seed = saved_seed(saved.checkpoint) if saved is not None and saved.resume else None
    why = "the resumed run's"
    if seed is None:
        seed = D.resolve_master_seed(config.seed, device)
        why = "--seed" if config.seed != -1 else "drawn at random on rank 0"
    return decided(replace(config, seed=seed), "seed", seed, why, asked=config.seed)


def backend_from(config: Config, device: torch.device) -> Config:
    """The inference backend (``runtime.inference.backends.decide_backend``), recorded with why,
    and OpenVINO's cache."""
    backend, why = decide_backend(config, device)
    return decided(with_cache_dir(replace(config, backend=backend)), "backend", backend, why, config.backend)


def levers_from(config: Config, dist_info: D.DistInfo) -> Config:
    """``config`` with its speed levers chosen (:func:`runtime.levers.cpu.convert.choose_levers`)
    for the precision that runs (:func:`precision_from`: float32 on a CPU without native bf16),
    one line each said on rank 0, and recorded as the ``levers`` decision."""
    from runtime.levers.cpu.convert import choose_levers

    amp_dtype = config.amp_dtype if config.amp else None
    levers = choose_levers(config.mode.trains, dist_info.device.type, config.channels_last, amp_dtype,
                           config.normalization, config.compile, tuple(config.filters))
    if dist_info.is_main:
        for lever in levers:
            print(lever.why)
    names = tuple(lever.name for lever in levers if lever.applied)
    why = "; ".join(lever.why for lever in levers) or "none applies to this device, layout and precision"
    return decided(replace(config, levers=names), "levers", names, why)


def epochs_from(config: Config, world_size: int) -> Config:
    """``--epochs auto``: the rules' non-convergence limit ``ceil(10000 * 168 / spe)`` at the run's
    global batch (``runtime.schedule.rules_schedule``), recorded with its reason; a number stays."""
    if config.epochs != "auto":
        return config
    global_batch = config.batch_size * world_size * config.ga_steps
    epochs = rules_schedule(global_batch).fail_epoch
    why = f"--epochs auto: the MLPerf non-convergence limit ceil(10000*168/samples_per_epoch) at global batch {global_batch}"
    return decided(replace(config, epochs=epochs), "epochs", epochs, why, "auto")


def schedule_fields(config: Config, num_train: int, world_size: int) -> dict:
    """Samples per epoch (``--last_batch pad``: padded, as the rules count them) and the MLPerf
    evaluation schedule (training only)."""
    if not config.mode.trains:
        return {}
    spe = samples_per_epoch(num_train, world_size, config.batch_size, config.ga_steps, config.last_batch)
    if spe <= 0:
        from data_loading.dataset import DataError

        raise DataError(f"{num_train} training cases make no full batch of {config.batch_size} on each "
                        f"of {world_size} ranks")
    schedule = eval_schedule(spe, num_train, config.start_eval_at, config.evaluate_every)
    return dict(samples_per_epoch=spe, start_eval_at=schedule.start_eval_at,
                evaluate_every=schedule.evaluate_every, fail_epoch=schedule.fail_epoch)


# The flags that define the network: taken from a checkpoint's saved config when not given.
ARCHITECTURE = ("filters", "normalization", "activation")


def _flag_text(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def architecture_from(config: Config, saved: Saved) -> Config:
    """``config`` with the network flags the checkpoint was trained with, where they were not
    given; a given flag that differs from the checkpoint is a :class:`UsageError`."""
    trained = saved_config(saved.checkpoint)
    changes = {}
    for name in ARCHITECTURE:
        if name not in trained:
            continue  # a reference checkpoint: the flags (or their defaults) decide
        value = tuple(trained[name]) if isinstance(trained[name], list) else trained[name]
        if name in config.explicit and getattr(config, name) != value:
            raise UsageError(f"--{name} {_flag_text(getattr(config, name))} conflicts with {saved.path!r}, "
                             f"trained with --{name} {_flag_text(value)}; drop the flag to use the checkpoint's")
        changes[name] = value
    return replace(config, **changes)


def shape_text(shape) -> str:
    return "x".join(map(str, shape))


def training_patch(saved: Saved | None) -> tuple[tuple[int, ...] | None, str]:
    """``(patch, "")``: the ``--input_shape`` the checkpoint was trained with, or ``(None, why
    not)`` (a reference checkpoint or one that records none, or a shape no window can have)."""
    from model.unet3d import SHAPE_DIVISOR

    if saved is None:
        return None, "no checkpoint"
    patch = saved_config(saved.checkpoint).get("input_shape")
    if patch is None:
        return None, "the checkpoint records no training patch"
    try:
        patch = tuple(int(s) for s in patch)
    except (TypeError, ValueError):
        return None, f"the checkpoint's training patch {patch!r} is no shape"
    if len(patch) != 3 or not all(s > 0 and s % SHAPE_DIVISOR == 0 for s in patch):
        return None, f"the checkpoint's training patch {list(patch)} is no window of 3 multiples of {SHAPE_DIVISOR}"
    return patch, ""


def window_from(config: Config, saved: Saved | None) -> Config:
    """The sliding window and where it comes from (``window_source``, for :func:`window_line`).

    A given ``--val_input_shape`` wins. Otherwise predict takes the checkpoint's training patch
    (a network has not seen windows larger than its patches, mostly pad), or the default when
    the checkpoint records none; evaluate (and training's evaluations) keep the default, the
    benchmark's window, since they compute the benchmark's number."""
    patch, why_not = training_patch(saved)
    other = patch is not None and patch != tuple(config.val_input_shape)
    trained = f"the checkpoint was trained on {shape_text(patch)} patches" if other else ""
    if "val_input_shape" in config.explicit:
        source = "from --val_input_shape" + (f" ({trained})" if trained else "")
    elif not config.mode.predicts:
        source = "(the default, the benchmark's" + (f"; {trained}" if trained else "") + ")"
    elif patch is not None:
        config, source = replace(config, val_input_shape=patch), "from the checkpoint's training patch"
    else:
        source = f"(the default: {why_not})"
    asked = tuple(config.val_input_shape) if "val_input_shape" in config.explicit else None
    return decided(config, "window", tuple(config.val_input_shape), source, asked)


def window_line(config: Config) -> str:
    """"window 64x64x64 from the checkpoint's training patch" (a resolved ``config``)."""
    return f"window {shape_text(config.val_input_shape)} {config.why('window')}".rstrip()


def weights_sha256(saved: Saved) -> str:
    """sha256 of the weights predict loads from ``saved`` (recorded beside each segmentation)."""
    return weights_digest(model_state_from(saved.checkpoint, prefer="best"))


def _tensor_shapes(saved: Saved) -> dict:
    return {name: tuple(value.shape) for name, value in model_state_from(saved.checkpoint, prefer="best").items()
            if torch.is_tensor(value)}


def ensemble_problem(config: Config, first: Saved, other: Saved) -> str | None:
    """Why ``other`` cannot be averaged with ``first`` (the run's network and window), or None:
    another network flag recorded, other tensors, or (no ``--val_input_shape``) another
    training patch, so another window."""
    theirs = saved_config(other.checkpoint)
    names = f"{other.path!r} and {first.path!r}"
    for name in ARCHITECTURE:
        value = theirs.get(name)
        value = tuple(value) if isinstance(value, list) else value
        if value is not None and value != getattr(config, name):
            return (f"{names} are different networks (--{name} {_flag_text(value)} in {other.path!r}, "
                    f"{_flag_text(getattr(config, name))} in {first.path!r})")
    shapes, others = _tensor_shapes(first), _tensor_shapes(other)
    if shapes != others:
        differ = sorted(set(shapes) ^ set(others)) or sorted(n for n in shapes if shapes[n] != others[n])
        name = differ[0]
        return (f"{names} are different networks (tensor {name}: {list(others.get(name, ())) or 'absent'} in "
                f"{other.path!r}, {list(shapes.get(name, ())) or 'absent'} in {first.path!r})")
    if "val_input_shape" not in config.explicit:
        patch, _ = training_patch(first)
        their_patch, _ = training_patch(other)
        if patch != their_patch:
            text = lambda p: f"{shape_text(p)} patches" if p else "no recorded patch"  # noqa: E731
            return (f"{names} were trained with different windows ({text(their_patch)} in {other.path!r}, "
                    f"{text(patch)} in {first.path!r}); give --val_input_shape to predict both with one window")
    return None


def ensemble_from(config: Config, saved: Saved, ensemble) -> Config:
    """Predict's ensemble: every checkpoint after the first must be the same network, predicted
    with the same window (else a :class:`UsageError` naming both); its weights digests in order."""
    if not ensemble:
        return config
    for other in ensemble:
        problem = ensemble_problem(config, saved, other)
        if problem is not None:
            raise UsageError(f"--load_ckpt_path: {problem}")
    return replace(config, ensemble_sha256=tuple(weights_sha256(s) for s in (saved, *ensemble)))


def with_cache_dir(config: Config) -> Config:
    """``config`` with ``cache_dir`` decided: ``--cache_dir``, else the user's cache folder
    (:func:`runtime.inference.openvino.cache.default_cache_dir`), never beside an input."""
    from runtime.inference.openvino.cache import default_cache_dir

    return replace(config, cache_dir=os.path.abspath(config.cache_dir) if config.cache_dir else default_cache_dir())


def resolve_predict(config: Config, device: torch.device) -> Config:
    """Predict's values: batch norm for a sync-batch-norm network (the same weights; inference
    needs no cross-rank statistics), the device, and, each recorded in the plan, the precision
    (the AMP type; ``--int8`` on the CPU only), the backend, the int8 calibration set and the
    window batch that fits memory (why it was lowered, when it was)."""
    asked = config
    if config.normalization == "syncbatchnorm":
        config = replace(config, normalization="batchnorm")
    if config.int8 and device.type != "cpu":
        raise UsageError(f"--int8 runs on the CPU only; this run's device is {device.type}")
    config = precision_from(config, device, say=False)  # predict: no CPU training fallback
    if config.int8:
        config = decided(config, "precision", "int8", "", "--int8")
    config = backend_from(replace(config, device=device.type), device)
    if config.int8:  # the set itself is read per run or per scan (runtime.predict.api.Segmenter.calibration)
        source = config.int8_calibration or "each scan"
        why = "--int8_calibration" if config.int8_calibration else "no --int8_calibration: each scan calibrates its own"
        config = decided(config, "calibration", source, why, config.int8_calibration or None)
    notes: list[str] = []
    config = bounded_window_batch(config, config.backend, say=notes.append)
    return window_batch_decided(config, asked.sw_batch_size, " ".join(notes))


def check_benchmark_budget(config: Config) -> None:
    """``--benchmark_steps`` / ``--benchmark_seconds`` budget ``--benchmark`` only."""
    for name in ("benchmark_steps", "benchmark_seconds"):
        if getattr(config, name) and not config.mode.benchmark:
            raise UsageError(f"--{name} is the budget of --benchmark (train or evaluate); add --benchmark or drop it")


def resolve(config: Config, dist_info: D.DistInfo, data=None, saved: Saved | None = None, ensemble=()) -> Config:
    """The run's config with every value decided that needs no data (the first stage).

    ``data``: None for a run with an MLPerf clock (train, evaluate, benchmark: the data stage,
    :func:`resolve_data`, runs after ``run_start``) and for predict; a data source
    (``summary(config)``; see ``data_loading.data_loader``) for a tool with no clock, which
    then gets both stages. ``saved``: the checkpoint the run starts from (its network flags fill
    those not given, its training patch predict's window: :func:`window_from`; a resumed run
    also keeps its master seed), or None; ``ensemble``: predict's further checkpoints
    (:func:`ensemble_from`). The seed is drawn on rank 0 and broadcast, so this is a
    collective: call it on every rank.
    """
    device = dist_info.device
    check_benchmark_budget(config)
    say_no_effect(config, dist_info)
    if saved is not None:
        config = architecture_from(config, saved)
    config = host_memory_from(window_from(config, saved), device)
    if config.mode.predicts:
        return say_plan(resolve_predict_plan(config, device, saved, ensemble), dist_info)
    check_device_support(config, dist_info)
    config = precision_from(config, device, dist_info.is_main)
    config = fused_optimizer_from(seed_from(config, device, saved), device)
    config = window_batch_decided(backend_from(config, device), config.sw_batch_size, "")
    config = levers_from(cuda_graphs_from(replace(config, device=device.type), dist_info), dist_info)
    config = epochs_from(config, dist_info.world_size)
    config = division_from(config, flag_reasons(config, dist_info.world_size), dist_info)
    return config if data is None else resolve_data(config, dist_info, data.summary(config))


def say_no_effect(config: Config, dist_info: D.DistInfo) -> None:
    """The one line naming the reference's flags given that do nothing in this mode (accepted, as
    its one parser accepts them: ``runtime.arguments.no_effect_line``), on rank 0's stderr (stdout
    is evaluate's result)."""
    line = no_effect_line(config)
    if line and dist_info.is_main:
        print(f"note: {line}", file=sys.stderr)


def window_batch_decided(config: Config, asked: int, why: str) -> Config:
    """The window batch (``--sw_batch_size``; predict may lower it to fit memory: ``why``)."""
    return decided(config, "window_batch", config.sw_batch_size, why, asked)


def resolve_predict_plan(config: Config, device: torch.device, saved: Saved | None, ensemble) -> Config:
    """Predict's part of :func:`resolve`: the weights' digests and :func:`resolve_predict`'s values."""
    if saved is not None:
        config = ensemble_from(replace(config, weights_sha256=weights_sha256(saved)), saved, ensemble)
    return resolve_predict(config, device)


def division_from(config: Config, reasons: list, dist_info: D.DistInfo, logged: bool = False) -> Config:
    """``config`` with its MLPerf division decided (``runtime.division``) from ``reasons`` (the
    stage's reasons the run is open): closed, or open with one line saying why (rank 0,
    training, once); ``--submission_division closed`` on an open run is a :class:`UsageError`.
    The flag as given is kept as the decision's ``asked`` for the data stage. ``logged``: the MLPerf
    log already holds the division (the data stage: it must precede ``init_stop``), so a run
    found open only now says that its log's "closed" is no result, and records the reasons as the
    ``not_closed`` decision for the log's ``not_closed`` event (``runtime.training.start.start_run``)."""
    earlier = config.decision("division")
    asked = earlier.asked if earlier is not None else config.submission_division
    if config.why("division"):  # already open by the flags: the data adds nothing to say
        return config
    try:
        division, why = decide(asked, reasons)
    except ValueError as err:
        raise UsageError(str(err)) from None
    not_closed = bool(why) and logged and config.submission_division == "closed"
    if not_closed:
        why += ("; the MLPerf log, whose division precedes init_stop, says closed: it records not_closed "
                "after run_start, and the run is no closed result")
    if why and dist_info.is_main and config.mode.mlperf_run:
        print(why)
    config = decided(replace(config, submission_division=division), "division", division, why, asked)
    if not_closed:  # the log's not_closed event: the data stage's reasons
        config = decided(config, "not_closed", "; ".join(reasons), "the MLPerf log already says closed")
    return config


def resolve_data(config: Config, dist_info: D.DistInfo, summary) -> Config:
    """The second stage: the values that need the data, from its ``summary`` (a
    ``data_loading.source.DataSummary``; the source's ``summary(config)`` lists and checks the
    cases, so it runs after the MLPerf ``run_start``): the case counts, samples per epoch and the
    evaluation schedule (training), and the cache mode (``auto``: on the device when the
    training set fits). ``config``: resolved by :func:`resolve`. The same on every rank (no
    collective)."""
    from data_loading.data_loader import resolve_cache

    cache = resolve_cache(config.cache, dist_info.device, summary.train_bytes)
    config = decided(config, "cache", cache, "" if cache == config.cache else
                     "--cache auto: on the GPU when the training set fits, else in memory", config.cache)
    config = replace(config, cache=cache, num_train_cases=summary.num_train, num_eval_cases=summary.num_eval,
                     **schedule_fields(config, summary.num_train, dist_info.world_size))
    # The division's data part: a closed run needs KiTS19's 168/42 split, not synthetic (runtime.division).
    reasons = data_reasons(summary.num_train, summary.num_eval, getattr(summary, "synthetic", ""))
    return say_plan(division_from(config, reasons, dist_info, logged=True), dist_info)


def say_plan(config: Config, dist_info: D.DistInfo) -> Config:
    """With ``--verbose``, every decision of the resolved ``config`` in one line each, on rank 0's
    stderr (stdout is evaluate's result); the lines a run says anyway are said where decided."""
    if config.verbose and dist_info.is_main:
        for made in config.plan:
            print(f"plan: {made.line()}", file=sys.stderr)
    return config
