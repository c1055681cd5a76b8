"""Predict writes only what it owns: an output never replaces or removes an input scan (any file
of it: ``os.path.samefile``) nor a file that no record of predict says it wrote.

Tried as a researcher would: scans written by nibabel and by SimpleITK, predicted into their
own folder (the folder itself, ``.`` inside it, a single file's folder), again, and with
``--force``; every file that was there is hashed before and after (the oracle: its bytes).
Predict's own outputs are vouched for by their record's ``files``; a user's ``<case>.png``,
``<case>.npz``, a segmentation-named copy of a scan, a JSON file where the record would go, or a
``summary.csv`` of their own each stop only what would touch them, in one line naming the file.
"""
import hashlib
import json
import os

import nibabel
import numpy as np
import pytest

from test_predict import write_nifti
from test_predict_provenance import SMALL, SPACING, cheap_network, install_cheap_network, predict, record, scan_folder, trained_on  # noqa: F401


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return trained_on(tmp_path_factory.mktemp("ckpt") / "a.pt", (128,) * 3, filters=SMALL, normalization="batchnorm")


def hashes(folder) -> dict:
    """sha256 of every file under ``folder``, by relative path."""
    found = {}
    for root, _, files in os.walk(str(folder)):
        for name in files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, str(folder))] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return found


def unchanged(before: dict, after: dict) -> bool:
    return all(after.get(name) == digest for name, digest in before.items())


def ct(seed=0, shape=(20, 24, 22)):
    return np.random.default_rng(seed).integers(-100, 300, shape).astype(np.int16)


def write_scans(writer, folder):
    """``a.nii.gz`` (a name predict writes) and ``b`` in another format, both by ``writer``."""
    os.makedirs(folder, exist_ok=True)
    if writer == "nibabel":
        write_nifti(os.path.join(folder, "a.nii.gz"), ct(0), SPACING)
        nibabel.save(nibabel.Nifti1Image(ct(1), np.diag([*SPACING, 1.0])), os.path.join(folder, "b.nii"))
        return "b.nii"
    sitk = pytest.importorskip("SimpleITK")
    for name, seed in (("a.nii.gz", 0), ("b.mha", 1)):
        image = sitk.GetImageFromArray(ct(seed))
        image.SetSpacing(SPACING[::-1])
        sitk.WriteImage(image, os.path.join(folder, name))
    return "b.mha"


def one_line(code, stderr, *named):
    return code == 1 and stderr.count("\n") == 1 and "Traceback" not in stderr and all(n in stderr for n in named)


@pytest.mark.parametrize("writer", ["nibabel", "simpleitk"])
def test_predicting_into_the_scans_own_folder_leaves_every_file_there_as_it_was(tmp_path, capsys, monkeypatch,
                                                                                 checkpoint, cheap_network, writer):
    folder = str(tmp_path / "scans")
    other = write_scans(writer, folder)
    with open(os.path.join(folder, "b.png"), "wb") as handle:  # the user's own files under predict's names
        handle.write(b"the user's picture")
    with open(os.path.join(folder, "b.npz"), "wb") as handle:
        handle.write(b"the user's arrays")
    before = hashes(folder)
    a = os.path.join(folder, "a.nii.gz")
    # the folder into itself, "." inside it, a single file into its folder: a.nii.gz would be
    # the input a.nii.gz; refused before any work, with --force too
    monkeypatch.chdir(folder)
    for given, out in ((folder, folder), (folder, "."), (".", "."), (a, folder), ("a.nii.gz", ".")):
        for extra in ([], ["--force"]):
            code, _, stderr = predict(capsys, given, out, checkpoint, *extra)
            assert one_line(code, stderr, "a.nii.gz", "input"), (given, out, extra, stderr)
            assert hashes(folder) == before, (given, out, extra)
    # the other scan alone into its folder: segmented beside it as b.nii.gz; again (reused) and
    # with --force (redone): the files that were there never change
    for extra, says in (([], "1 segmented"), ([], "1 skipped"), (["--force"], "1 segmented")):
        code, stdout, stderr = predict(capsys, os.path.join(folder, other), ".", checkpoint, *extra)
        assert code == 0 and says in stdout, (extra, stderr)
        assert unchanged(before, hashes(folder)), extra
    assert set(hashes(folder)) - set(before) == {"b.nii.gz", "b.provenance.json", "summary.csv", "summary.jsonl"}
    assert record(folder, "b")["files"] == ["b.nii.gz"]
    # a preview or probabilities would replace the user's b.png / b.npz: that scan is refused
    for flag, name in (("--preview", "b.png"), ("--save_probabilities", "b.npz")):
        code, _, stderr = predict(capsys, os.path.join(folder, other), ".", checkpoint, "--force", flag)
        assert one_line(code, stderr, os.path.join(".", name), "no record"), (flag, stderr)
        assert unchanged(before, hashes(folder)), flag
    # the segmentation written there is no scan to the next run over the folder (its record says
    # so), and a.nii.gz still refuses that run
    code, _, stderr = predict(capsys, folder, tmp_path / "elsewhere", checkpoint)
    assert code == 0, stderr
    assert sorted(f for f in os.listdir(tmp_path / "elsewhere") if f.endswith(".nii.gz")) == ["a.nii.gz", "b.nii.gz"]
    assert unchanged(before, hashes(folder))


