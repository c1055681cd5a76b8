"""The Python entry point of predict: :class:`Segmenter`, loaded once, segments many scans or arrays.

    from runtime.predict.api import PredictOptions, Segmenter

    segmenter = Segmenter.from_checkpoint("model.pt")     # or several checkpoints: an ensemble
    result = segmenter.segment_file("scan.nii.gz")        # any orientation; NRRD, MHA, DICOM too
    labels, probabilities = segmenter.segment_array(volume, affine, probabilities=True)
    segmenter = Segmenter.from_network(network, PredictOptions(window=(128, 128, 128)))  # built already
    dice = score(result.labels, truth)                    # Dice: NaN for a label absent from both

The API comes first, as nnU-Net's predictor: :class:`PredictOptions` are what the plan's inference
and precision sections are decided from (``runtime.resolve.resolve_predict``); no command line is
parsed. ``--exec_mode predict`` builds its options from its flags and runs every scan through a
:class:`Segmenter` made from its resolved plan (:meth:`Segmenter.from_plan`), so the command line
and the notebook share one code path: the same window (the checkpoint's training patch unless
given), the same preprocessing, the same sliding window, the same way back to the input's own grid
and axes.
"""
from __future__ import annotations

import os
from functools import partial
from typing import Callable, Sequence

import numpy as np
import torch

from data_loading.scans import RawScan, read_scan
from runtime.checkpoint import Saved
from runtime.config import PredictOptions, UsageError, checkpoint_path_problem  # noqa: F401 - the API's options
from runtime.inference.backends import say_on, window_predictor
from runtime.plan import RunPlan
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


def _say_backend(plan: RunPlan, say: Callable[[str], None]) -> None:
    """The resolved ``plan``'s backend and why, and why the window batch was lowered, if it was."""
    say(f"backend: {plan.why('backend')}")
    if plan.why("window_batch"):
        say(plan.why("window_batch"))


# builds the window inference of the networks for an int8 calibration set (None: fp32)
Build = Callable[[object], Callable[[np.ndarray], torch.Tensor]]


