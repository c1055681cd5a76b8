"""The code runs on Python 3.10, the HPC site's interpreter, though the suite may run on a newer one.

vermin reads the source and reports the lowest Python that each syntax construct and standard
library name needs; ``--target=3.10-`` fails when anything needs more than 3.10. The check is
shown to fail on 3.11-only constructs and to pass a 3.10 one, so it cannot pass by doing nothing.
"""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["main.py", "preprocess_dataset.py", "data_loading", "model", "runtime", "benchmarks",
           "scripts", "tests"]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vermin") is None,
                                reason="vermin not installed (pip install -r requirements-test.txt)")


def vermin(*paths: str) -> subprocess.CompletedProcess:
    """vermin's verdict on ``paths`` for Python 3.10 and older (exit 0 = every line runs there)."""
    return subprocess.run([sys.executable, "-c", "import sys; from vermin import main; sys.exit(main())",
                           "--target=3.10-", "--violations", "--no-tips", *paths],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_project_code_runs_on_python_3_10():
    result = vermin(*SOURCES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Minimum required versions" in result.stdout      # it analysed files, not nothing


@pytest.mark.parametrize("snippet, needs", [
    ("try:\n    pass\nexcept* ValueError:\n    pass\n", "`except*` requires !2, 3.11"),
    ("import tomllib\n", "'tomllib' module requires !2, 3.11"),
    ("from typing import Self\n", "'typing.Self' member requires !2, 3.11"),
])
def test_check_fails_on_a_3_11_construct(tmp_path, snippet, needs):
    (tmp_path / "new.py").write_text(snippet)
    result = vermin(str(tmp_path / "new.py"))
    assert result.returncode != 0 and needs in result.stdout, result.stdout + result.stderr


def test_check_passes_a_3_10_construct(tmp_path):
    (tmp_path / "ok.py").write_text("def f(x):\n    match x:\n        case 1:\n            return 2\n")
    result = vermin(str(tmp_path / "ok.py"))
    assert result.returncode == 0, result.stdout + result.stderr