def test_an_output_that_no_record_vouches_for_is_never_replaced(tmp_path, capsys, checkpoint, cheap_network):
    """A copy of the scan named like its segmentation, with no record beside it (with --force
    too), or a JSON file of the user where the record goes: that scan fails in one line naming
    the file, the file keeps its bytes, the other scans are segmented."""
    folder = scan_folder(tmp_path / "in", ("scan", "other"))
    out = tmp_path / "out"
    out.mkdir()
    copy = out / "scan.nii.gz"
    copy.write_bytes(open(os.path.join(folder, "scan.nii.gz"), "rb").read())
    for extra in ([], ["--force"]):
        code, stdout, stderr = predict(capsys, folder, out, checkpoint, *extra)
        assert one_line(code, stderr, str(copy), "no record"), stderr
        assert "1 segmented" in stdout or "1 skipped" in stdout
        assert copy.read_bytes() == open(os.path.join(folder, "scan.nii.gz"), "rb").read()
        assert not (out / "scan.provenance.json").exists()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "scan.provenance.json").write_text('{"note": "my own"}')
    code, _, stderr = predict(capsys, folder, theirs, checkpoint, "--force")
    assert one_line(code, stderr, str(theirs / "scan.provenance.json"), "no record of this project"), stderr
    assert (theirs / "scan.provenance.json").read_text() == '{"note": "my own"}'
    assert not (theirs / "scan.nii.gz").exists() and (theirs / "other.nii.gz").exists()


def test_only_the_files_a_record_lists_are_removed(tmp_path, capsys, checkpoint, cheap_network):
    """Its own preview and probabilities go when a scan is redone without them; the user's
    ``<case>.png`` beside a segmentation whose record does not list it stays."""
    pytest.importorskip("matplotlib")
    folder = scan_folder(tmp_path / "in")
    out = tmp_path / "out"
    code, _, stderr = predict(capsys, folder, out, checkpoint, "--preview", "--save_probabilities")
    assert code == 0, stderr
    assert record(out)["files"] == ["scan.nii.gz", "scan.png", "scan.npz"]
    assert predict(capsys, folder, out, checkpoint, "--force")[0] == 0
    assert sorted(os.listdir(out)) == ["scan.nii.gz", "scan.provenance.json", "summary.csv", "summary.jsonl"]
    (out / "scan.png").write_bytes(b"mine")
    (out / "scan.npz").write_bytes(b"mine too")
    assert predict(capsys, folder, out, checkpoint, "--force")[0] == 0
    assert (out / "scan.png").read_bytes() == b"mine" and (out / "scan.npz").read_bytes() == b"mine too"


def test_a_summary_of_someone_else_refuses_the_run(tmp_path, capsys, checkpoint, cheap_network):
    folder = scan_folder(tmp_path / "in")
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.csv").write_text("patient,volume\n1,2\n")
    code, _, stderr = predict(capsys, folder, out, checkpoint)
    assert one_line(code, stderr, str(out / "summary.csv")), stderr
    assert (out / "summary.csv").read_text() == "patient,volume\n1,2\n" and not (out / "scan.nii.gz").exists()
    os.remove(out / "summary.csv")
    assert predict(capsys, folder, out, checkpoint)[0] == 0
    assert predict(capsys, folder, out, checkpoint, "--force")[0] == 0  # its own summary is replaced
    assert json.loads(open(out / "summary.jsonl").readline())["case"] == "scan"


@pytest.mark.parametrize("when", ["writing", "preview"])
def test_a_run_stopped_mid_scan_leaves_outputs_the_next_run_may_redo(tmp_path, capsys, monkeypatch, checkpoint,
                                                                    cheap_network, when):
    """A signal while ``--force`` rewrites a scan (before its segmentation is replaced: the old
    one stays, its record gone) or after the new segmentation is written (while the preview is
    drawn, before the record takes its place): the pending record stays beside it, hidden, so the
    next run knows those files as predict's and segments the scan again, leaving no hidden file."""
    import runtime.predict.scan as scan_module
    from runtime.signals import Stopped

    pytest.importorskip("matplotlib")
    folder = scan_folder(tmp_path / "in")
    out = tmp_path / "out"
    assert predict(capsys, folder, out, checkpoint, "--preview")[0] == 0

    def stop(*args, **kwargs):
        raise Stopped("SIGTERM", 15)

    monkeypatch.setattr(scan_module, "write_segmentation" if when == "writing" else "draw_preview", stop)
    code, _, _ = predict(capsys, folder, out, checkpoint, "--force", "--preview")
    assert code == 128 + 15
    assert (out / "scan.nii.gz").exists() and not (out / "scan.provenance.json").exists()
    assert [f for f in os.listdir(out) if f.endswith(".tmp")]  # the pending record, kept
    monkeypatch.undo()
    install_cheap_network(monkeypatch)  # monkeypatch.undo removed it
    code, stdout, stderr = predict(capsys, folder, out, checkpoint, "--preview")
    assert code == 0 and "1 segmented" in stdout, stderr
    assert sorted(os.listdir(out)) == ["scan.nii.gz", "scan.png", "scan.provenance.json", "summary.csv",
                                       "summary.jsonl"]
