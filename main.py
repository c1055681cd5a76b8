"""3D U-Net on KiTS19: train, evaluate or benchmark (see README.md)."""
from __future__ import annotations

import sys

from runtime.arguments import parse_args


def main(argv=None) -> int:
    config = parse_args(argv)
    print("training is not available yet", file=sys.stderr)
    del config
    return 1


if __name__ == "__main__":
    sys.exit(main())
