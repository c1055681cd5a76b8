"""Full and read-only disks at every writer: one line naming the file and the reason, nothing
earlier lost, no temporary file left. The disks are real: a small tmpfs (tests/disks.py)."""
import errno
import os
import shutil

import numpy as np
import pytest
import torch

import fake_data
from checkpoints import architecture, write_checkpoint
from data_loading.atomic import atomic_write
from disks import fill, read_only, small_disk
from main_runs import TINY, TRAINED, call, call_main, one_line_error, used_in
from runtime.checkpoint import atomic_save, load_checkpoint, model_state_from
from runtime.outputs import OutputError, RunLock

NO_SPACE = os.strerror(errno.ENOSPC)
READ_ONLY = os.strerror(errno.EROFS)


# -------------------------------------------------------------------- the classifier

@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT])
def test_write_failure_names_the_reason(number):
    from data_loading.write_errors import is_full_disk, write_failure

    assert write_failure(OSError(number, os.strerror(number))) == os.strerror(number)
    try:  # torch's zip writer: its RuntimeError raised while handling the OSError
        try:
            raise OSError(number, os.strerror(number))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as wrapped:
        assert write_failure(wrapped) == os.strerror(number)
    assert is_full_disk(OSError(number, "")) == (number in (errno.ENOSPC, errno.EDQUOT))


def test_a_bug_is_no_write_failure():
    from data_loading.write_errors import write_failure

    assert write_failure(ValueError("bad value")) is None
    assert write_failure(RuntimeError("shape mismatch")) is None


def test_torch_save_and_np_save_on_a_full_disk(tmp_path):
    """The real errors, both explained: torch's wrapped RuntimeError and numpy's short write
    (an OSError without errno, probed for the reason)."""
    from data_loading.write_errors import write_failure

    with small_disk(tmp_path / "disk", "256k") as disk:
        with pytest.raises(Exception) as saved:
            atomic_save({"w": torch.zeros(200_000)}, os.path.join(disk, "c.pt"))
        assert write_failure(saved.value) == NO_SPACE
        with pytest.raises(OSError) as written:
            atomic_write(os.path.join(disk, "x.npy"), lambda h: np.save(h, np.zeros(200_000, np.float32)))
        assert written.value.errno == errno.ENOSPC
        assert os.listdir(disk) == []                              # no temporary file left


def test_append_is_all_or_nothing(tmp_path):
    from data_loading.write_errors import append_bytes

    with small_disk(tmp_path / "disk", "8k") as disk:
        path = os.path.join(disk, "log.json")
        append_bytes(path, b'{"a": 1}\n')
        with pytest.raises(OSError) as info:
            append_bytes(path, b"x" * 100_000 + b"\n")
        assert info.value.errno == errno.ENOSPC
        assert open(path, "rb").read() == b'{"a": 1}\n'              # cut back to the last whole line


# -------------------------------------------------------------------- checkpoints

def _fill_after_reporters(monkeypatch, folder, leave: int = 0):
    """The disk of ``folder`` fills up (to ``leave`` bytes) once the run has opened its logs
    (after the lock and the up-front checks), so that the first write after that fails."""
    import runtime.clocked.start as start

    original = start.make_reporters

    def make_then_fill(*args, **kwargs):
        reporters = original(*args, **kwargs)
        fill(folder, leave=leave)
        return reporters

    monkeypatch.setattr(start, "make_reporters", make_then_fill)


def _train_argv(tmp_path, ckpt, *extra):
    return TINY + ["--log_dir", str(tmp_path / "logs"), "--save_ckpt_path", str(ckpt), *extra]


# "full": nothing left, the OSError of the last flush comes out of torch.save; "nearly_full": a
# page left, torch.save raises its zip writer's RuntimeError("unexpected pos ...") around it
@pytest.mark.parametrize("fault", ["full", "nearly_full", "read_only"])
def test_final_checkpoint_on_a_full_or_read_only_disk(tmp_path, capsys, monkeypatch, fault):
    with small_disk(tmp_path / "disk", "2m") as disk:
        ckpt = os.path.join(disk, "c.pt")
        argv = _train_argv(tmp_path, ckpt, "--start_eval_at", "1", "--evaluate_every", "1")
        assert call(argv + ["--epochs", "1"], capsys, fake_data.FakeData())[0] == 0
        before = open(ckpt, "rb").read()
        if fault != "read_only":   # the disk fills while the run trains
            _fill_after_reporters(monkeypatch, disk, leave=4096 if fault == "nearly_full" else 0)
        else:
            read_only(disk)
        code, out, err = call_main(argv + ["--epochs", "2", "--resume"], capsys, fake_data.FakeData())
        if fault == "read_only":   # found before any work: the path is checked up front
            one_line_error(code, err, "--save_ckpt_path", ckpt, READ_ONLY)
        else:
            one_line_error(code, err, ckpt, NO_SPACE, "previous one is unchanged")
            assert "epoch 2/2" in out
        assert open(ckpt, "rb").read() == before                     # the previous checkpoint is intact
        assert [n for n in os.listdir(disk) if n.endswith(".tmp")] == []


def test_a_full_disk_before_the_run_is_found_by_the_checkpoint_lock(tmp_path, capsys):
    with small_disk(tmp_path / "disk", "1m") as disk:
        fill(disk)
        ckpt = os.path.join(disk, "c.pt")
        code, out, err = call_main(_train_argv(tmp_path, ckpt, "--epochs", "1"), capsys, fake_data.FakeData())
        one_line_error(code, err, "--save_ckpt_path", ckpt, NO_SPACE)
        assert "epoch" not in out


