"""The Python entry point of predict: :class:`Segmenter`, loaded once, segments many scans or arrays.

    from runtime.predict.api import Segmenter

    segmenter = Segmenter("model.pt")                     # or several checkpoints: an ensemble
    result = segmenter.segment_file("scan.nii.gz")        # any orientation; NRRD, MHA, DICOM too
    labels, probabilities = segmenter.segment_array(volume, affine, probabilities=True)

``--exec_mode predict`` runs every scan through a :class:`Segmenter` made from its resolved
config (:meth:`Segmenter.from_config`), so the command line and the notebook share one code
path: the same window (the checkpoint's training patch unless given), the same preprocessing,
the same sliding window, the same way back to the input's own grid and axes.
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np
import torch

from data_loading.scans import RawScan, read_scan
from runtime.arguments import Config, build_parser, config_from_namespace, explicit_flags, replace, validate
from runtime.checkpoint import Saved
from runtime.inference.backends import say_on, window_predictor
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


class Segmenter:
    """Trained network(s) loaded once, to segment many CT volumes.

    ``checkpoints``: one checkpoint path, or several (an ensemble: the mean of their softmax
    probabilities; the same network and window, else a one-line ``UsageError`` naming both).
    The options are predict's flags, with their defaults: ``device`` (``--device``: auto, cpu,
    cuda), ``window`` (``--val_input_shape``; None: the checkpoint's training patch), ``overlap``,
    ``tta``, ``sw_batch_size``, ``amp``, ``backend`` (``--backend``: auto, torch, openvino),
    ``int8``, ``channels_last``; ``verbose`` prints the lines predict prints (the window, the
    weights, the backend). ``config`` is the resolved :class:`runtime.arguments.Config`.
    With ``int8``, each file is calibrated on alone (:meth:`segment_file`: its result can be
    reproduced from that file alone), unless ``calibration_scans`` (scan files) name one set to
    calibrate on once, which an array (:meth:`segment_array`) needs.

    :meth:`segment_file` and :meth:`segment_array` return labels (0 background, 1 kidney,
    2 tumour) on the input's own grid and in its own axis order, whatever its orientation.
    """

    def __init__(self, checkpoints: str | os.PathLike | Sequence[str | os.PathLike], device: str = "auto", *,
                 window: Sequence[int] | None = None, overlap: float = Config.overlap, tta: bool = False,
                 sw_batch_size: int = Config.sw_batch_size, amp: bool = False, backend: str = Config.backend,
                 int8: bool = False, channels_last: bool = False, verbose: bool = True,
                 calibration_scans: Sequence[str | os.PathLike] = ()):
        from runtime.arguments import UsageError
        from runtime.checkpoint import saved_ensemble, saved_for
        from runtime.distributed import DistInfo, select_device
        from runtime.resolve import resolve, window_line

        paths = [checkpoints] if isinstance(checkpoints, (str, os.PathLike)) else list(checkpoints)
        argv = ["--exec_mode", "predict", "--input", os.curdir, "--output_dir", os.curdir, "--device", device,
                "--load_ckpt_path", *map(os.fspath, paths), "--overlap", str(overlap),
                "--sw_batch_size", str(sw_batch_size), "--backend", backend]
        argv += ["--val_input_shape", *map(str, window)] if window is not None else []
        argv += [flag for flag, on in (("--tta", tta), ("--amp", amp), ("--int8", int8),
                                       ("--channels_last", channels_last)) if on]
        parser = build_parser("Segmenter")
        config = config_from_namespace(parser.parse_args(argv), explicit_flags(argv, parser))
        errors = validate(config)
        if errors:
            raise UsageError(errors[0])
        dist = DistInfo(rank=0, local_rank=0, world_size=1, device=select_device(config.device, 0))
        saved = saved_for(config)
        ensemble = saved_ensemble(config)
        config = resolve(config, dist, None, saved, ensemble)
        if verbose:
            print(window_line(config), flush=True)
        self._load(config, [saved, *ensemble], dist.device, verbose,
                   [(os.path.basename(os.fspath(p)), os.fspath(p)) for p in calibration_scans])

    @classmethod
    def from_config(cls, config: Config, saved: Saved | Sequence[Saved], device: torch.device,
                    verbose: bool = True, calibration_scans: Sequence[tuple[str, str]] = ()) -> "Segmenter":
        """The segmenter of a resolved predict ``config`` (:func:`runtime.resolve.resolve`) and its
        checkpoint(s) ``saved``, read already: what ``--exec_mode predict`` runs;
        ``calibration_scans``: ``(name, path)`` of the scans being predicted, for ``--int8``."""
        segmenter = cls.__new__(cls)
        segmenter._load(config, [saved] if isinstance(saved, Saved) else list(saved), device, verbose,
                        calibration_scans)
        return segmenter

    def _load(self, config: Config, saved: list[Saved], device: torch.device, verbose: bool,
              calibration_scans: Sequence[tuple[str, str]] = ()) -> None:
        say = say_on(verbose)
        say(f"backend: {config.backend_why}")
        if config.sw_batch_note:
            say(config.sw_batch_note)
        self._say, self.device, self._base = say, device, config
        self._models = []
        for one in saved:
            member = replace(config, load_ckpt_path=one.path)
            self._models.append((member, load_trained_model(member, one, device, say)))
        # --int8: calibrated on each scan alone (calibrate_for), or once on a named set
        self.per_scan = bool(config.int8 and not calibration_scans)
        self.calibration = None
        self.config: Config = config
        self.infer: Callable[[np.ndarray], torch.Tensor] | None = None
        if config.int8 and calibration_scans:
            from runtime.inference.openvino.calibration import scan_calibration

            self._build(scan_calibration(config, calibration_scans))
        elif not config.int8:
            self._build(None)

    def _build(self, calibration) -> None:
        """The window predictors of every network, int8 on ``calibration`` (a
        :class:`runtime.inference.openvino.calibration.CalibrationSet`) when given."""
        members = [ScanInference(window_predictor(model, member, self.device, self._say, calibration), member,
                                 self.device) for member, model in self._models]
        self.calibration = calibration
        self.config = self._base if calibration is None else replace(self._base,
                                                                       calibration_sha256=calibration.digest())
        self.infer = members[0] if len(members) == 1 else EnsembleInference(members)

    def calibration_for(self, name: str, path: str):
        """The int8 calibration set the scan ``path`` (named ``name``) is segmented with: itself
        alone (the default), or the named set; None without ``--int8``."""
        if not self.per_scan:
            return self.calibration
        from runtime.inference.openvino.calibration import scan_calibration

        return scan_calibration(self._base, [(name, path)])

    def calibrate_for(self, name: str, path: str) -> None:
        """With ``--int8`` on each scan alone: the networks quantised on the scan ``path`` (once
        per scan; the conversion is cached), before it is segmented."""
        if not self.per_scan:
            return
        calibration = self.calibration_for(name, path)
        if self.calibration is None or calibration.digest() != self.calibration.digest():
            self._build(calibration)

    # the window predictor of predict's folder loop: preprocessed image -> probabilities
    def __call__(self, image: np.ndarray) -> torch.Tensor:
        """Class probabilities (3, D', H', W') of one preprocessed image (1, D', H', W')."""
        if self.infer is None:
            from runtime.arguments import UsageError

            raise UsageError("--int8 calibrates on each scan alone: segment a file (segment_file), or name the "
                             "scans to calibrate on once (calibration_scans)")
        return self.infer(image)

    @property
    def windows(self) -> int:
        """How many windows the last volume ran through the network(s)."""
        return self.infer.windows

    def segment_raw(self, raw: RawScan, probabilities: bool = False, path: str = "",
                    timer: StageTimer | None = None) -> Segmentation:
        """A volume read into the KiTS19 layout -> its :class:`Segmentation` on its own grid."""
        return segment_volume(raw, self, timer or StageTimer(), probabilities, path)

    def segment_file(self, path: str | os.PathLike, probabilities: bool = False) -> Segmentation:
        """Segment one scan file (NIfTI; NRRD, MHA/MHD or a DICOM series with SimpleITK), any
        orientation: a :class:`runtime.predict.scan.Segmentation` (``labels`` in the file's array
        order and grid, ``probabilities`` with ``probabilities=True``, ``nifti``/``affine`` to
        write the labels with). A bad file raises ``ScanError`` (one line naming it)."""
        from data_loading.scan_checks import check_header

        path = os.fspath(path)
        check_header(path)
        raw = read_scan(path)
        if self.per_scan:  # named as predict names it, so that its calibration is the command line's
            from data_loading.scans import find_scans

            found = find_scans(path)
            self.calibrate_for(found[0].name if len(found) == 1 else os.path.basename(path), path)
        return self.segment_raw(raw, probabilities, path)

    def segment_array(self, array: np.ndarray, affine: np.ndarray, probabilities: bool = False,
                      spacing: Sequence[float] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Segment a 3-D CT volume (HU) whose voxel-to-world ``affine`` is nibabel's (RAS+ world,
        e.g. ``nibabel.load(f).affine``), in any axis order: ``(labels, probabilities)``, labels
        uint8 of ``array``'s shape and axes, probabilities float32 (3, *array.shape) or None."""
        result = self.segment_raw(raw_from_array(array, affine, spacing), probabilities, "array")
        return result.labels, result.probabilities
