"""The code runs on Python 3.10, the HPC site's interpreter, though the suite may run on a newer one.

vermin reads the source and reports the lowest Python that each syntax construct and standard
library name needs; ``--target=3.10-`` fails when anything needs more than 3.10. vermin parses
with the running interpreter, so under 3.10 a 3.11-only construct such as ``except*`` is a syntax
error that vermin reports with exit 0: the check therefore also compiles every file with the
running interpreter, which on 3.10 is the site's own verdict. The check is shown to fail on
3.11-only constructs and to pass a 3.10 one, so it cannot pass by doing nothing.
"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["main.py", "preprocess_dataset.py", "data_loading", "model", "runtime", "benchmarks", "oracles",
           "scripts", "tests"]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vermin") is None,
                                reason="vermin not installed (pip install -r requirements-test.txt)")


def vermin(*paths: str) -> subprocess.CompletedProcess:
    """vermin's verdict on ``paths`` for Python 3.10 and older (exit 0 = every line runs there)."""
    return subprocess.run([sys.executable, "-c", "import sys; from vermin import main; sys.exit(main())",
                           "--target=3.10-", "--violations", "--no-tips", *paths],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def syntax_errors(*paths: str) -> list[str]:
    """Each ``.py`` file under ``paths`` that the running interpreter cannot compile, with why."""
    files = [f for p in paths for f in ([Path(ROOT, p)] if p.endswith(".py") else
                                        sorted(Path(ROOT, p).rglob("*.py")))]
    errors = []
    for file in files:
        try:
            compile(file.read_text(encoding="utf-8"), str(file), "exec", dont_inherit=True)
        except SyntaxError as exc:
            errors.append(f"{file}:{exc.lineno}: SyntaxError on Python "
                          f"{sys.version_info.major}.{sys.version_info.minor}: {exc.msg}")
    return errors


def check_python_3_10(*paths: str) -> tuple[bool, str]:
    """vermin's verdict and this interpreter's compile, together: (passes, the report)."""
    result, errors = vermin(*paths), syntax_errors(*paths)
    return result.returncode == 0 and not errors, "\n".join([result.stdout, result.stderr, *errors])


def test_project_code_runs_on_python_3_10():
    ok, report = check_python_3_10(*SOURCES)
    assert ok, report
    assert "Minimum required versions" in report      # it analysed files, not nothing


@pytest.mark.parametrize("snippet, needs", [
    ("try:\n    pass\nexcept* ValueError:\n    pass\n", "`except*` requires !2, 3.11"),
    ("import tomllib\n", "'tomllib' module requires !2, 3.11"),
    ("from typing import Self\n", "'typing.Self' member requires !2, 3.11"),
])
def test_check_fails_on_a_3_11_construct(tmp_path, snippet, needs):
    (tmp_path / "new.py").write_text(snippet)
    ok, report = check_python_3_10(str(tmp_path / "new.py"))
    try:
        compile(snippet, "new.py", "exec", dont_inherit=True)
        parses_here = True
    except SyntaxError:  # Python 3.10 itself refuses it: its compile is the verdict
        parses_here, needs = False, "SyntaxError on Python"
    assert not ok and needs in report, report
    assert parses_here or sys.version_info < (3, 11)


def test_check_passes_a_3_10_construct(tmp_path):
    (tmp_path / "ok.py").write_text("def f(x):\n    match x:\n        case 1:\n            return 2\n")
    ok, report = check_python_3_10(str(tmp_path / "ok.py"))
    assert ok, report
