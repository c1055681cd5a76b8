"""Every command-line program says its version (the project's one source, runtime.__version__)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime import __version__

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, prog", [(["main.py"], "main.py"), (["preprocess_dataset.py"], "preprocess_dataset.py"),
                                        (["-m", "runtime.report"], "python -m runtime.report")])
def test_version_flag(argv, prog):
    proc = subprocess.run([sys.executable, *argv, "--version"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{prog} {__version__}"


def test_licence_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
