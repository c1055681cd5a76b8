"""Progress for long work: a tqdm bar on a terminal, one line per item in a log file.

``progress(iterable, desc=..., total=..., always=False)``: training batches show progress only
with ``--verbose``; evaluation cases and benchmark iterations (``always=True``) always do, since
each can take minutes on a CPU. Only rank 0 reports. Progress goes to stderr (as tqdm's bars
do), so that stdout carries only results (``mean_dice ...``, ``RUN_SUMMARY,...``).
"""
from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator


def lines(iterable: Iterable, desc: str, total: int | None, stream=None) -> Iterator:
    """Yield the items; after each one print ``desc: k/total done (s elapsed)``."""
    stream = stream or sys.stderr
    start = time.time()
    for count, item in enumerate(iterable, start=1):
        yield item
        print(f"{desc}: {count}/{total if total is not None else '?'} done ({time.time() - start:.1f} s)",
              file=stream, flush=True)


def make_progress(config, is_main: bool, tty: bool | None = None):
    """The ``progress`` function of a run (see the module docstring)."""
    tty = sys.stderr.isatty() if tty is None else tty

    def progress(iterable, desc: str = "", total: int | None = None, always: bool = False):
        if not is_main or not (always or config.verbose):
            return iterable
        if tty:
            from tqdm import tqdm

            return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)
        return lines(iterable, desc, total)

    return progress
