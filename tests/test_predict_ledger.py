"""The ledger of one scan's outputs alone (``runtime.predict.ledger``), on tiny files in a
temporary folder, no network and no scan read: what it claims (fresh, reuse, refuse) with known
reasons, and what ``clear``, ``begin``, ``commit`` and ``abandon`` leave in the folder. The
oracle is the folder itself: every file's bytes before and after.
"""
import hashlib
import json
import os

import pytest

from data_loading.scans import Scan
from runtime import __version__
from runtime.predict.ledger import Claim, OutputLedger, ScanOutputs
from runtime.predict.records import CaseResult, Status, summary_texts

SCAN_BYTES = b"a scan's bytes"
RUN = {"version": __version__, "checkpoint": "/ckpt/a.pt", "weights_sha256": "a" * 64, "backend": "torch",
       "int8": False, "int8_calibration": "", "int8_calibration_set": "", "amp": "off", "tta": False,
       "window_shape": [64, 64, 64], "overlap": 0.5}


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "case.nii").write_bytes(SCAN_BYTES)
    (tmp_path / "out").mkdir()
    return tmp_path


def ledger(folder, preview=False, probabilities=False, force=False, **changes) -> OutputLedger:
    """This run's ledger of ``case`` (``changes``: this run's record fields that differ from ``RUN``)."""
    scan = Scan("case", str(folder / "in" / "case.nii"))
    outputs = ScanOutputs.of(str(folder / "out"), scan, preview, probabilities)
    return OutputLedger(outputs, {**RUN, **changes}, scan.image_path, force)


def made_before(folder, files=("case.nii.gz",), **changes) -> dict:
    """An earlier run's outputs of ``case``: ``files`` and the record listing them."""
    record = {**RUN, **changes, "input_sha256": hashlib.sha256(SCAN_BYTES).hexdigest(), "files": list(files),
              "probabilities": "case.npz" if "case.npz" in files else ""}
    for name in files:
        (folder / "out" / name).write_bytes(b"earlier " + name.encode())
    (folder / "out" / "case.provenance.json").write_text(json.dumps(record))
    return record


def contents(folder) -> dict:
    return {name: (folder / "out" / name).read_bytes() for name in sorted(os.listdir(folder / "out"))}


# ----------------------------------------------------------------------------- claim


def test_nothing_there_is_fresh_and_claiming_writes_nothing(folder):
    one = ledger(folder, preview=True, probabilities=True)
    assert one.claim() is Claim.FRESH and one.why == "" and contents(folder) == {}
    assert one.outputs.writes == tuple(str(folder / "out" / n) for n in ("case.nii.gz", "case.png", "case.npz"))


def test_an_output_of_this_configuration_is_reused_by_its_digests(folder):
    stored = made_before(folder)
    before = contents(folder)
    one = ledger(folder)
    assert one.claim() is Claim.REUSE and one.stored == stored and one.why == ""
    assert one.record["input_sha256"] == hashlib.sha256(SCAN_BYTES).hexdigest()
    assert contents(folder) == before


@pytest.mark.parametrize("changes,why", [
    ({"overlap": 0.25}, "made with overlap 0.5, not 0.25"),
    ({"window_shape": [128, 128, 128]}, "made with window_shape 64x64x64, not 128x128x128"),
    ({"version": "0.0.1"}, f"made with version {__version__}, not 0.0.1"),
])
def test_predicts_own_output_made_otherwise_is_fresh_and_says_why(folder, changes, why):
    made_before(folder)
    one = ledger(folder, **changes)
    assert one.claim() is Claim.FRESH and one.why == why


def test_another_input_or_missing_probabilities_is_fresh(folder):
    made_before(folder)
    (folder / "in" / "case.nii").write_bytes(b"another scan")
    one = ledger(folder)
    assert one.claim() is Claim.FRESH and one.why.startswith("made with input_sha256 ")
    (folder / "in" / "case.nii").write_bytes(SCAN_BYTES)
    one = ledger(folder, probabilities=True)
    assert one.claim() is Claim.FRESH and one.why == "without saved probabilities"
    assert ledger(folder, force=True).claim() is Claim.FRESH  # --force: every scan again, the same record


def test_another_models_output_is_refused_without_force(folder):
    made_before(folder, weights_sha256="b" * 64)
    one = ledger(folder)
    assert one.claim() is Claim.REFUSE and not one.foreign
    assert one.why == (f"{folder / 'out' / 'case.nii.gz'} was made by another model (weights bbbbbbbbbbbb of "
                       "/ckpt/a.pt): kept; --force replaces it")
    forced = ledger(folder, force=True)
    assert forced.claim() is Claim.FRESH and forced.why == "of another model (weights bbbbbbbbbbbb of /ckpt/a.pt)"


@pytest.mark.parametrize("flags,theirs", [({}, "case.nii.gz"), ({"force": True}, "case.nii.gz"),
                                          ({"preview": True}, "case.png"), ({"probabilities": True}, "case.npz"),
                                          ({}, "case.provenance.json")])
