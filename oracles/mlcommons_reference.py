"""The MLCommons reference's own network, loss, optimizer and sliding window, from a checkout of its code.

The tests' oracle (tests/test_mlcommons_reference.py compares the project with it) and what the
benchmarks' ``mlcommons`` variants run; it lives in ``oracles/``, beside the product, because
both use it and neither imports the other (the product imports nothing of it). Point
``--reference_code`` at the ``image_segmentation/pytorch`` folder of a checkout of
github.com/mlcommons/training (none of that code is in this repository). Its ``model.unet3d.Unet3D``
and ``runtime.inference.sliding_window_inference`` run unchanged. Two accommodations, each only
where the thing is missing and each for the reference's modules alone (nothing is patched for the
rest of the process): SciPy 1.13 removed ``scipy.signal.gaussian``, which the reference's
``gaussian_kernel`` calls, so the reference modules' own ``signal`` is scipy.signal with
``gaussian`` = ``scipy.signal.windows.gaussian`` (the same function under its current name), while
``scipy.signal`` itself is left as it is; and NVIDIA's ``dllogger`` (not on PyPI), which the
reference's ``runtime/logging.py`` imports for its training log, is an empty stand-in in
``sys.modules`` for the import only (nothing on the inference path calls it; torchvision, for the
data loader's import, likewise). The reference's layers log their weight initialisation through
``mlperf_logging`` (``:::MLLOG`` lines) as they are built.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_FILES = ("model/unet3d.py", "model/layers.py", "runtime/inference.py", "runtime/distributed_utils.py",
                   "runtime/logging.py")
TRAINING_FILES = ("model/losses.py", "runtime/training.py")  # also read by load_reference_training
PACKAGES = ("model", "runtime", "data_loading")  # the reference's package names, which are also this project's


class ReferenceCodeError(SystemExit):
    """The reference code cannot be used (one line)."""


def check_reference_code(code_dir: str) -> str:
    """``code_dir`` resolved, or one line naming the first reference file it lacks."""
    missing = [f for f in REFERENCE_FILES if not os.path.isfile(os.path.join(code_dir, f))]
    if missing:
        raise ReferenceCodeError(f"--reference_code {code_dir}: no {missing[0]} there (give the "
                                 "image_segmentation/pytorch folder of a mlcommons/training checkout)")
    return os.path.realpath(code_dir)


def dllogger_stand_in() -> types.ModuleType:
    """An empty ``dllogger`` with the names the reference's ``runtime/logging.py`` imports."""
    module = types.ModuleType("dllogger", "stand-in: NVIDIA's DLLogger is not installed")
    for name in ("StdOutBackend", "Verbosity", "JSONStreamBackend", "init", "log", "flush"):
        setattr(module, name, None)
    return module


def _is_project_path(entry: str) -> bool:
    return os.path.realpath(entry or os.getcwd()) == str(ROOT)


def torchvision_stand_in() -> types.ModuleType:
    """A ``torchvision`` with ``transforms.Compose`` only: the reference's data loader builds its
    augmentation chain with it (the crop the tests call does not use it)."""
    module = types.ModuleType("torchvision", "stand-in: torchvision is not installed")
    transforms = types.ModuleType("torchvision.transforms")

    class Compose:
        def __init__(self, steps):
            self.steps = list(steps)

        def __call__(self, data):
            for step in self.steps:
                data = step(data)
            return data

    transforms.Compose = Compose
    module.transforms = transforms
    return module


def _require(code_dir: str, files: Sequence[str]) -> None:
    missing = [f for f in files if not os.path.isfile(os.path.join(code_dir, f))]
    if missing:
        raise ReferenceCodeError(f"--reference_code {code_dir}: no {missing[0]} there (give the "
                                 "image_segmentation/pytorch folder of a mlcommons/training checkout)")


def load_reference_crop(code_dir: str) -> type:
    """The reference's ``RandBalancedCrop`` (``data_loading/pytorch_loader.py``): its uniform and
    foreground crop, drawn from Python's ``random`` and NumPy's global generator."""
    _require(code_dir, ("data_loading/pytorch_loader.py",))
    (loader,) = _import_reference(code_dir, ("data_loading.pytorch_loader",), required=(),
                                  stand_ins=STAND_INS + (("torchvision", torchvision_stand_in),))
    return loader.RandBalancedCrop


