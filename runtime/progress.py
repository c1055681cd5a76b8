"""Progress for long work, one policy everywhere: a tqdm bar on a terminal, one line per item in a
log file, on rank 0 only.

:func:`progress` is the policy; its users: training batches (with ``--verbose`` only),
evaluation cases and benchmark iterations (always: each can take minutes on a CPU) through a
run's :func:`make_progress`, predict's scans (whose own result line is the line per item in a
log) and the report's compliance checks. Progress goes to stderr (as tqdm's bars do), so that
stdout carries only results (``mean_dice ...``, ``RUN_SUMMARY,...``); a line printed while a bar
runs goes through :func:`write`, so that it does not break the bar.
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


def progress(iterable: Iterable, desc: str, total: int | None = None, show: bool = True, tty: bool | None = None,
             own_lines: bool = False, unit: str = "it") -> Iterable:
    """``iterable`` reporting its progress: nothing unless ``show`` (rank 0, and asked for); a bar
    when stderr is a terminal (``tty``); else one line per item, or none where the caller prints
    its own line per item (``own_lines``)."""
    if not show:
        return iterable
    if sys.stderr.isatty() if tty is None else tty:
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, total=total, unit=unit, leave=False, dynamic_ncols=True)
    return iterable if own_lines else lines(iterable, desc, total)


def write(line: str, stream=None) -> None:
    """Print ``line`` (stdout by default) without breaking a progress bar."""
    from tqdm import tqdm

    tqdm.write(line, file=stream or sys.stdout)


def make_progress(verbose: bool, is_main: bool, tty: bool | None = None):
    """The ``progress`` function of a run: ``always`` for evaluation cases and benchmark
    iterations, else with ``--verbose`` (``verbose``) only (see the module docstring)."""
    def run_progress(iterable, desc: str = "", total: int | None = None, always: bool = False):
        return progress(iterable, desc, total, show=is_main and (always or verbose), tty=tty)

    return run_progress
