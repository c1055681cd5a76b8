"""The MLCommons reference (``oracles/mlcommons_reference.py``): the tests' oracle, and the ``mlcommons``
variant of ``python -m benchmarks.bench_predict``.

Everywhere: the loader imports a reference tree's packages (named ``model`` and ``runtime``, like
this project's) and leaves this project's modules in place afterwards; a tree that lacks a file
is one line; the box the reference's window scores agrees with the project's own window geometry
and with hand-worked sizes; the ``mlcommons`` child runs predict through a stand-in reference
tree (a known constant network) with the windows counted and the trimmed voxels background.

With the real code (``UNET3D_REFERENCE_CODE`` = the ``image_segmentation/pytorch`` folder of a
mlcommons/training checkout; skipped without it): the project's sliding window and network give
the reference's own outputs.
"""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import nibabel
import numpy as np
import pytest
import torch

from oracles.mlcommons_reference import (REFERENCE_FILES, ReferenceCodeError, check_reference_code, load_reference,
                                         reference_infer, trimmed_box)
from checkpoints import architecture, write_checkpoint
from data_loading.synthetic import kits_affine
from data_loading.windows import window_geometry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = (4, 8, 16, 32, 32)
REAL = os.environ.get("UNET3D_REFERENCE_CODE", "")
needs_real = pytest.mark.skipif(not REAL, reason="UNET3D_REFERENCE_CODE (a mlcommons/training "
                                "image_segmentation/pytorch folder) not set")

# A stand-in reference tree: the real files' names and import structure, a constant network
# (kidney everywhere) and a window loop that calls it once per window of the reference's grid.
STAND_IN = {
    "model/unet3d.py": """
import torch
from model.layers import KIDNEY

class Unet3D(torch.nn.Module):
    def __init__(self, in_channels, n_class, normalization, activation, weights_init_scale=1.0):
        super().__init__()
        self.filters = [4, 8, 16, 32, 32]

    def load_state_dict(self, state, strict=True):
        return None

    def forward(self, x):
        return KIDNEY.view(1, 3, 1, 1, 1).expand(x.shape[0], 3, *x.shape[2:])
""",
    "model/layers.py": "import torch\nfrom runtime.logging import mllog_event\nKIDNEY = torch.tensor([0.0, 5.0, 0.0])\n",
    "runtime/logging.py": "import dllogger as logger\n\ndef mllog_event(*args, **kwargs):\n    pass\n",
    "runtime/distributed_utils.py": "def get_rank():\n    return 0\n",
    "runtime/inference.py": """
import torch
import torch.nn.functional as F
from scipy import signal
from runtime.distributed_utils import get_rank

def sliding_window_inference(inputs, labels, roi_shape, model, overlap=0.5, mode="gaussian",
                             padding_mode="constant", padding_val=0.0, **kwargs):
    assert signal.gaussian(5, 1.0).shape == (5,)
    shape = list(inputs.shape[2:])
    strides = [int(r * (1 - overlap)) for r in roi_shape]
    cut = [s % st if s % st < st // 2 else 0 for s, st in zip(shape, strides)]
    inputs = inputs[..., cut[0] // 2: shape[0] - (cut[0] - cut[0] // 2),
                    cut[1] // 2: shape[1] - (cut[1] - cut[1] // 2), cut[2] // 2: shape[2] - (cut[2] - cut[2] // 2)]
    pad = [(st - s % st) % st for s, st in zip(inputs.shape[2:], strides)]
    pad = [p if s + p >= r else p + st for s, p, r, st in zip(inputs.shape[2:], pad, roi_shape, strides)]
    padded = F.pad(inputs, [pad[2] // 2, pad[2] - pad[2] // 2, pad[1] // 2, pad[1] - pad[1] // 2,
                            pad[0] // 2, pad[0] - pad[0] // 2], value=padding_val)
    size = [(s - r) // st + 1 for s, r, st in zip(padded.shape[2:], roi_shape, strides)]
    result = torch.zeros((1, 3, *padded.shape[2:]))
    for i in range(size[0]):
        for j in range(size[1]):
            for k in range(size[2]):
                box = (..., slice(i * strides[0], i * strides[0] + roi_shape[0]),
                       slice(j * strides[1], j * strides[1] + roi_shape[1]),
                       slice(k * strides[2], k * strides[2] + roi_shape[2]))
                result[box] = model(padded[box])
    # cropped with the untrimmed size, as the reference does (past the trimmed voxels: pad)
    return result[..., pad[0] // 2: pad[0] // 2 + shape[0], pad[1] // 2: pad[1] // 2 + shape[1],
                  pad[2] // 2: pad[2] // 2 + shape[2]], labels
""",
}