def load_reference_train_loop(code_dir: str) -> types.ModuleType:
    """The reference's ``runtime/training.py`` module (its ``train`` loop: the gradient-accumulation
    tail and the evaluation epochs; a test replaces its ``evaluate`` and logging globals)."""
    _require(code_dir, ("runtime/training.py", "runtime/inference.py", "runtime/logging.py",
                        "runtime/distributed_utils.py"))
    (training,) = _import_reference(code_dir, ("runtime.training",), required=())
    return training


def _missing(name: str) -> bool:
    return name not in sys.modules and importlib.util.find_spec(name) is None


@contextlib.contextmanager
def _stand_ins_while_importing(stand_ins: Sequence[tuple[str, Callable[[], types.ModuleType]]]):
    """Each ``(name, make)`` whose module is not installed put in ``sys.modules`` (with its
    submodules) for the ``with`` block only; the reference's modules keep what they imported."""
    added = []
    for name, make in stand_ins:
        if _missing(name):
            module = make()
            modules = {name: module, **{f"{name}.{key}": value for key, value in vars(module).items()
                                        if isinstance(value, types.ModuleType)}}
            sys.modules.update(modules)
            added += list(modules)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def signal_with_gaussian() -> types.ModuleType:
    """``scipy.signal`` as the reference calls it: itself where it still has ``gaussian``
    (SciPy before 1.13), else a module of its own that answers every name as scipy.signal does
    and ``gaussian`` as ``scipy.signal.windows.gaussian`` (scipy.signal itself unchanged)."""
    import scipy.signal

    if hasattr(scipy.signal, "gaussian"):
        return scipy.signal
    own = types.ModuleType("scipy.signal", "scipy.signal with gaussian (removed in SciPy 1.13) for the reference")
    own.gaussian = scipy.signal.windows.gaussian
    own.__getattr__ = lambda name: getattr(scipy.signal, name)  # PEP 562: every other name is scipy.signal's
    return own


def _give_own_signal(modules: Sequence[types.ModuleType]) -> None:
    """In each reference module, ``signal`` (``from scipy import signal``) becomes
    :func:`signal_with_gaussian`: the module's own global, not scipy's attribute."""
    import scipy.signal

    own = signal_with_gaussian()
    for module in modules:
        for key, value in list(vars(module).items()):
            if value is scipy.signal:
                setattr(module, key, own)


STAND_INS = (("dllogger", dllogger_stand_in),)


def _import_reference(code_dir: str, names: Sequence[str], required: Sequence[str] | None = None,
                      stand_ins: Sequence[tuple[str, Callable[[], types.ModuleType]]] = STAND_INS
                      ) -> list[types.ModuleType]:
    """The reference's modules ``names`` imported from ``code_dir`` (see :func:`load_reference`);
    ``required``: the files checked first (default: :data:`REFERENCE_FILES`); ``stand_ins``:
    modules given for the import where not installed (:func:`_stand_ins_while_importing`)."""
    if required is None:
        code_dir = check_reference_code(code_dir)
    else:
        _require(code_dir, required)
        code_dir = os.path.realpath(code_dir)
    ours = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in PACKAGES}
    path = list(sys.path)
    sys.path[:] = [code_dir] + [p for p in path if not _is_project_path(p)]
    theirs = []
    try:
        with _stand_ins_while_importing(stand_ins):
            modules = [importlib.import_module(name) for name in names]
    finally:
        sys.path[:] = path
        for name in [k for k in sys.modules if k.split(".")[0] in PACKAGES]:
            theirs.append(sys.modules.pop(name))
        sys.modules.update(ours)
    for module in modules:
        if not os.path.realpath(module.__file__).startswith(code_dir + os.sep):
            raise ReferenceCodeError(f"--reference_code {code_dir}: imported {module.__file__} instead")
    _give_own_signal([m for m in theirs if os.path.realpath(getattr(m, "__file__", None) or "")
                      .startswith(code_dir + os.sep)])
    return modules


def load_reference_training(code_dir: str) -> tuple[type, type, Callable]:
    """``(Unet3D, DiceCELoss, get_optimizer)`` of the reference code at ``code_dir``: its network,
    its loss and its optimizer factory (``runtime/training.py``), for timing its training step."""
    missing = [f for f in TRAINING_FILES if not os.path.isfile(os.path.join(code_dir, f))]
    if missing:
        raise ReferenceCodeError(f"--reference_code {code_dir}: no {missing[0]} there (give the "
                                 "image_segmentation/pytorch folder of a mlcommons/training checkout)")
    unet3d, losses, training = _import_reference(code_dir, ("model.unet3d", "model.losses", "runtime.training"))
    return unet3d.Unet3D, losses.DiceCELoss, training.get_optimizer


