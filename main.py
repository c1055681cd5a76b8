"""3D U-Net on KiTS19 (MLPerf Training image segmentation): train, evaluate, benchmark, predict.

Parse, build, run, tear down; see docs/usage.md for usage and every flag.
"""
from __future__ import annotations

import sys

from runtime.arguments import parse_args


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input: printed as one line, no traceback."""
    from runtime.arguments import UsageError
    from runtime.checkpoint import CheckpointError
    from runtime.outputs import OutputError

    errors: list[type[BaseException]] = [UsageError, CheckpointError, OutputError]
    try:
        from data_loading.dataset import DataError

        errors.append(DataError)
    except ImportError:
        pass
    return tuple(errors)


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line. An error raised in a DataLoader worker arrives with the
    worker's traceback in its message; its last line is the original message."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else type(exc).__name__
    last = lines[-1]
    prefix = f"{type(exc).__module__}.{type(exc).__name__}: "
    return last[len(prefix):] if last.startswith(prefix) else last


def main(argv=None) -> int:
    config = parse_args(argv)
    from runtime.app import run
    from runtime.signals import Stopped

    try:
        return run(config)
    except user_errors() as exc:
        print(f"main.py: error: {one_line(exc)}", file=sys.stderr)
        return 1
    except Stopped as stop:
        print(f"main.py: {stop} during --exec_mode {config.mode.name}; nothing to save", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print("main.py: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
