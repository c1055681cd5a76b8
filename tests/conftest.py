import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_configure(config):
    # `make test` runs everything (CI); `make test-fast` deselects these with -m "not slow".
    config.addinivalue_line("markers", "slow: long end-to-end runs (torchrun, convergence, benchmark smoke runs)")