@pytest.mark.parametrize("leave", [0, 4096])
def test_periodic_checkpoint_on_a_full_disk_warns_once_and_goes_on(tmp_path, capsys, monkeypatch, leave):
    with small_disk(tmp_path / "disk", "1m") as disk:
        _fill_after_reporters(monkeypatch, disk, leave)
        ckpt = os.path.join(disk, "c.pt")
        argv = _train_argv(tmp_path, ckpt, "--start_eval_at", "10", "--ckpt_every_epochs", "1", "--epochs", "3",
                           "--ckpt_every_minutes", "0")
        code, out, err = call_main(argv, capsys, fake_data.FakeData())
        warnings = [line for line in out.splitlines() if line.startswith("warning: cannot write the periodic")]
        assert len(warnings) == 1 and NO_SPACE in warnings[0] and ckpt in warnings[0], out
        assert "epoch 3/3" in out                                    # training went on
        one_line_error(code, err, ckpt, NO_SPACE)                    # the final save may not fail
        assert not os.path.exists(ckpt) and [n for n in os.listdir(disk) if n != "filler"] == []


# -------------------------------------------------------------------- logs

def test_mlperf_log_on_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch):
    """The MLPerf log's first event fails: one line, and closing the log raises nothing more."""
    with small_disk(tmp_path / "disk", "1m") as disk:
        _fill_after_reporters(monkeypatch, disk)
        argv = TINY + ["--log_dir", disk, "--epochs", "1", "--start_eval_at", "1"]
        code, out, err = call_main(argv, capsys, fake_data.FakeData())
        one_line_error(code, err, "MLPerf log", os.path.join(disk, "unet3d.log"), NO_SPACE)
        assert not os.path.exists(os.path.join(disk, ".unet3d.lock"))   # released


def test_log_json_on_a_full_disk_is_one_line_and_the_scores_are_printed(tmp_path, capsys, monkeypatch, shared_runs):
    with small_disk(tmp_path / "disk", "1m") as disk:
        run = shared_runs.run(TRAINED, capsys)
        assert run.code == 0
        _fill_after_reporters(monkeypatch, disk)
        argv = used_in("evaluate", TINY) + ["--exec_mode", "evaluate", "--load_ckpt_path", str(run.folder / "c.pt"),
                                            "--log_dir", disk]
        code, out, err = call_main(argv, capsys, fake_data.FakeData())
        one_line_error(code, err, os.path.join(disk, "log.json"), NO_SPACE)
        assert out.startswith("mean_dice ")                          # nothing computed is lost


def test_lock_on_a_full_disk_is_one_line(tmp_path):
    with small_disk(tmp_path / "disk", "64k") as disk:
        fill(disk)
        with pytest.raises(OutputError) as info:
            RunLock(disk).acquire()
        assert NO_SPACE in str(info.value) and "\n" not in str(info.value)
        assert [n for n in os.listdir(disk) if n != "filler"] == []


# -------------------------------------------------------------------- preprocessing

def test_preprocessing_on_a_full_disk_names_the_file_and_the_reason(tmp_path, capsys):
    import preprocess_dataset
    from data_loading.synthetic import MARKER_NAME, generate

    raw = tmp_path / "raw"
    generate(str(raw), cases=1, seed=0, size="small")
    with small_disk(tmp_path / "disk", "4m") as disk:               # a 128^3 float32 image is 8 MiB
        code = preprocess_dataset.main(["--data_dir", str(raw), "--results_dir", disk, "--num_workers", "1"])
        _, err = capsys.readouterr()
        one_line_error(code, err, os.path.join(disk, "case_00000_x.npy"), NO_SPACE, "free space")
        # no temporary file left; the synthetic marker is carried first, so that whatever lands in
        # the folder is known not to be KiTS19 (runtime.division)
        assert os.listdir(disk) == [MARKER_NAME]


def test_preprocessing_into_a_read_only_folder(tmp_path, capsys):
    import preprocess_dataset
    from data_loading.synthetic import generate

    raw = tmp_path / "raw"
    generate(str(raw), cases=1, seed=0, size="small")
    with small_disk(tmp_path / "disk", "1m") as disk:
        read_only(disk)
        code = preprocess_dataset.main(["--data_dir", str(raw), "--results_dir", disk, "--num_workers", "1"])
        _, err = capsys.readouterr()
        one_line_error(code, err, disk, READ_ONLY)


def test_a_failed_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    """A checkpoint written before the disk filled still loads after a failed save over it."""
    config = architecture((2, 4, 4, 8, 8))
    with small_disk(tmp_path / "disk", "1m") as disk:
        path = os.path.join(disk, "w.pt")
        first = write_checkpoint(path, config, seed=0)
        fill(disk)
        with pytest.raises(Exception):
            write_checkpoint(path, config, seed=1)
        shutil.copy(path, tmp_path / "copy.pt")
    kept = model_state_from(load_checkpoint(str(tmp_path / "copy.pt")))
    assert all(torch.equal(kept[key], value) for key, value in first.state_dict().items())


# -------------------------------------------------------------------- the report

@pytest.mark.parametrize("fault", ["full", "read_only"])
def test_report_on_a_full_or_read_only_disk_names_the_file(tmp_path, capsys, fault, shared_runs):
    from runtime.report import cli as report

    run = shared_runs.run(TRAINED, capsys)
    assert run.code == 0
    with small_disk(tmp_path / "disk", "256k") as disk:
        if fault == "full":
            fill(disk)
        else:
            read_only(disk)
        code = report.main([str(run.folder / "l"), "--output", disk, "--no_compliance", "--no_curves"])
        _, err = capsys.readouterr()
        one_line_error(code, err, os.path.join(disk, "summary.md"), NO_SPACE if fault == "full" else READ_ONLY)
        assert [n for n in os.listdir(disk) if n != "filler"] == []
