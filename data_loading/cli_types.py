"""Pieces every command line of the project shares: a one-line-error parser and integer types.

Used by ``main.py`` (``runtime.arguments``), ``preprocess_dataset.py`` and
``python -m data_loading.synthetic``. It lives in ``data_loading`` because that package has a
command line of its own and imports nothing from ``runtime``; it imports only ``argparse``.
"""
from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports errors in one line (no usage dump) and exits with code 2; with
    ``version``, a ``--version`` flag that prints ``<prog> <version>``."""

    def __init__(self, *args, version: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if version is not None:
            self.add_argument("--version", action="version", version=f"%(prog)s {version}",
                              help="print the program's version and exit")

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message}\n")


def _integer(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None


def positive_int(value: str) -> int:
    """argparse ``type=``: an integer >= 1."""
    number = _integer(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return number


def non_negative_int(value: str) -> int:
    """argparse ``type=``: an integer >= 0."""
    number = _integer(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return number
