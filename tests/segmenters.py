"""A test's window inference (preprocessed image -> probabilities) as predict's
:class:`runtime.predict.api.Segmenter`, which :func:`runtime.predict.scan.segment_scan` takes:
:meth:`Segmenter.from_inference` with a predict plan resolved once (PyTorch on the CPU, no int8)."""
from __future__ import annotations

import functools

import torch

from runtime.arguments import Config
from runtime.distributed import DistInfo
from runtime.predict.api import Segmenter
from runtime.resolve import resolve


@functools.lru_cache(maxsize=None)
def predict_plan():
    config = Config(exec_mode="predict", input=".", output_dir=".", backend="torch", device="cpu")
    return resolve(config, DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")), None)


def segmenter(infer) -> Segmenter:
    """``infer`` (a function, or a :class:`runtime.predict.scan.ScanInference`) as a Segmenter."""
    return Segmenter.from_inference(infer, predict_plan())
