"""3D U-Net on KiTS19 (MLPerf Training image segmentation): train, evaluate, benchmark.

Parse, build, run, tear down; see README.md for usage and every flag.
"""
from __future__ import annotations

import sys

from runtime.arguments import parse_args


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input: printed as one line, no traceback."""
    from runtime.arguments import UsageError
    from runtime.checkpoint import CheckpointError

    errors: list[type[BaseException]] = [UsageError, CheckpointError]
    try:
        from data_loading.dataset import DataError

        errors.append(DataError)
    except ImportError:
        pass
    return tuple(errors)


def main(argv=None) -> int:
    config = parse_args(argv)
    from runtime.app import run

    try:
        return run(config)
    except user_errors() as exc:
        print(f"main.py: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("main.py: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
