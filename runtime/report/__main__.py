"""``python -m runtime.report``: the command line of :mod:`runtime.report.cli`."""
import sys

from runtime.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
