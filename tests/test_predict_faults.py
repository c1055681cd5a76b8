"""Predict over a folder when things go wrong: one bad scan never stops the folder, the header is
checked before any work, a full output disk names the file and keeps the summary, one run per
``--output_dir``, and a broken ``--preview`` never throws the segmentation away."""
import errno
import json
import os
import socket

import nibabel
import numpy as np
import pytest

from checkpoints import architecture, broken_checkpoint, reference_format_checkpoint, unet
from disks import fill, small_disk
from runtime.outputs import LOCK_NAME
from main_runs import predict_runner
from test_predict import write_nifti

TARGET = (1.6, 1.2, 1.2)
FILTERS = (2, 4, 4, 8, 8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A reference-format checkpoint (its architecture comes from --filters, see :func:`predict`)."""
    path = str(tmp_path_factory.mktemp("ckpt") / "tiny.pt")
    reference_format_checkpoint(path, unet(architecture(FILTERS)))
    return path


def folder_of_scans(root, spacings: dict) -> str:
    """One small scan per name, at the given spacing (mm; a zero is written into pixdim as it
    is, as a broken exporter does: nibabel would read it back as 1 mm)."""
    for i, (name, spacing) in enumerate(sorted(spacings.items())):
        image = np.random.default_rng(i).integers(-100, 300, (12, 14, 13)).astype(np.int16)
        path = os.path.join(str(root), f"{name}.nii.gz")
        if min(spacing) > 0:
            write_nifti(path, image, spacing)
            continue
        nifti = nibabel.Nifti1Image(image, np.eye(4))
        nifti.header["pixdim"][1:4] = spacing
        nibabel.save(nifti, path)
    return str(root)


predict = predict_runner("--val_input_shape", "128", "128", "128", "--filters", *map(str, FILTERS))


def rows(out) -> dict:
    return {r["case"]: r for r in map(json.loads, open(os.path.join(str(out), "summary.jsonl")))}


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.strip()]


# -------------------------------------------------------------------- one bad scan, not the folder

@pytest.mark.parametrize("spacing,said", [((1000.0, 1.2, 1.2), "not plausible"), ((0.0, 1.2, 1.2), "not positive")])
def test_a_scan_with_an_absurd_or_zero_spacing_is_refused_before_any_work(tmp_path, capsys, checkpoint,
                                                                         monkeypatch, spacing, said):
    import runtime.predict.folder as folder_module

    folder = folder_of_scans(tmp_path / "in", {"a": TARGET, "b_bad": spacing, "c": (2.0, 1.5, 1.5)})
    segmented = []
    original = folder_module.segment_scan
    monkeypatch.setattr(folder_module, "segment_scan",
                        lambda scan, *a, **k: segmented.append(scan.name) or original(scan, *a, **k))
    code, stdout, stderr = predict(capsys, folder, tmp_path / "out", checkpoint)
    assert code == 1 and "Traceback" not in stderr
    lines = error_lines(stderr)
    assert len(lines) == 1 and "b_bad.nii.gz" in lines[0] and said in lines[0], stderr
    assert segmented == ["a", "c"]                                  # the bad scan got no work at all
    summary = rows(tmp_path / "out")
    assert [(c, summary[c]["status"]) for c in ("a", "b_bad", "c")] == [("a", "segmented"), ("b_bad", "failed"),
                                                                        ("c", "segmented")]
    assert said in summary["b_bad"]["error"] and "failed scans: b_bad" in stdout
    assert f"weights: the best weights (best_model_state_dict) of {checkpoint}" in stdout   # which weights


def test_a_scan_too_large_for_memory_is_refused_with_its_size(tmp_path):
    from data_loading.scan_checks import check_header
    from data_loading.scans import ScanError

    # 40 mm voxels are plausible, but resample to 300 x 466 x 433 voxels: about 2.7 GB for predict
    path = write_nifti(str(tmp_path / "big.nii.gz"), np.zeros((12, 14, 13), np.int16), (40.0, 40.0, 40.0))
    assert check_header(path, limit=2**32).shape == (12, 14, 13)
    with pytest.raises(ScanError, match="GiB") as info:
        check_header(path, limit=2**30)
    assert "big.nii.gz" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError(
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"), ValueError("a bug inside")])
def test_any_failure_inside_one_scan_is_its_row(tmp_path, capsys, checkpoint, monkeypatch, error):
    import runtime.predict.folder as folder_module

    folder = folder_of_scans(tmp_path / "in", {"a": TARGET, "b": TARGET, "c": TARGET})
    original = folder_module.segment_scan

    def fail_on_b(scan, *args, **kwargs):
        if scan.name == "b":
            raise error
        return original(scan, *args, **kwargs)

    monkeypatch.setattr(folder_module, "segment_scan", fail_on_b)
    code, stdout, stderr = predict(capsys, folder, tmp_path / "out", checkpoint)
    assert code == 1 and "Traceback" not in stderr
    lines = error_lines(stderr)
    assert len(lines) == 1 and "b.nii.gz" in lines[0], stderr
    if not isinstance(error, ValueError):
        assert "out of memory" in lines[0]
    assert [r["status"] for c, r in sorted(rows(tmp_path / "out").items())] == ["segmented", "failed", "segmented"]


# -------------------------------------------------------------------- a full output disk

def test_a_full_output_disk_names_the_file_stops_and_keeps_the_summary_then_resumes(tmp_path, capsys, checkpoint,
                                                                                     monkeypatch):
    import data_loading.scans
    import runtime.predict.scan as predict_module

    folder = folder_of_scans(tmp_path / "in", {"a": TARGET, "b": TARGET, "c": TARGET})
    with small_disk(tmp_path / "disk", "1m") as disk:
        original = data_loading.scans.write_segmentation

        def write_then_fill(path, labels, reference):   # the disk fills up after the first output
            original(path, labels, reference)
            fill(disk)

        monkeypatch.setattr(predict_module, "write_segmentation", write_then_fill)
        code, stdout, stderr = predict(capsys, folder, disk, checkpoint)
        assert code == 1 and "Traceback" not in stderr
        lines = error_lines(stderr)
        no_space = os.strerror(errno.ENOSPC)
        assert len(lines) == 2, stderr
        assert os.path.join(disk, "b.nii.gz") in lines[0] and no_space in lines[0]
        assert "summary" in lines[1] and no_space in lines[1]       # and its rows follow on stdout
        printed = {r["case"]: r for r in map(json.loads, (l for l in stdout.splitlines() if l.startswith("{")))}
        assert [printed[c]["status"] for c in "abc"] == ["segmented", "failed", "not run"]
        assert sorted(n for n in os.listdir(disk) if n != "filler") == ["a.nii.gz",   # no partial file;
                                                                        "a.provenance.json"]   # a's record
        monkeypatch.setattr(predict_module, "write_segmentation", original)
        os.remove(os.path.join(disk, "filler"))                     # space again: run the same command
        code, stdout, stderr = predict(capsys, folder, disk, checkpoint)
        assert code == 0, stderr
        assert [rows(disk)[c]["status"] for c in "abc"] == ["skipped", "segmented", "segmented"]


# -------------------------------------------------------------------- locks, preview, refused runs

def test_a_second_predict_into_one_output_dir_is_refused(tmp_path, capsys, checkpoint):
    folder = folder_of_scans(tmp_path / "in", {"a": TARGET})
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text(f"{os.getppid()} {socket.gethostname()} now\n")   # a live process
    code, stdout, stderr = predict(capsys, folder, out, checkpoint)
    assert code == 1 and len(error_lines(stderr)) == 1 and "--output_dir" in stderr and str(out) in stderr
    assert sorted(os.listdir(out)) == [LOCK_NAME]                   # nothing computed, nothing written


def test_a_broken_matplotlib_never_throws_the_segmentation_away(tmp_path, capsys, checkpoint, monkeypatch):
    pytest.importorskip("matplotlib")
    import runtime.predict.preview

    def broken(*args, **kwargs):
        raise RuntimeError("matplotlib: broken installation (libpng missing)")

    monkeypatch.setattr(runtime.predict.preview, "render_preview", broken)
    folder = folder_of_scans(tmp_path / "in", {"a": TARGET})
    code, stdout, stderr = predict(capsys, folder, tmp_path / "out", checkpoint, "--preview")
    assert code == 1 and "Traceback" not in stderr
    lines = error_lines(stderr)
    assert len(lines) == 1 and "a.png" in lines[0] and "broken installation" in lines[0], stderr
    assert nibabel.load(str(tmp_path / "out" / "a.nii.gz")).shape == (12, 14, 13)
    assert rows(tmp_path / "out")["a"]["status"] == "segmented"


def test_a_refused_predict_leaves_no_empty_output_dir(tmp_path, capsys):
    folder = folder_of_scans(tmp_path / "in", {"a": TARGET})
    broken_checkpoint(tmp_path / "list.pt", "not_a_dict")
    code, _, stderr = predict(capsys, folder, tmp_path / "new" / "out", str(tmp_path / "list.pt"))
    assert code == 1 and len(error_lines(stderr)) == 1 and "list.pt" in stderr
    assert not os.path.exists(tmp_path / "new")


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_an_interrupted_folder_keeps_the_summary_of_what_finished(tmp_path, capsys, checkpoint, monkeypatch,
                                                                  signal_name):
    """Ctrl-C, or SIGTERM (its handler raises ``Stopped`` in the scan being segmented): the run
    stops there (never "that scan failed, on to the next"), the finished scans are summarised."""
    import runtime.predict.folder as folder_module
    from runtime.signals import Stopped

    folder = folder_of_scans(tmp_path / "in", {"a": TARGET, "b": TARGET, "c": TARGET})
    original = folder_module.segment_scan

    def interrupt_on_b(scan, *args, **kwargs):
        if scan.name == "b":
            raise KeyboardInterrupt if signal_name == "SIGINT" else Stopped("SIGTERM", 15)
        return original(scan, *args, **kwargs)

    monkeypatch.setattr(folder_module, "segment_scan", interrupt_on_b)
    code, _, stderr = predict(capsys, folder, tmp_path / "out", checkpoint)
    assert code == (130 if signal_name == "SIGINT" else 143) and "Traceback" not in stderr
    assert [(c, r["status"]) for c, r in rows(tmp_path / "out").items()] == [("a", "segmented")]
    assert not os.path.exists(tmp_path / "out" / "c.nii.gz")
    assert not os.path.exists(tmp_path / "out" / LOCK_NAME)
