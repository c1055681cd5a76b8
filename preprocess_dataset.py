"""KiTS19 NIfTI -> numpy preprocessing (filled in by the preprocessing issue)."""
import sys

if __name__ == "__main__":
    print("preprocess_dataset.py: not implemented yet", file=sys.stderr)
    sys.exit(1)
