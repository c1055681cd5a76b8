"""The README's install: ``pip install -e .`` (pyproject.toml) makes ``Segmenter`` importable and
runnable from a folder outside the repository; ``segment_array`` without a spacing says what it
assumed.

The install goes into a throw-away venv under the test's temporary folder (never into the shared
``.venv``): ``--system-site-packages`` of the base interpreter, the running interpreter's own
site-packages added by a ``.pth`` file (torch, numpy, nibabel, setuptools: nothing downloaded), then
``pip install --no-deps --no-build-isolation -e .``; the segmenter runs a 1x1x1 convolution
(``Segmenter.from_network``), so the test measures the packaging, not the network.
"""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import numpy as np, torch, runtime
from runtime.predict.api import PredictOptions, Segmenter
torch.manual_seed(0)
net = torch.nn.Conv3d(1, 3, 1)
segmenter = Segmenter.from_network(net, PredictOptions(window=(128, 128, 128), device="cpu", verbose=False))
volume = np.random.default_rng(0).integers(-100, 300, (20, 24, 22)).astype(np.float32)
labels, _ = segmenter.segment_array(volume, np.diag([1.6, 1.2, 1.2, 1.0]), spacing=(1.6, 1.2, 1.2))
print("labels", labels.shape, labels.dtype, runtime.__file__)
"""


def offline_editable_build_problem() -> str:
    """Why this interpreter's setuptools cannot build an editable install without downloading
    (--no-build-isolation): it needs a bdist_wheel command, its own (setuptools 70.1 on) or the
    wheel package's; "" when it has one."""
    import importlib.util

    if importlib.util.find_spec("setuptools") is None:
        return "no setuptools here"
    if importlib.util.find_spec("setuptools.command.bdist_wheel") or importlib.util.find_spec("wheel"):
        return ""
    return "setuptools without a bdist_wheel command and no wheel package (an isolated build downloads them)"


@pytest.mark.slow
def test_pip_install_e_makes_segmenter_work_from_any_folder(tmp_path):
    if offline_editable_build_problem():
        pytest.skip("an offline editable install cannot be built here: " + offline_editable_build_problem())
    base = getattr(sys, "_base_executable", sys.executable)
    venv = tmp_path / "venv"
    subprocess.run([base, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "running_interpreter.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    outside = tmp_path / "notebooks"
    outside.mkdir()
    before = subprocess.run([python, "-c", "import runtime"], cwd=outside, env=env, capture_output=True, text=True)
    assert before.returncode != 0 and "No module named 'runtime'" in before.stderr  # the error
    install = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                              "--no-build-isolation", "--no-input", "-q", "-e", str(ROOT)],
                             env=env, capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    run = subprocess.run([python, "-c", SCRIPT], cwd=outside, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"labels (20, 24, 22) uint8 {ROOT / 'runtime' / '__init__.py'}" in run.stdout


def test_segment_array_without_spacing_says_what_it_assumed(capsys, monkeypatch):
    import torch

    from runtime.predict import api
    from runtime.predict.api import PredictOptions, Segmenter

    segmenter = Segmenter.from_network(torch.nn.Conv3d(1, 3, 1), PredictOptions(window=(128, 128, 128), device="cpu"))
    seen = []
    monkeypatch.setattr(Segmenter, "segment_raw", lambda self, raw, *a, **k: seen.append(raw.file_spacing) or
                        api.Segmentation(np.zeros(raw.file_shape, np.uint8)))
    capsys.readouterr()
    volume = np.zeros((6, 7, 8), np.float32) - 1000
    segmenter.segment_array(volume, np.eye(4))
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["array: no spacing given: [1.0, 1.0, 1.0] mm per axis assumed, the affine's voxel sizes "
                     "(give spacing= if they are not)"]
    segmenter.segment_array(volume, np.eye(4), spacing=(2.0, 1.0, 1.0))  # given: nothing said
    assert capsys.readouterr().out == "" and seen[-1] == [2.0, 1.0, 1.0]
