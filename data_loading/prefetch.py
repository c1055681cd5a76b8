"""Prepare the next batches in a background thread while the current one is used.

``prefetch(batches, device, depth)`` iterates ``batches`` (tuples whose tensors are on the CPU
or already on ``device``) in a thread ``depth`` items ahead of the consumer. On CUDA the thread
copies each tensor to the device from pinned memory with ``non_blocking=True`` on its own
stream, and the consumer's stream waits on an event before using the batch, so the copy of
batch n+1 overlaps the training step on batch n. The work in the thread (numpy copies, torch
ops, waiting on DataLoader workers, host-to-device copies) releases the GIL.
``depth == 0`` is synchronous: no thread, copies on the current stream.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable, Iterable, Iterator

import torch

_DONE = object()


def _to_device(item: Any, device: torch.device | None) -> Any:
    """``item`` (tensor, or tuple/list of tensors and other values) moved to ``device``."""
    if isinstance(item, torch.Tensor):
        if device is None or item.device == device:
            return item
        if device.type == "cuda" and item.device.type == "cpu" and not item.is_pinned():
            item = item.pin_memory()
        return item.to(device, non_blocking=True)
    if isinstance(item, (tuple, list)):
        return type(item)(_to_device(value, device) for value in item)
    return item


def _record_stream(item: Any, stream) -> None:
    """Tell the caching allocator that ``stream`` uses ``item``'s CUDA memory now."""
    if isinstance(item, torch.Tensor):
        if item.is_cuda:
            item.record_stream(stream)
    elif isinstance(item, (tuple, list)):
        for value in item:
            _record_stream(value, stream)


def resolve_device(device: torch.device | str | None) -> torch.device | None:
    """``device`` as a torch.device, a CUDA device with its index (``cuda`` -> ``cuda:N``, the
    current one), or None."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _produce(batches: Iterable, device: torch.device | None, put: Callable[[Any], bool]) -> None:
    """Move each item of ``batches`` to ``device`` and ``put`` it with its ready event (CUDA);
    then ``_DONE``, or the error raised on the way (re-raised in the consumer)."""
    cuda = device is not None and device.type == "cuda"
    try:
        context = contextlib.nullcontext()
        if cuda:
            # Current device and stream are per thread. Work done while producing (device
            # augmentations, copies) goes to a side stream that first waits for what the
            # consumer had queued (e.g. filling the device cache).
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            context = torch.cuda.stream(stream)
        with context:
            for item in batches:
                item, ready = _to_device(item, device), None
                if cuda:
                    ready = torch.cuda.Event()
                    ready.record(stream)
                if not put((item, ready)):
                    return
        put(_DONE)
    except BaseException as err:  # re-raised in the consumer, with its traceback
        put(err)


def prefetch(batches: Iterable, device: torch.device | str | None = None,
             depth: int = 2) -> Iterator:
    """Yield the items of ``batches`` moved to ``device``, produced ``depth`` items ahead."""
    device = resolve_device(device)
    if depth <= 0:
        for item in batches:
            yield _to_device(item, device)
        return

    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(value) -> bool:
        while not stop.is_set():
            try:
                slots.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    thread = threading.Thread(target=_produce, args=(batches, device, put), name="batch-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            got = slots.get()
            if got is _DONE:
                return
            if isinstance(got, BaseException):
                raise got
            item, ready = got
            if ready is not None:
                current = torch.cuda.current_stream(device)
                current.wait_event(ready)
                _record_stream(item, current)
            yield item
    finally:
        # The consumer stopped early (break, exception) or finished: release the producer.
        stop.set()
        while thread.is_alive():
            try:
                slots.get(timeout=0.05)
            except queue.Empty:
                pass
        thread.join()
