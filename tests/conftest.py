import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# tests/deploy/ starts a real SLURM cluster and builds container images (root, minutes, the
# package registries): `make test-deploy` runs it, `make test` does not collect it.
collect_ignore = [] if os.environ.get("UNET3D_DEPLOY_TESTS") == "1" else ["deploy"]


def pytest_configure(config):
    # `make test` deselects these (-m "not slow"), `make test-slow` runs only these; CI runs both.
    config.addinivalue_line("markers", "slow: long end-to-end runs (torchrun, convergence, benchmark smoke runs, "
                            "trainings that no other test shares): `make test-slow`, not `make test`")


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    """main.py training runs shared by the tests that read them (tests/main_runs.py, SharedRuns):
    ``shared_runs.run(argv, capsys)`` runs ``argv`` once per session."""
    from main_runs import SharedRuns

    return SharedRuns(tmp_path_factory.mktemp("shared_runs"))


@pytest.fixture
def configs_built(monkeypatch):
    """How many Configs were built (a ``dataclasses.replace`` of one builds one) since it was reset."""
    from runtime.config import Config

    built = []
    original = Config.__init__

    def counted(self, *args, **kwargs):
        built.append(kwargs)
        original(self, *args, **kwargs)
    monkeypatch.setattr(Config, "__init__", counted)
    return built
