"""Real full and read-only disks for the write-failure tests: a small tmpfs mounted on a folder.

Mounting needs root (or CAP_SYS_ADMIN); elsewhere the tests that use :func:`small_disk` skip with
the reason. Every mount is undone when the test ends, whatever happens in it.
"""
from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager

import pytest


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


@contextmanager
def small_disk(folder, size: str = "4m"):
    """A tmpfs of ``size`` mounted on ``folder`` (created), unmounted at the end."""
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a real full disk) needs root")
    try:
        done = _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", folder], capture_output=True)


def fill(folder, name: str = "filler", leave: int = 0) -> str:
    """Fill the file system of ``folder`` with one file, to the last byte or up to ``leave``
    free bytes; returns its path. (With a page or so left, ``torch.save`` fails inside its zip
    writer, a ``RuntimeError`` around the ``OSError``; with nothing left, the ``OSError`` of
    the final flush comes last: both happen on real full disks.)"""
    path = os.path.join(str(folder), name)
    block = bytes(1 << 16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for size in (1 << 16, 4096, 1):
            while True:
                try:
                    if os.write(fd, block[:size]) == 0:
                        break
                except OSError:
                    break
    finally:
        os.close(fd)
    if leave:
        os.truncate(path, max(0, os.path.getsize(path) - leave))
    return path


def read_only(folder) -> None:
    """Remount the tmpfs on ``folder`` read-only."""
    done = _mount("-o", "remount,ro", str(folder))
    if done.returncode != 0:
        pytest.skip(f"cannot remount read-only: {done.stderr.strip()}")