class Segmenter:
    """Trained network(s) loaded once, to segment many CT volumes.

    Made by :meth:`from_checkpoint` (one checkpoint, or several: an ensemble, the mean of their
    softmax probabilities), :meth:`from_network` (a network built already), both with
    :class:`PredictOptions`, or :meth:`from_plan` (``--exec_mode predict``'s resolved plan). With
    ``int8``, each file is calibrated on alone (:meth:`segment_file`: its result can be reproduced
    from that file alone), unless ``int8_calibration`` names the scans to calibrate on once, which
    an array (:meth:`segment_array`) needs: ``policy`` (:mod:`runtime.predict.calibration`, from
    the plan's decision). ``plan`` is the resolved plan (never changed after); ``calibration``
    the int8 calibration set of the last volume segmented (None without int8).

    :meth:`segment_file` and :meth:`segment_array` return labels (0 background, 1 kidney,
    2 tumour) on the input's own grid and in its own axis order, whatever its orientation.
    """

    def __init__(self, plan: RunPlan, build: Build, device: torch.device, verbose: bool = True):
        """``build(calibration)``: the window inference (preprocessed image -> probabilities) of
        the networks, int8 on ``calibration`` when given. Everything one set serves (fp32, or the
        set ``int8_calibration`` names) is built here; each scan's own set when the scan comes."""
        self._say, self.device, self.plan, self._build = say_on(verbose), device, plan, build
        self.policy = calibration_policy(plan)
        self.calibration, self._digest, self._infer = None, None, None
        if not self.policy.per_scan:
            self._inference(self.policy.set_for(None, None))

    @classmethod
    def from_checkpoint(cls, checkpoints: str | os.PathLike | Sequence[str | os.PathLike],
                        options: PredictOptions = PredictOptions()) -> "Segmenter":
        """The segmenter of ``checkpoints`` (one path, or several: an ensemble; the same network and
        window, else a one-line ``UsageError`` naming both) with ``options``."""
        from runtime.checkpoint import load_checkpoint

        paths = [os.fspath(path) for path in ([checkpoints] if isinstance(checkpoints, (str, os.PathLike))
                                              else list(checkpoints))]
        for path in paths:
            if not os.path.isfile(path):
                raise UsageError(checkpoint_path_problem(path, "--load_ckpt_path"))
        saved = [Saved(path, load_checkpoint(path), resume=False) for path in paths]
        plan, device = cls._resolved(options, saved[0] if saved else None, saved[1:])
        return cls.from_plan(plan, saved, device, options.verbose)

    @classmethod
    def from_network(cls, network: torch.nn.Module | Sequence[torch.nn.Module],
                     options: PredictOptions = PredictOptions()) -> "Segmenter":
        """The segmenter of ``network`` (an ``nn.Module`` built and loaded already, or several: an
        ensemble) with ``options``: the backend converts it as it converts a checkpoint's; the
        window is ``options.window`` (default 128³, there being no training patch to take)."""
        networks = [network] if isinstance(network, torch.nn.Module) else list(network)
        plan, device = cls._resolved(options)
        say = say_on(options.verbose)
        _say_backend(plan, say)
        members = [("", net.to(device).eval()) for net in networks]
        return cls(plan, partial(_window_inference, plan, members, device, say), device, options.verbose)

    @classmethod
    def from_inference(cls, infer: Callable[[np.ndarray], torch.Tensor], plan: RunPlan,
                       device: torch.device = torch.device("cpu")) -> "Segmenter":
        """The segmenter of a window inference given as it is (preprocessed image (1, D, H, W) ->
        probabilities (3, D, H, W), fp32: a benchmark's reference network) and its resolved
        ``plan``, for predict's folder (:func:`runtime.predict.folder.predict_cases`)."""
        if plan.precision.int8:
            raise UsageError("--int8 quantises predict's own networks; a window inference given as it is "
                             "computes what it computes: drop --int8")
        return cls(plan, lambda calibration: infer, device, verbose=False)

    @staticmethod
    def _resolved(options: PredictOptions, saved: Saved | None = None,
                  ensemble: Sequence[Saved] = ()) -> tuple[RunPlan, torch.device]:
        """The plan of ``options`` on this process's device (one process), its window line said
        (``options.verbose``)."""
        from runtime.distributed import DistInfo, select_device
        from runtime.resolve import resolve_predict, window_line

        dist = DistInfo(rank=0, local_rank=0, world_size=1, device=select_device(options.device, 0))
        plan = resolve_predict(options, dist, saved, ensemble)
        if options.verbose:
            print(window_line(plan), flush=True)
        return plan, dist.device

    @classmethod
    def from_plan(cls, plan: RunPlan, saved: Saved | Sequence[Saved], device: torch.device,
                  verbose: bool = True) -> "Segmenter":
        """The segmenter of a resolved predict ``plan`` (``runtime.resolve.resolve_predict``) and its
        checkpoint(s) ``saved``, read already: what ``--exec_mode predict`` runs."""
        say = say_on(verbose)
        _say_backend(plan, say)
        members = []
        for one in [saved] if isinstance(saved, Saved) else list(saved):  # the same plan, each its weights
            members.append((one.path, load_trained_model(plan.network, one, device, say,
                                                         plan.precision.channels_last)))
        return cls(plan, partial(_window_inference, plan, members, device, say), device, verbose)

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
        return segment_volume(raw, infer, timer or StageTimer(), probabilities, path, self.plan.network.target_spacing)

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


def _window_inference(plan: RunPlan, members: Sequence[tuple[str, torch.nn.Module]], device: torch.device,
                      say: Callable[[str], None], calibration) -> ScanInference | EnsembleInference:
    """The window inference of every network of ``members`` (each with its checkpoint's path,
    "" for a network given) on the resolved ``plan``, converted by the backend, int8 on
    ``calibration`` (the backend's calibration set) when given: one network's, or the mean of
    their probabilities."""
    inferences = [ScanInference(window_predictor(model, plan.network, plan.precision, plan.inference, device, say,
                                                 calibration, checkpoint), plan.inference, device)
                  for checkpoint, model in members]
    return inferences[0] if len(inferences) == 1 else EnsembleInference(inferences)