def load_reference(code_dir: str) -> tuple[type, Callable]:
    """``(Unet3D, sliding_window_inference)`` imported from the reference code at ``code_dir``.

    Its packages have this project's names (``model``, ``runtime``) and no ``__init__.py``, so
    they are imported with this project's folder off the path and this project's modules of those
    names out of ``sys.modules``; afterwards both are put back as they were (the reference's
    functions keep their own modules' globals).
    """
    unet3d, inference = _import_reference(code_dir, ("model.unet3d", "runtime.inference"))
    return unet3d.Unet3D, inference.sliding_window_inference


def trimmed_box(shape: Sequence[int], roi: Sequence[int], overlap: float) -> tuple[slice, ...]:
    """Where the reference's output lies in a volume of ``shape``: its sliding window trims a
    remainder below half a stride from each axis (half before, the rest after), as in its code.
    Written from the reference's rule on purpose, not from the project's ``window_geometry``
    (which differs where an axis is shorter than half a stride): a test compares the two."""
    box = []
    for size, window in zip(shape, roi):
        stride = int(window * (1 - overlap))
        cut = size % stride if size % stride < stride // 2 else 0
        box.append(slice(cut // 2, size - (cut - cut // 2)))
    return tuple(box)


class ReferenceInference:
    """``preprocessed image (1, D, H, W) -> probabilities (3, D, H, W)`` by the reference's
    network and sliding window (:func:`reference_infer`); ``windows``: how many windows the last
    call ran through the network, as ``runtime.predict.scan.ScanInference`` counts them (so
    predict's summary records them)."""

    def __init__(self, model: torch.nn.Module, sliding_window_inference: Callable, inference):
        self.model, self.sliding_window_inference = model, sliding_window_inference
        self.roi, self.overlap = list(inference.window), inference.overlap
        self.windows = 0

    def _counted(self, window: torch.Tensor) -> torch.Tensor:
        self.windows += window.shape[0]
        return self.model(window)

    def __call__(self, image: np.ndarray) -> torch.Tensor:
        self.windows = 0
        volume = torch.from_numpy(np.ascontiguousarray(image, dtype=np.float32))[None]
        labels = torch.zeros((1, 1, *image.shape[1:]), dtype=torch.uint8)
        with torch.no_grad():
            logits, _ = self.sliding_window_inference(inputs=volume, labels=labels, roi_shape=self.roi,
                                                      model=self._counted, overlap=self.overlap,
                                                      mode="gaussian", padding_val=-2.2)
        box = trimmed_box(image.shape[1:], self.roi, self.overlap)
        # On an axis both trimmed and padded (trimmed below the window) the reference crops its
        # output with the untrimmed size: the voxels past the trimmed ones are pad, not the scan's.
        logits = logits[(0, slice(None), *(slice(0, b.stop - b.start) for b in box))]
        probabilities = torch.zeros((3, *image.shape[1:]), dtype=torch.float32)
        probabilities[0] = 1.0
        probabilities[(slice(None), *box)] = torch.softmax(logits, 0)
        return probabilities


def reference_infer(code_dir: str, state: dict, network, inference) -> ReferenceInference:
    """The reference's ``Unet3D`` (``network``'s normalization and activation, a plan's network
    section) with ``state`` and its ``sliding_window_inference`` called as its evaluation calls it
    (fp32, Gaussian, ``padding_val=-2.2``, under ``torch.no_grad``) with ``inference``'s window and
    overlap (a plan's inference section), one window per forward, as predict's ``infer``. Voxels
    its window trims get background probability 1 (its evaluation scores them not at all)."""
    unet3d, sliding_window_inference = load_reference(code_dir)
    model = unet3d(1, 3, network.normalization, network.activation)
    if list(model.filters) != list(network.filters):  # the reference builds 32..320 in
        raise ReferenceCodeError(f"the reference's Unet3D has filters {list(model.filters)} built in; "
                                 f"this checkpoint's are {list(network.filters)}")
    model.load_state_dict(state)
    model.eval()
    return ReferenceInference(model, sliding_window_inference, inference)