def test_a_file_predict_did_not_write_is_refused_and_never_touched(folder, flags, theirs):
    if theirs != "case.nii.gz":
        made_before(folder)  # a record of predict that does not list the user's file
    (folder / "out" / theirs).write_bytes(b"the user's own")
    before = contents(folder)
    one = ledger(folder, **flags)
    assert one.claim() is Claim.REFUSE and one.foreign
    assert one.why.startswith(f"{folder / 'out' / theirs} exists and ")
    assert "predict never replaces or removes it" in one.why and "\n" not in one.why
    assert contents(folder) == before


# ----------------------------------------------------------------------------- clear, begin, commit


def test_clear_removes_only_what_the_record_lists(folder):
    made_before(folder, ("case.nii.gz", "case.npz"), overlap=0.25)
    (folder / "out" / "case.png").write_bytes(b"the user's picture")   # listed by no record
    (folder / "out" / "notes.txt").write_bytes(b"the user's notes")
    one = ledger(folder)
    assert one.claim() is Claim.FRESH
    one.clear()
    assert contents(folder) == {"case.png": b"the user's picture", "notes.txt": b"the user's notes"}


def test_with_force_the_segmentation_stays_until_the_new_one_replaces_it(folder):
    made_before(folder, weights_sha256="b" * 64)
    one = ledger(folder, force=True)
    assert one.claim() is Claim.FRESH
    one.clear()
    assert contents(folder) == {"case.nii.gz": b"earlier case.nii.gz"}  # its record gone first


def test_the_record_takes_its_place_only_at_commit(folder):
    one = ledger(folder, probabilities=True)
    assert one.claim() is Claim.FRESH
    one.clear()
    one.begin()
    pending = f".case.provenance.json.{os.getpid()}.tmp"
    assert sorted(os.listdir(folder / "out")) == [pending]  # hidden: no record claims anything yet
    (folder / "out" / "case.npz").write_bytes(b"probabilities")
    (folder / "out" / "case.nii.gz").write_bytes(b"labels")
    result = one.commit(CaseResult("case", Status.SEGMENTED, one.input_path))
    assert sorted(os.listdir(folder / "out")) == ["case.nii.gz", "case.npz", "case.provenance.json"]
    written = json.loads((folder / "out" / "case.provenance.json").read_text())
    assert written == {**RUN, "input_sha256": hashlib.sha256(SCAN_BYTES).hexdigest(),
                       "files": ["case.nii.gz", "case.npz"], "probabilities": "case.npz"}
    assert result.provenance == written and result.replaced == ""
    assert ledger(folder, probabilities=True).claim() is Claim.REUSE  # what commit wrote is reused


# ----------------------------------------------------------------------------- abandon


def test_abandon_before_the_segmentation_removes_only_what_this_run_wrote(folder):
    (folder / "out" / "other.nii.gz").write_bytes(b"another scan's output")
    (folder / "out" / "case.png").write_bytes(b"the user's picture")  # no preview asked: not this run's
    one = ledger(folder, probabilities=True)
    assert one.claim() is Claim.FRESH
    one.clear()
    one.begin()
    (folder / "out" / "case.npz").write_bytes(b"probabilities")  # written before the segmentation failed
    one.abandon()
    assert contents(folder) == {"case.png": b"the user's picture", "other.nii.gz": b"another scan's output"}


def test_abandon_after_the_segmentation_keeps_the_pending_record_for_the_next_run(folder):
    made_before(folder, ("case.nii.gz", "case.png"))
    one = ledger(folder, preview=True, force=True)
    assert one.claim() is Claim.FRESH
    one.clear()   # the record and the preview go; the segmentation stays (--force)
    one.begin()
    one.abandon()  # stopped while the segmentation is rewritten
    pending = f".case.provenance.json.{os.getpid()}.tmp"
    assert sorted(os.listdir(folder / "out")) == [pending, "case.nii.gz"]
    (folder / "out" / "notes.txt").write_bytes(b"the user's notes")
    again = ledger(folder)  # the next run: the pending record vouches for the segmentation
    assert again.owned == {"case.nii.gz", "case.png"} and again.stored is None
    assert again.claim() is Claim.FRESH and again.why == "with no record of what made it"
    again.clear()
    assert contents(folder) == {"notes.txt": b"the user's notes"}


# ----------------------------------------------------------------------------- statuses


def test_statuses_are_the_summarys_words():
    assert [s.value for s in Status] == ["segmented", "skipped", "failed", "not run", "kept", "left out"]
    assert Status("not run") is Status.NOT_RUN and Status.KEPT == "kept" and f"{Status.LEFT_OUT}" == "left out"
    texts = summary_texts([CaseResult("a", Status.NOT_RUN, "a.nii", error="the output disk is full")])
    assert json.loads(texts["summary.jsonl"].splitlines()[0])["status"] == "not run"
    assert texts["summary.csv"].splitlines()[1].startswith("a,not run,")