def write_stand_in(folder) -> str:
    for name, text in STAND_IN.items():
        path = os.path.join(folder, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as handle:
            handle.write(text)
    return str(folder)


def test_the_stand_in_has_every_reference_file():
    assert sorted(STAND_IN) == sorted(REFERENCE_FILES)


def test_load_reference_imports_the_given_tree_and_puts_the_project_back(tmp_path):
    import model.unet3d
    import runtime.inference.sliding_window

    before = {k: v for k, v in sys.modules.items() if k.split(".")[0] in ("model", "runtime")}
    path = list(sys.path)
    unet3d, window = load_reference(write_stand_in(tmp_path / "ref"))
    assert unet3d.__module__ == "model.unet3d" and os.path.realpath(sys.modules[unet3d.__module__].__file__) \
        == os.path.realpath(model.unet3d.__file__)  # the name is the project's module again
    assert window.__globals__["__file__"].startswith(os.path.realpath(tmp_path / "ref"))
    assert unet3d.__init__.__globals__["KIDNEY"].tolist() == [0.0, 5.0, 0.0]  # its own layers
    after = {k: v for k, v in sys.modules.items() if k.split(".")[0] in ("model", "runtime")}
    assert after == before and sys.path == path
    assert runtime.inference.sliding_window.PAD_VALUE == -2.2
    assert unet3d(1, 3, "instancenorm", "relu")(torch.zeros(2, 1, 4, 4, 4)).shape == (2, 3, 4, 4, 4)


def test_the_reference_gets_its_gaussian_and_dllogger_and_the_process_keeps_its_own(tmp_path):
    """The reference's ``signal.gaussian`` (removed in SciPy 1.13) and ``dllogger`` (not on PyPI)
    are given to the reference's modules only: ``scipy.signal`` and ``sys.modules`` are as they
    were, and the reference's window still calls its ``signal.gaussian`` (the stand-in asserts it)."""
    import scipy.signal

    gaussian_before = getattr(scipy.signal, "gaussian", None)
    dllogger_before = sys.modules.get("dllogger")
    _, window = load_reference(write_stand_in(tmp_path / "ref"))
    assert getattr(scipy.signal, "gaussian", None) is gaussian_before
    assert sys.modules.get("dllogger") is dllogger_before
    assert window.__globals__["signal"].gaussian(7, 1.5).tolist() == scipy.signal.windows.gaussian(7, 1.5).tolist()
    assert window.__globals__["signal"].windows is scipy.signal.windows  # every other name is scipy.signal's
    logits, _ = window(inputs=torch.zeros(1, 1, 8, 8, 8), labels=torch.zeros(1, 1, 8, 8, 8), roi_shape=[8] * 3,
                       model=lambda x: torch.zeros(x.shape[0], 3, *x.shape[2:]))
    assert logits.shape == (1, 3, 8, 8, 8)


def test_load_reference_puts_the_project_back_when_the_import_fails(tmp_path):
    import model.unet3d  # noqa: F401

    folder = write_stand_in(tmp_path / "ref")
    with open(os.path.join(folder, "model", "unet3d.py"), "a") as handle:
        handle.write("raise ImportError('broken reference')\n")
    modules = {k: v for k, v in sys.modules.items() if k.split(".")[0] in ("model", "runtime")}
    path = list(sys.path)
    with pytest.raises(ImportError, match="broken reference"):
        load_reference(folder)
    assert {k: v for k, v in sys.modules.items() if k.split(".")[0] in ("model", "runtime")} == modules
    assert sys.path == path


def test_reference_infer_keeps_the_trimmed_voxels_only(tmp_path):
    """An axis trimmed and then padded (20 at 32³ windows, stride 16: 4 trimmed, 16 padded to 32):
    the reference's output runs 4 voxels into its pad; only the 16 trimmed voxels are the scan's
    (the constant network's kidney), the 2 + 2 trimmed ones background; 1 x 2 x 2 windows."""
    network = SimpleNamespace(filters=list(TINY), normalization="instancenorm", activation="relu")
    window = SimpleNamespace(window=(32, 32, 32), overlap=0.5)
    infer = reference_infer(write_stand_in(tmp_path / "ref"), {}, network, window)
    probabilities = infer(np.zeros((1, 20, 40, 40), np.float32))
    kidney = torch.softmax(torch.tensor([0.0, 5.0, 0.0]), 0)
    assert probabilities.shape == (3, 20, 40, 40) and infer.windows == 4
    torch.testing.assert_close(probabilities[:, 2:18], kidney.view(3, 1, 1, 1).expand(3, 16, 40, 40))
    assert (probabilities[0, :2] == 1).all() and (probabilities[0, 18:] == 1).all()


def test_a_tree_without_a_reference_file_is_one_line(tmp_path):
    folder = write_stand_in(tmp_path / "ref")
    os.remove(os.path.join(folder, "runtime", "inference.py"))
    with pytest.raises(ReferenceCodeError) as error:
        check_reference_code(folder)
    assert "runtime/inference.py" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("size, box", [(130, slice(1, 129)), (128, slice(0, 128)), (190, slice(0, 190)),
                                       (200, slice(4, 196)), (100, slice(0, 100))])
def test_trimmed_box_known_answers(size, box):
    """Stride 64 at 128³: a remainder below 32 is cut, half before (130: 2 -> 1 and 1; 200: 8)."""
    assert trimmed_box((size, 128, 128), (128,) * 3, 0.5)[0] == box


def test_trimmed_box_is_the_project_window_trim():
    for size in range(40, 400, 7):
        shape, roi = (size, size + 3, size + 5), (128, 96, 64)
        geometry = window_geometry(shape, roi, 0.5)
        assert trimmed_box(shape, roi, 0.5) == tuple(slice(b, s - a) for s, (b, a) in zip(shape, geometry.trim))


def write_scan(path, shape=(130, 40, 36)):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = np.random.default_rng(0).integers(-100, 300, shape).astype(np.int16)
    image = nibabel.Nifti1Image(data, kits_affine((1.6, 1.6, 1.6)))  # KiTS19's layout: axis 0 the slices
    image.header.set_zooms((1.6, 1.6, 1.6))
    nibabel.save(image, path)


@pytest.mark.slow
def test_mlcommons_child_runs_predict_with_the_reference_network(tmp_path):
    """Predict's command line with the stand-in reference: every window counted, every scored voxel
    kidney (the constant network), the trimmed border background, the summary written."""
    write_scan(str(tmp_path / "in" / "scan.nii.gz"))
    ckpt = str(tmp_path / "tiny.pt")
    write_checkpoint(ckpt, architecture(TINY))
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_predict", "--child_mlcommons",
                          write_stand_in(tmp_path / "ref"), "--exec_mode", "predict", "--input", str(tmp_path / "in"),
                          "--output_dir", str(tmp_path / "out"), "--load_ckpt_path", ckpt, "--device", "cpu",
                          "--val_input_shape", "32", "32", "32", "--backend", "torch"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # preprocessed: 130 x 128 x 128 (depth kept at 1.6 mm; the short axes resampled, then padded
    # to 128); stride 16: 130 leaves 2 (below 8), cut 1 before and 1 after; 128 / 16 + 1 - 2 = 7
    # windows per axis
    rows = [json.loads(line) for line in open(tmp_path / "out" / "summary.jsonl")]
    assert [r["windows"] for r in rows if r["case"] == "scan"] == [343]
    labels = np.asarray(nibabel.load(str(tmp_path / "out" / "scan.nii.gz")).dataobj)
    assert labels.shape == (130, 40, 36)
    assert (labels[1:-1] == 1).all() and (labels[[0, -1]] == 0).all()
    assert os.path.exists(tmp_path / "out" / "summary.csv")


@pytest.mark.slow
def test_mlcommons_variant_without_reference_code_is_one_line():
    env = {k: v for k, v in os.environ.items() if k != "UNET3D_REFERENCE_CODE"}   # without it, even where set
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_predict", "--variants", "mlcommons"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0 and "needs --reference_code" in out.stderr and "Traceback" not in out.stderr


# ----------------------------------------------------------------------------- the real reference


def reference_and_project_windows(shape, roi=64):
    from checkpoints import unet
    from runtime.inference.sliding_window import sliding_window_inference

    _, reference_window = load_reference(REAL)
    model = unet(architecture(TINY)).eval()
    image = torch.from_numpy(np.random.default_rng(1).normal(0, 1, (1, 1, *shape)).astype(np.float32))
    with torch.no_grad():
        theirs, _ = reference_window(inputs=image, labels=torch.zeros_like(image), roi_shape=[roi] * 3,
                                     model=model, overlap=0.5, mode="gaussian", padding_val=-2.2)
        ours = sliding_window_inference(model, image, (roi,) * 3, 0.5)
    return theirs, ours


@needs_real
@pytest.mark.parametrize("shape", [(70, 100, 150), (64, 64, 64), (50, 130, 64)])
def test_project_sliding_window_gives_the_reference_output(shape):
    """The project's window (grid, trim, pad, Gaussian weights, normalisation) against the
    reference's own function, the same small network: axes trimmed (70, 100, 130 at stride 32),
    padded (50, 100, 150) and neither (64)."""
    theirs, ours = reference_and_project_windows(shape)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@needs_real
def test_reference_output_runs_into_its_padding_on_an_axis_trimmed_below_the_window():
    """A defect of the reference found by the test above: an axis trimmed *and* then padded (41 at
    stride 32: 9 trimmed, 32 padded to 64) is cropped back with its untrimmed size, so the output
    holds 9 voxels of pad past the trimmed volume (and no longer matches its trimmed label). The
    first 32 are the project's, which returns the trimmed size."""
    theirs, ours = reference_and_project_windows((50, 41, 64))
    assert theirs.shape[3] == 41 and ours.shape[3] == 32
    torch.testing.assert_close(ours, theirs[:, :, :, :32], rtol=1e-5, atol=1e-5)


@needs_real
def test_project_network_gives_the_reference_network_output():
    """The project's Unet3D and the reference's with the same state_dict (loaded strictly both
    ways): the same logits on a 64³ input."""
    from checkpoints import unet

    reference_unet, _ = load_reference(REAL)
    ours = unet(architecture((32, 64, 128, 256, 320)), seed=3).eval()
    theirs = reference_unet(1, 3, "instancenorm", "relu").eval()
    theirs.load_state_dict(ours.state_dict())
    x = torch.from_numpy(np.random.default_rng(2).normal(0, 1, (1, 1, 64, 64, 64)).astype(np.float32))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
