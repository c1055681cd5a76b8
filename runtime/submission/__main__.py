"""``python -m runtime.submission``: the command line of :mod:`runtime.submission.cli`."""
import sys

from runtime.submission.cli import main

if __name__ == "__main__":
    sys.exit(main())
