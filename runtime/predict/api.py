"""The Python entry point of predict: :class:`Segmenter`, loaded once, segments many scans or arrays.

    from runtime.predict.api import PredictOptions, Segmenter

    segmenter = Segmenter.from_checkpoint("model.pt")     # or several checkpoints: an ensemble
    result = segmenter.segment_file("scan.nii.gz")        # any orientation; NRRD, MHA, DICOM too
    labels, probabilities = segmenter.segment_array(volume, affine, probabilities=True)
    segmenter = Segmenter.from_network(network, PredictOptions(window=(128, 128, 128)))  # built already
    dice = score(result.labels, truth)                    # Dice: NaN for a label absent from both

``--exec_mode predict`` runs every scan through a :class:`Segmenter` made from its resolved
config (:meth:`Segmenter.from_config`), so the command line and the notebook share one code
path: the same window (the checkpoint's training patch unless given), the same preprocessing,
the same sliding window, the same way back to the input's own grid and axes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from numbers import Integral
from typing import Callable, Sequence

import numpy as np
import torch

from data_loading.scans import RawScan, read_scan
from model.unet3d import SHAPE_DIVISOR
from runtime.config import Config, UsageError, checkpoint_path_problem
from runtime.checkpoint import Saved
from runtime.inference.backends import say_on, window_predictor
from runtime.mode import int8_problems, problems
from runtime.predict.calibration import calibration_policy
from runtime.predict.records import Dice, score  # noqa: F401 - the API's Dice (NaN: a label absent from both)
from runtime.predict.scan import (EnsembleInference, ScanInference, Segmentation, StageTimer, load_trained_model,
                                  segment_volume)


def raw_from_array(array: np.ndarray, affine: np.ndarray, spacing: Sequence[float] | None = None) -> RawScan:
    """A 3-D intensity array (HU for CT) with its voxel-to-world ``affine`` (RAS, as nibabel's)
    brought to the KiTS19 layout as :func:`data_loading.scans.read_scan` brings a file;
    ``spacing`` (mm per array axis) defaults to the affine's voxel sizes."""
    from nibabel.affines import voxel_sizes

    from data_loading.scan_io import ScanError, orientation_from_affine
    from data_loading.scans import refuse_label_map

    array = np.asarray(array)
    affine = np.asarray(affine, dtype=np.float64)
    if array.ndim != 3:
        raise ScanError(f"array: {array.ndim} dimensions, a scan has 3")
    if affine.shape != (4, 4):
        raise ScanError(f"array: the affine is {affine.shape}, not 4 x 4")
    orientation = orientation_from_affine(affine, array.shape, "array")
    file_spacing = [float(s) for s in (voxel_sizes(affine) if spacing is None else spacing)]
    image = array.astype(np.float32, copy=False)
    if not np.isfinite(image).all():
        raise ScanError("array: NaN or infinite intensities")
    refuse_label_map(image, "array")
    kits = image if orientation.identity else orientation.to_kits(image)
    return RawScan(kits[None], orientation.spacing_to_kits(file_spacing), None, orientation, file_spacing)


DEVICES = ("auto", "cpu", "cuda")  # --device's choices
BACKENDS = ("auto", "torch", "openvino")  # --backend's choices


@dataclass(frozen=True)
class PredictOptions:
    """Predict's knobs, each its flag's value with the flag's default: ``device`` (``--device``:
    auto, cpu, cuda), ``window`` (``--val_input_shape``; None: the checkpoint's training patch,
    128³ for :meth:`Segmenter.from_network`), ``overlap``, ``sw_batch_size``, ``tta``, ``amp``,
    ``backend`` (``--backend``: auto, torch, openvino), ``int8``, ``int8_calibration``
    (``--int8_calibration``: a scan file or folder to calibrate on once; "": each file alone),
    ``channels_last``; ``verbose`` prints the lines predict prints (window, weights, backend).
    Checked when made: a bad value raises ``UsageError``, the command line's one line naming
    the flag."""

    device: str = Config.device
    window: tuple[int, ...] | None = None
    overlap: float = Config.overlap
    sw_batch_size: int = Config.sw_batch_size
    tta: bool = Config.tta
    amp: bool = Config.amp
    backend: str = Config.backend
    int8: bool = Config.int8
    int8_calibration: str = Config.int8_calibration
    channels_last: bool = Config.channels_last
    verbose: bool = True

    def __post_init__(self):
        errors = self.errors()
        if errors:
            raise UsageError(errors[0])

    def errors(self) -> list[str]:
        """Every problem with these options, one line each, in the words of the flags' checks
        (:func:`runtime.arguments.validate`)."""
        from runtime.config import cuda_available

        window = None if self.window is None else list(self.window)
        checks = [
            (self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}"),
            (self.backend in BACKENDS, f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}"),
            (window is None or len(window) == 3, f"--val_input_shape needs 3 sizes, got {len(window or ())}"),
            (window is None or all(isinstance(s, Integral) and s > 0 and s % SHAPE_DIVISOR == 0 for s in window),
             f"--val_input_shape sizes must be positive multiples of {SHAPE_DIVISOR}, got {window}"),
            (0.0 <= self.overlap < 1.0, f"--overlap must be in [0, 1), got {self.overlap}"),
            (isinstance(self.sw_batch_size, Integral) and self.sw_batch_size >= 1,
             f"--sw_batch_size must be >= 1, got {self.sw_batch_size}"),
            (self.device != "cuda" or cuda_available(),
             "--device cuda: no CUDA or ROCm GPU is visible here; use --device cpu or auto"),
        ]
        return problems(*checks) + int8_problems(self.int8, self.int8_calibration, self.device, self.amp)

    def config(self, checkpoints: Sequence[str] = ()) -> Config:
        """Predict's config of these options on ``checkpoints`` (none: a network given), before
        :func:`runtime.resolve.resolve`; a checkpoint that is no file raises ``UsageError`` (one
        line naming it)."""
        for path in checkpoints:
            if not os.path.isfile(path):
                raise UsageError(checkpoint_path_problem(path, "--load_ckpt_path"))
        values = {"exec_mode": "predict", "device": self.device, "overlap": self.overlap,
                  "sw_batch_size": self.sw_batch_size, "backend": self.backend}
        if self.window is not None:
            values["val_input_shape"] = tuple(int(size) for size in self.window)
        values.update((name, getattr(self, name)) for name in ("tta", "amp", "int8", "int8_calibration",
                                                               "channels_last") if getattr(self, name))
        if checkpoints:
            values["load_ckpt_path"] = checkpoints[0]
        # the fields given, as if on the command line: the checkpoint's values fill the others
        return Config(**values, load_ckpt_paths=tuple(checkpoints) if len(checkpoints) > 1 else (),
                      explicit=frozenset(values))


def _say_backend(config: Config, say: Callable[[str], None]) -> None:
    """The resolved ``config``'s backend and why, and why the window batch was lowered, if it was."""
    say(f"backend: {config.why('backend')}")
    if config.why("window_batch"):
        say(config.why("window_batch"))


# builds the window inference of the networks for an int8 calibration set (None: fp32)
Build = Callable[[object], Callable[[np.ndarray], torch.Tensor]]


class Segmenter:
    """Trained network(s) loaded once, to segment many CT volumes.

    Made by :meth:`from_checkpoint` (one checkpoint, or several: an ensemble, the mean of their
    softmax probabilities), :meth:`from_network` (a network built already) or :meth:`from_config`
    (``--exec_mode predict``'s resolved config). With ``int8``, each file is calibrated on alone
    (:meth:`segment_file`: its result can be reproduced from that file alone), unless
    ``int8_calibration`` names the scans to calibrate on once, which an array
    (:meth:`segment_array`) needs: ``policy`` (:mod:`runtime.predict.calibration`, from the
    plan's decision). ``config`` is the resolved config (never changed after); ``calibration``
    the int8 calibration set of the last volume segmented (None without int8).

    :meth:`segment_file` and :meth:`segment_array` return labels (0 background, 1 kidney,
    2 tumour) on the input's own grid and in its own axis order, whatever its orientation.
    """

    def __init__(self, config: Config, build: Build, device: torch.device, verbose: bool = True):
        """``build(calibration)``: the window inference (preprocessed image -> probabilities) of
        the networks, int8 on ``calibration`` when given. Everything one set serves (fp32, or the
        set ``int8_calibration`` names) is built here; each scan's own set when the scan comes."""
        self._say, self.device, self.config, self._build = say_on(verbose), device, config, build
        self.policy = calibration_policy(config)
        self.calibration, self._digest, self._infer = None, None, None
        if not self.policy.per_scan:
            self._inference(self.policy.set_for(None, None))

    @classmethod
    def from_checkpoint(cls, checkpoints: str | os.PathLike | Sequence[str | os.PathLike],
                        options: PredictOptions = PredictOptions()) -> "Segmenter":
        """The segmenter of ``checkpoints`` (one path, or several: an ensemble; the same network and
        window, else a one-line ``UsageError`` naming both) with ``options``."""
        from runtime.checkpoint import saved_ensemble, saved_for

        paths = [checkpoints] if isinstance(checkpoints, (str, os.PathLike)) else list(checkpoints)
        config = options.config([os.fspath(path) for path in paths])
        saved, ensemble = saved_for(config), saved_ensemble(config)
        config, device = cls._resolved(config, options.verbose, saved, ensemble)
        return cls.from_config(config, [saved, *ensemble], device, options.verbose)

    @classmethod
    def from_network(cls, network: torch.nn.Module | Sequence[torch.nn.Module],
                     options: PredictOptions = PredictOptions()) -> "Segmenter":
        """The segmenter of ``network`` (an ``nn.Module`` built and loaded already, or several: an
        ensemble) with ``options``: the backend converts it as it converts a checkpoint's; the
        window is ``options.window`` (default 128³, there being no training patch to take)."""
        networks = [network] if isinstance(network, torch.nn.Module) else list(network)
        config, device = cls._resolved(options.config(), options.verbose)
        say = say_on(options.verbose)
        _say_backend(config, say)
        members = [("", net.to(device).eval()) for net in networks]
        return cls(config, partial(_window_inference, config, members, device, say), device, options.verbose)

    @classmethod
    def from_inference(cls, infer: Callable[[np.ndarray], torch.Tensor], config: Config,
                       device: torch.device = torch.device("cpu")) -> "Segmenter":
        """The segmenter of a window inference given as it is (preprocessed image (1, D, H, W) ->
        probabilities (3, D, H, W), fp32: a benchmark's reference network) and its resolved
        ``config``, for predict's folder (:func:`runtime.predict.folder.predict_cases`)."""
        if config.int8:
            raise UsageError("--int8 quantises predict's own networks; a window inference given as it is "
                             "computes what it computes: drop --int8")
        return cls(config, lambda calibration: infer, device, verbose=False)

    @staticmethod
    def _resolved(config: Config, verbose: bool, saved: Saved | None = None,
                  ensemble: Sequence[Saved] = ()) -> tuple[Config, torch.device]:
        """``config`` resolved on this process's device (one process), its window line said."""
        from runtime.distributed import DistInfo, select_device
        from runtime.resolve import resolve, window_line

        dist = DistInfo(rank=0, local_rank=0, world_size=1, device=select_device(config.device, 0))
        config = resolve(config, dist, None, saved, ensemble)
        if verbose:
            print(window_line(config), flush=True)
        return config, dist.device

    @classmethod
    def from_config(cls, config: Config, saved: Saved | Sequence[Saved], device: torch.device,
                    verbose: bool = True) -> "Segmenter":
        """The segmenter of a resolved predict ``config`` (:func:`runtime.resolve.resolve`) and its
        checkpoint(s) ``saved``, read already: what ``--exec_mode predict`` runs."""
        say = say_on(verbose)
        _say_backend(config, say)
        members = []
        for one in [saved] if isinstance(saved, Saved) else list(saved):  # the same plan, each its weights
            members.append((one.path, load_trained_model(config, one, device, say)))
        return cls(config, partial(_window_inference, config, members, device, say), device, verbose)

    def calibration_for(self, name: str, path: str):
        """The int8 calibration set the scan ``path`` (named ``name``) is segmented with (the
        policy's: itself alone, or the named set; None without ``--int8``): give it to
        :meth:`segment_raw`, and its ``digest()`` to the scan's record."""
        return self.policy.set_for(name, path)

    def _inference(self, calibration):
        """The window inference on ``calibration`` (None: fp32), built once per set in a row."""
        digest = None if calibration is None else calibration.digest()
        if self._infer is None or digest != self._digest:
            self._infer, self._digest = None, None  # the previous networks go before the next are built
            self._infer, self._digest, self.calibration = self._build(calibration), digest, calibration
        return self._infer

    @property
    def windows(self) -> int:
        """How many windows the last volume ran through the network(s)."""
        return self._infer.windows

    def segment_raw(self, raw: RawScan, probabilities: bool = False, path: str = "",
                    timer: StageTimer | None = None, calibration=None) -> Segmentation:
        """A volume read into the KiTS19 layout -> its :class:`Segmentation` on its own grid,
        int8 on ``calibration`` (:meth:`calibration_for`; None: the policy's one set, or fp32)."""
        infer = self._inference(calibration if calibration is not None else self.policy.set_for(None, None))
        return segment_volume(raw, infer, timer or StageTimer(), probabilities, path, self.config.target_spacing)

    def segment_file(self, path: str | os.PathLike, probabilities: bool = False) -> Segmentation:
        """Segment one scan file (NIfTI; NRRD, MHA/MHD or a DICOM series with SimpleITK), any
        orientation: a :class:`runtime.predict.scan.Segmentation` (``labels`` in the file's array
        order and grid, ``probabilities`` with ``probabilities=True``, ``nifti``/``affine`` to
        write the labels with). A bad file raises ``ScanError`` (one line naming it)."""
        from data_loading.scan_checks import check_header

        path = os.fspath(path)
        check_header(path)
        raw = read_scan(path)
        calibration = None
        if self.policy.per_scan:  # named as predict names it, so that its calibration is the command line's
            from data_loading.scans import find_scans

            found = find_scans(path)
            calibration = self.calibration_for(found[0].name if len(found) == 1 else os.path.basename(path), path)
        return self.segment_raw(raw, probabilities, path, calibration=calibration)

    def segment_array(self, array: np.ndarray, affine: np.ndarray, probabilities: bool = False,
                      spacing: Sequence[float] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Segment a 3-D CT volume (HU) whose voxel-to-world ``affine`` is nibabel's (RAS+ world,
        e.g. ``nibabel.load(f).affine``), in any axis order: ``(labels, probabilities)``, labels
        uint8 of ``array``'s shape and axes, probabilities float32 (3, *array.shape) or None.
        Without ``spacing`` (mm per array axis), the affine's voxel sizes are used, and one line
        says so (``np.eye(4)``: 1 mm voxels)."""
        if spacing is None:
            from nibabel.affines import voxel_sizes

            sizes = [float(f"{s:.6g}") for s in voxel_sizes(np.asarray(affine, dtype=np.float64))]
            self._say(f"array: no spacing given: {sizes} mm per axis assumed, the affine's voxel sizes "
                      "(give spacing= if they are not)")
        result = self.segment_raw(raw_from_array(array, affine, spacing), probabilities, "array")
        return result.labels, result.probabilities


def _window_inference(plan: Config, members: Sequence[tuple[str, torch.nn.Module]], device: torch.device,
                      say: Callable[[str], None], calibration) -> ScanInference | EnsembleInference:
    """The window inference of every network of ``members`` (each with its checkpoint's path,
    "" for a network given) on the resolved ``plan``, converted by the backend, int8 on
    ``calibration`` (the backend's calibration set) when given: one network's, or the mean of
    their probabilities."""
    inferences = [ScanInference(window_predictor(model, plan, device, say, calibration, checkpoint), plan, device)
                  for checkpoint, model in members]
    return inferences[0] if len(inferences) == 1 else EnsembleInference(inferences)
