"""Never lose a run: every kind of bad input or fault is one line, named, with a
non-zero exit and nothing earlier lost. docs/reliability.md lists them with what a user sees."""
import errno
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import easy_data
import fake_data
from checkpoints import (architecture, broken_checkpoint, format_1, reference_format, reference_format_checkpoint,
                         unet, write_checkpoint)
from main_runs import EVAL_SMALL, SMALL, TINY, TRAINED, call, one_line_error, used_in
from runtime.checkpoint import load_checkpoint
from runtime.outputs import LOCK_NAME, RunLock, keep_previous

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_FILTERS = tuple(int(width) for width in SMALL[SMALL.index("--filters") + 1:][:5])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return easy_data.write_dataset(str(tmp_path_factory.mktemp("easy") / "data"), range(13))


# -------------------------------------------------------------------- outputs checked up front

@pytest.mark.parametrize("kind", ["ckpt_is_dir", "ckpt_under_file", "log_is_file", "log_under_file", "log_unwritable"])
def test_bad_output_paths_fail_before_anything_runs(data, tmp_path, capsys, kind):
    afile = tmp_path / "afile"
    afile.write_text("x")
    log_dir, ckpt = tmp_path / "logs", tmp_path / "c.pt"
    culprit = {"ckpt_is_dir": tmp_path, "ckpt_under_file": afile / "c.pt", "log_is_file": afile,
               "log_under_file": afile / "logs", "log_unwritable": "/proc/unet3d-logs"}[kind]
    if kind.startswith("ckpt"):
        ckpt = culprit
    else:
        log_dir = culprit
    start = time.time()
    code, out, err = call(["--data_dir", data, "--log_dir", str(log_dir), "--save_ckpt_path", str(ckpt),
                           "--epochs", "50", *SMALL], capsys)
    assert code == 1 and time.time() - start < 30
    one_line_error(code, err, culprit)
    assert "epoch" not in out and not os.path.exists(tmp_path / "logs" / "unet3d.log")


def test_evaluate_with_unwritable_log_dir_fails_before_evaluating(data, tmp_path, capsys):
    write_checkpoint(tmp_path / "w.pt", architecture(SMALL_FILTERS))
    code, out, err = call(["--exec_mode", "evaluate", "--data_dir", data, "--load_ckpt_path", str(tmp_path / "w.pt"),
                           "--log_dir", "/proc/unet3d-logs", *EVAL_SMALL], capsys)
    one_line_error(code, err, "--log_dir", "/proc/unet3d-logs")
    assert "mean_dice" not in out


# -------------------------------------------------------------------- checkpoints

def test_periodic_checkpoint_then_crash_resumes_bit_exact(tmp_path, capsys, monkeypatch):
    """A crash before the first evaluation: the periodic checkpoint of epoch 2 resumes to the
    same weights as a run never interrupted."""
    common = TINY + ["--start_eval_at", "10", "--evaluate_every", "1", "--ckpt_every_epochs", "1",
                     "--ckpt_every_minutes", "0"]
    full = common + ["--epochs", "3", "--log_dir", str(tmp_path / "full"), "--save_ckpt_path", str(tmp_path / "full.pt")]
    assert call(full, capsys, fake_data.FakeData())[0] == 0
    import runtime.training.loop as training

    original = training.train_epoch

    def crash_in_epoch_3(components, out, epoch):
        if epoch == 3:
            raise RuntimeError("simulated crash (out-of-memory kill)")
        return original(components, out, epoch)

    part = common + ["--epochs", "3", "--log_dir", str(tmp_path / "part"), "--save_ckpt_path", str(tmp_path / "part.pt")]
    monkeypatch.setattr(training, "train_epoch", crash_in_epoch_3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        call(part, capsys, fake_data.FakeData())
    saved = load_checkpoint(str(tmp_path / "part.pt"))
    assert saved["status"] == "running" and saved["epoch"] == 2
    monkeypatch.setattr(training, "train_epoch", original)
    code, out, _ = call(part + ["--resume"], capsys, fake_data.FakeData())
    assert code == 0 and "resuming" in out
    a = load_checkpoint(str(tmp_path / "full.pt"))["last_model_state_dict"]
    b = load_checkpoint(str(tmp_path / "part.pt"))["last_model_state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_periodic_save_due():
    from runtime.training.loop import periodic_save_due

    assert periodic_save_due(3, 0.0, 3, 0) and not periodic_save_due(2, 0.0, 3, 0)
    assert periodic_save_due(1, 30.0, 0, 30) and not periodic_save_due(1, 29.9, 0, 30)
    assert not periodic_save_due(100, 1e6, 0, 0)              # both off


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_at_the_final_checkpoint(tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "c.pt"
    argv = TINY + ["--start_eval_at", "1", "--evaluate_every", "1", "--log_dir", str(tmp_path / "l"),
                   "--save_ckpt_path", str(ckpt)]
    assert call(argv + ["--epochs", "1"], capsys, fake_data.FakeData())[0] == 0
    before = ckpt.read_bytes()
    monkeypatch.setattr(torch, "save", _enospc)
    with pytest.raises(Exception) as info:
        call(argv + ["--epochs", "2", "--resume"], capsys, fake_data.FakeData())
    assert "No space left on device" in str(info.value) and str(ckpt) in str(info.value)
    assert "\n" not in str(info.value)
    assert ckpt.read_bytes() == before                         # the previous checkpoint is intact
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_full_disk_at_a_periodic_checkpoint_goes_on(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch, "save", _enospc)
    argv = TINY + ["--start_eval_at", "10", "--ckpt_every_epochs", "1", "--epochs", "3",
                   "--log_dir", str(tmp_path / "l"), "--save_ckpt_path", str(tmp_path / "c.pt")]
    with pytest.raises(Exception, match="No space left"):     # the final save may not fail
        call(argv, capsys, fake_data.FakeData())
    out = capsys.readouterr().out
    assert "epoch 3/3" in out


def test_full_disk_in_preprocessing_is_one_line(tmp_path, capsys, monkeypatch):
    from data_loading import preprocessing as pp
    from data_loading.synthetic import generate

    raw = tmp_path / "raw"
    generate(str(raw), cases=1, seed=0, size="small")
    monkeypatch.setattr(np, "save", _enospc)
    with pytest.raises(pp.PreprocessError) as info:
        pp.preprocess_cases(pp.find_cases(str(raw))[0], str(tmp_path / "out"), 1, lambda s: None)
    message = str(info.value)
    assert "No space left on device" in message and "case_00000_x.npy" in message and "\n" not in message
    assert os.listdir(tmp_path / "out") == []                  # no temporary file left


# -------------------------------------------------------------------- non-finite data and weights

def _nan_copy(data, tmp_path, case):
    folder = tmp_path / "nan"
    folder.mkdir()
    for name in os.listdir(data):
        os.symlink(os.path.join(data, name), folder / name)
    image = np.load(os.path.join(data, f"case_{case:05d}_x.npy"))
    image[0, :, :, :] = np.nan
    os.remove(folder / f"case_{case:05d}_x.npy")
    np.save(folder / f"case_{case:05d}_x.npy", image)
    return folder


@pytest.mark.parametrize("case,mode", [(1, "train"), (3, "evaluate")])   # 3 is an evaluation id
def test_non_finite_volume_is_named(data, tmp_path, capsys, case, mode):
    folder = _nan_copy(data, tmp_path, case)
    argv = ["--data_dir", str(folder), "--log_dir", str(tmp_path / "l"), *SMALL, "--epochs", "1",
            "--start_eval_at", "1", "--batch_size", "8"]
    if mode == "evaluate":
        write_checkpoint(tmp_path / "w.pt", architecture(SMALL_FILTERS))
        argv = used_in("evaluate", argv) + ["--exec_mode", "evaluate", "--load_ckpt_path", str(tmp_path / "w.pt")]
    code, out, err = call(argv, capsys)
    one_line_error(code, err, f"case_{case:05d}_x.npy", "NaN")


def test_checkpoint_with_non_finite_weights_is_refused(data, tmp_path, capsys):
    config = architecture(SMALL_FILTERS)
    diverged = unet(config)
    with torch.no_grad():
        diverged.output.conv.bias[0] = float("nan")
    write_checkpoint(tmp_path / "nan.pt", config, diverged)
    code, out, err = call(["--exec_mode", "evaluate", "--data_dir", data, "--load_ckpt_path", str(tmp_path / "nan.pt"),
                           "--log_dir", str(tmp_path / "l"), *EVAL_SMALL], capsys)
    one_line_error(code, err, "nan.pt", "non-finite", "output.conv.bias")


# -------------------------------------------------------------------- signals

def _popen(*args):
    return subprocess.Popen([sys.executable, "main.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(path, proc, seconds=300):
    deadline = time.time() + seconds
    while not os.path.exists(path) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["evaluate", "benchmark"])
def test_sigterm_stops_evaluate_and_benchmark(data, tmp_path, mode):
    write_checkpoint(tmp_path / "w.pt", architecture(SMALL_FILTERS))
    flags = (["--exec_mode", "evaluate", "--load_ckpt_path", str(tmp_path / "w.pt"), "--overlap", "0.9",
              "--log_dir", str(tmp_path / "l"), *EVAL_SMALL]
             if mode == "evaluate"
             else ["--benchmark", "--epochs", "1000", "--warmup_steps", "1", *SMALL])  # --benchmark writes no log
    proc = _popen("--data_dir", data, *flags, "--sw_batch_size", "1")
    marker = tmp_path / "l" / LOCK_NAME if mode == "evaluate" else None
    if marker is not None:
        _wait_for(marker, proc)
    else:
        while proc.poll() is None and "step 1:" not in (proc.stderr.readline() or "step 1:"):
            pass
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    start = time.time()
    out, err = proc.communicate(timeout=120)
    assert time.time() - start < 60
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err
    one_line_error(proc.returncode, err, "SIGTERM")
    assert not os.path.exists(tmp_path / "l" / LOCK_NAME)      # the lock is released


def test_sigterm_in_training_without_save_path_says_nothing_is_saved(tmp_path, capsys, monkeypatch):
    original = fake_data.FakeTrainLoader.__iter__

    def iter_with_signal(self):
        for i, batch in enumerate(original(self)):
            if i == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch

    monkeypatch.setattr(fake_data.FakeTrainLoader, "__iter__", iter_with_signal)
    code, out, _ = call(TINY + ["--epochs", "3", "--log_dir", str(tmp_path)], capsys, fake_data.FakeData())
    assert code == 128 + signal.SIGTERM
    assert "nothing saved, no --save_ckpt_path was given" in out


# -------------------------------------------------------------------- one MLPerf log per run

def test_rerun_keeps_the_previous_log_and_writes_one_run_per_log(tmp_path, capsys):
    argv = TINY + ["--epochs", "1", "--start_eval_at", "1", "--log_dir", str(tmp_path)]
    assert call(argv, capsys, fake_data.FakeData())[0] == 0
    first = (tmp_path / "unet3d.log").read_text()
    assert call(argv, capsys, fake_data.FakeData())[0] == 0
    # the previous run's files moved into a folder of their own (tests/test_attempts.py: all of them)
    (kept,) = [p for p in tmp_path.iterdir() if p.name.startswith("previous-")]
    logs = [tmp_path / "unet3d.log", kept / "unet3d.log"]
    assert (kept / "unet3d.log").read_text() == first                   # nothing lost
    for log in logs:
        assert log.read_text().count('"key": "run_start"') == 1
    assert not (tmp_path / LOCK_NAME).exists()


def test_concurrent_run_is_refused_and_a_stale_lock_taken_over(tmp_path, capsys):
    import socket

    (tmp_path / LOCK_NAME).write_text(f"{os.getppid()} {socket.gethostname()} now\n")   # a live process
    code, out, err = call(TINY + ["--epochs", "1", "--log_dir", str(tmp_path)], capsys)
    one_line_error(code, err, f"pid {os.getppid()}", socket.gethostname(), str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(f"{dead.pid} {socket.gethostname()} then\n")
    code, out, err = call(TINY + ["--epochs", "1", "--start_eval_at", "1", "--log_dir", str(tmp_path)], capsys,
                          fake_data.FakeData())
    assert code == 0 and not (tmp_path / LOCK_NAME).exists()


def test_lock_is_released_on_error(tmp_path):
    with pytest.raises(ValueError):
        with RunLock(str(tmp_path)):
            assert (tmp_path / LOCK_NAME).exists()
            raise ValueError
    assert not (tmp_path / LOCK_NAME).exists()


def test_keep_previous_never_overwrites(tmp_path):
    path = tmp_path / "unet3d.log"
    names = set()
    for text in ("a", "b", "c"):
        path.write_text(text)
        names.add(os.path.basename(keep_previous(str(path))))
    assert len(names) == 3 and not path.exists()
    assert sorted((tmp_path / n).read_text() for n in names) == ["a", "b", "c"]


# -------------------------------------------------------------------- former tracebacks

def test_evaluate_on_a_folder_without_evaluation_cases(tmp_path, capsys):
    easy_data.write_dataset(str(tmp_path / "d"), [1, 2])            # neither is an evaluation id
    write_checkpoint(tmp_path / "w.pt", architecture(SMALL_FILTERS))
    code, _, err = call(["--exec_mode", "evaluate", "--data_dir", str(tmp_path / "d"), "--log_dir", str(tmp_path / "l"),
                         "--load_ckpt_path", str(tmp_path / "w.pt"), *EVAL_SMALL], capsys)
    one_line_error(code, err, "no evaluation case", tmp_path / "d")


@pytest.mark.parametrize("argv,named", [(["--seed", str(2**64)], "--seed"),
                                        (["--device", "cuda"], "--device cuda")])
def test_bad_flags_are_one_line(tmp_path, capsys, argv, named):
    if named == "--device cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    code, _, err = call(["--data_dir", str(tmp_path), *argv], capsys)
    assert code == 2
    one_line_error(code, err, named)


def test_resume_with_another_optimizer_is_one_line(tmp_path, capsys, shared_runs):
    run = shared_runs.run(TRAINED, capsys)
    assert run.code == 0
    folder = run.copy_to(tmp_path / "run")  # the resume is refused, but in a folder of its own
    argv = [a.replace("{run}", str(folder)) for a in TRAINED]
    argv = [a if a != "adam" else "sgd" for a in argv]
    with pytest.raises(Exception) as info:
        call(argv + ["--epochs", "2", "--resume"], capsys, fake_data.FakeData())
    assert "adam" in str(info.value) and "--optimizer" in str(info.value) and "\n" not in str(info.value)


def test_checkpoint_holding_a_list_is_one_line(data, tmp_path, capsys):
    broken_checkpoint(tmp_path / "list.pt", "not_a_dict")
    code, _, err = call(["--exec_mode", "evaluate", "--data_dir", data, "--log_dir", str(tmp_path / "l"),
                         "--load_ckpt_path", str(tmp_path / "list.pt"), *EVAL_SMALL], capsys)
    one_line_error(code, err, "list.pt", "list")


# -------------------------------------------------------------------- architecture from the checkpoint

def test_evaluate_reads_the_architecture_from_the_checkpoint(tmp_path, capsys, shared_runs):
    run = shared_runs.run(TRAINED, capsys)
    assert run.code == 0
    no_arch = used_in("evaluate", TINY)
    i = no_arch.index("--filters")
    del no_arch[i:i + 6]
    i = no_arch.index("--normalization")
    del no_arch[i:i + 2]
    evaluate = ["--exec_mode", "evaluate", "--load_ckpt_path", str(run.folder / "c.pt"), "--log_dir", str(tmp_path / "e")]
    code, out, _ = call(no_arch + evaluate, capsys, fake_data.FakeData())
    assert code == 0 and out.startswith("mean_dice")
    with pytest.raises(Exception) as info:
        call(no_arch + evaluate + ["--filters", "4", "8", "8", "16", "16"], capsys, fake_data.FakeData())
    assert "--filters 4 8 8 16 16 conflicts" in str(info.value) and "2 4 4 8 8" in str(info.value)


# -------------------------------------------------------------------- progress

def test_evaluation_prints_a_line_per_case_in_logs(data, tmp_path):
    write_checkpoint(tmp_path / "w.pt", architecture(SMALL_FILTERS))
    proc = subprocess.run([sys.executable, "main.py", "--exec_mode", "evaluate", "--data_dir", data, "--log_dir",
                           str(tmp_path / "l"), "--load_ckpt_path", str(tmp_path / "w.pt"), *EVAL_SMALL],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("eval 0 cases:")]
    assert [line.split()[3] for line in lines] == ["1/5", "2/5", "3/5", "4/5", "5/5"]


def test_preprocessing_reports_each_case_as_it_finishes(tmp_path):
    """With 2 workers, the first case reported is reported before the last one is written."""
    from data_loading import preprocessing as pp
    from data_loading.synthetic import generate

    raw = tmp_path / "raw"
    generate(str(raw), cases=3, seed=0, size="small")
    out = tmp_path / "out"
    seen = []

    def on_done(stats):
        seen.append((stats.name, sorted(p for p in os.listdir(out) if p.endswith("_y.npy"))))

    pp.preprocess_cases(pp.find_cases(str(raw))[0], str(out), 2, on_done)
    assert len(seen) == 3
    assert len(seen[0][1]) < 3      # waiting for all cases first would show all 3 written


def test_reference_checkpoint_with_numpy_scalars_loads_or_says_why(tmp_path, monkeypatch):
    """The reference saves numpy scalars beside the weights: they load (safe_globals on new
    torch), and a torch without any way to allow them (2.3) gets one line naming the cause."""
    path = tmp_path / "reference.pt"
    reference_format_checkpoint(path, unet(architecture((2, 4, 4, 8, 8))), best_score=0.91)
    if hasattr(torch.serialization, "safe_globals") or hasattr(torch.serialization, "add_safe_globals"):
        loaded = load_checkpoint(str(path))
        assert float(loaded["best_score"]) == 0.91
    for name in ("safe_globals", "add_safe_globals"):
        monkeypatch.delattr(torch.serialization, name, raising=False)
    from runtime.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="holds numpy values") as info:
        load_checkpoint(str(path))
    assert "\n" not in str(info.value) and "reference.pt" in str(info.value)


# -------------------------------------------------------------------- "best" before the first evaluation

def _kill_after_epoch(argv, ckpt, epoch, seconds=300):
    """Start main.py ``argv``; kill -9 it once ``ckpt`` holds ``epoch`` or later (it must still
    be running then); returns the epoch it was killed after."""
    proc = _popen(*argv)
    deadline = time.time() + seconds
    saved = 0
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(ckpt):
            try:
                saved = int(load_checkpoint(str(ckpt))["epoch"])
            except Exception:  # noqa: BLE001 - read while being replaced: try again
                saved = 0
            if saved >= epoch:
                break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.kill()
    proc.communicate()
    return saved


@pytest.mark.slow
def test_kill_before_the_first_evaluation_then_resume_evaluates_like_an_uninterrupted_run(data, tmp_path, capsys):
    """Periodic checkpoints, no evaluation yet (--start_eval_at beyond --epochs): kill -9 after
    epoch 2, --resume, and evaluate the result: the same weights and the same Dice as a run never
    interrupted, and evaluate says that it used the last weights (there is no best yet)."""
    common = ["--data_dir", data, *SMALL, "--epochs", "4", "--start_eval_at", "20", "--ckpt_every_epochs", "1",
              "--ckpt_every_minutes", "0", "--batch_size", "2"]
    whole = common + ["--log_dir", str(tmp_path / "whole"), "--save_ckpt_path", str(tmp_path / "whole.pt")]
    assert call(whole, capsys)[0] == 0
    part = common + ["--log_dir", str(tmp_path / "part"), "--save_ckpt_path", str(tmp_path / "part.pt")]
    killed = _kill_after_epoch(part, tmp_path / "part.pt", 2)
    assert 2 <= killed < 4
    code, out, _ = call(part + ["--resume"], capsys)
    assert code == 0 and f"resuming {tmp_path / 'part.pt'} after epoch {killed}" in out
    a, b = load_checkpoint(str(tmp_path / "whole.pt")), load_checkpoint(str(tmp_path / "part.pt"))
    assert a["has_best"] is False and b["has_best"] is False
    for key in ("last_model_state_dict", "best_model_state_dict"):
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key
    scores = []
    for name in ("whole", "part"):
        code, out, _ = call(["--exec_mode", "evaluate", "--data_dir", data, *EVAL_SMALL, "--log_dir",
                             str(tmp_path / f"eval-{name}"), "--load_ckpt_path", str(tmp_path / f"{name}.pt")], capsys)
        assert code == 0 and "weights: the last weights (epoch 4; no evaluation yet, so no best)" in out, out
        scores.append(out.splitlines()[:2])
    assert scores[0] == scores[1]


def test_old_checkpoints_say_whether_they_hold_a_best():
    from runtime.checkpoint import has_best, model_state_from, weights_description

    last, best = {"w": torch.ones(1)}, {"w": torch.zeros(1)}
    reference = reference_format(best, last)
    version_1_before_evaluation = format_1(best, last, epoch=3, best_epoch=0)
    version_1_evaluated = format_1(best, last, epoch=3, best_epoch=2, best_mean_dice=0.5)
    assert has_best(reference) and not has_best(version_1_before_evaluation) and has_best(version_1_evaluated)
    assert torch.equal(model_state_from(version_1_before_evaluation)["w"], last["w"])   # not the stale "best"
    assert torch.equal(model_state_from(version_1_evaluated)["w"], best["w"])
    assert torch.equal(model_state_from(reference)["w"], best["w"])
    assert "last weights (epoch 3; no evaluation yet" in weights_description(version_1_before_evaluation)
    assert weights_description(version_1_evaluated) == "the best weights (epoch 2, mean_dice 0.5000)"


def test_a_resume_keeps_no_best_from_a_checkpoint_without_one(tmp_path, capsys):
    argv = TINY + ["--start_eval_at", "10", "--ckpt_every_epochs", "1", "--log_dir", str(tmp_path / "l"),
                   "--save_ckpt_path", str(tmp_path / "c.pt")]
    assert call(argv + ["--epochs", "1"], capsys, fake_data.FakeData())[0] == 0
    assert call(argv + ["--epochs", "2", "--resume"], capsys, fake_data.FakeData())[0] == 0
    saved = load_checkpoint(str(tmp_path / "c.pt"))
    assert saved["has_best"] is False and saved["epoch"] == 2
    assert all(torch.equal(saved["best_model_state_dict"][k], saved["last_model_state_dict"][k])
               for k in saved["last_model_state_dict"])


# -------------------------------------------------------------------- one run per checkpoint file

def test_a_second_training_on_one_checkpoint_file_is_refused(tmp_path, capsys):
    import socket

    ckpt = tmp_path / "c.pt"
    (tmp_path / ".c.pt.lock").write_text(f"{os.getppid()} {socket.gethostname()} now\n")   # a live run
    code, out, err = call(TINY + ["--epochs", "1", "--log_dir", str(tmp_path / "other_logs"),
                                  "--save_ckpt_path", str(ckpt)], capsys)
    one_line_error(code, err, "--save_ckpt_path", str(ckpt), f"pid {os.getppid()}")
    assert not ckpt.exists() and not (tmp_path / "other_logs" / LOCK_NAME).exists()


# -------------------------------------------------------------------- a NaN anywhere in a training volume

def test_a_nan_outside_any_sampled_patch_is_named_before_training(data, tmp_path, capsys):
    folder = tmp_path / "nan"
    folder.mkdir()
    for name in os.listdir(data):
        os.symlink(os.path.join(data, name), folder / name)
    image = np.load(os.path.join(data, "case_00001_x.npy"))
    image[0, -1, -1, -1] = np.nan                                 # one voxel, in a corner
    os.remove(folder / "case_00001_x.npy")
    np.save(folder / "case_00001_x.npy", image)
    code, out, err = call(["--data_dir", str(folder), "--log_dir", str(tmp_path / "l"), *SMALL, "--epochs", "1",
                           "--start_eval_at", "1", "--batch_size", "2"], capsys)
    one_line_error(code, err, folder / "case_00001_x.npy", "NaN", "first read")
    assert "epoch 1/" not in out


# -------------------------------------------------------------------- an axis shorter than half a stride

def test_window_geometry_pads_an_axis_shorter_than_half_a_stride_and_changes_nothing_else():
    from data_loading.windows import window_geometry

    for size in range(1, 300):
        geometry = window_geometry((size, 128, 200), (128, 128, 128), 0.5)
        remainder = size % 64
        benchmark_trim = remainder if remainder < 32 else 0               # the benchmark's rule
        expected = size if size < 32 else size - benchmark_trim
        assert geometry.trimmed_shape[0] == expected, size
        assert geometry.trimmed_shape[0] > 0 and geometry.padded_shape[0] >= 128


def test_sliding_window_on_20_slices_returns_20_slices():
    """The window returns every slice (identity 'model': the prediction is the image)."""
    from runtime.inference.sliding_window import sliding_window_inference, trim_like_window

    image = torch.randn(1, 1, 20, 70, 140)
    label = torch.zeros(1, 1, 20, 70, 140, dtype=torch.uint8)
    out = sliding_window_inference(lambda x: x.repeat(1, 3, 1, 1, 1), image, (128, 128, 128), 0.5)
    kept = trim_like_window(label, (128, 128, 128), 0.5)
    # D kept whole; H and W trimmed by the benchmark's rule (remainders 6 and 12 of the stride 64)
    assert out.shape == (1, 3, 20, 64, 128) and kept.shape == (1, 1, 20, 64, 128)
    torch.testing.assert_close(out[:, :1], image[..., 3:67, 6:134], rtol=0, atol=1e-5)


# -------------------------------------------------------------------- smaller

def test_evaluate_benchmark_with_fewer_volumes_than_warmup_steps_is_refused_first(data, tmp_path, capsys):
    start = time.time()
    code, out, err = call(["--exec_mode", "evaluate", "--benchmark", "--data_dir", data, *EVAL_SMALL,
                           "--warmup_steps", "100"], capsys)
    one_line_error(code, err, "--warmup_steps 100", "evaluation volumes")
    assert "benchmark eval volumes" not in err and time.time() - start < 60


def test_a_folder_as_load_ckpt_path_is_called_a_folder(data, tmp_path, capsys):
    (tmp_path / "ckpt.pt").write_bytes(b"")
    code, out, err = call(["--exec_mode", "evaluate", "--data_dir", data, "--load_ckpt_path", str(tmp_path)], capsys)
    assert code == 2
    one_line_error(code, err, "is a folder", str(tmp_path / "ckpt.pt"))
    assert "does not exist" not in err


def test_a_run_refused_for_a_bad_checkpoint_leaves_no_empty_log_dir(data, tmp_path, capsys):
    broken_checkpoint(tmp_path / "list.pt", "not_a_dict")
    log_dir = tmp_path / "new" / "logs"
    code, _, err = call(["--exec_mode", "evaluate", "--data_dir", data, "--log_dir", str(log_dir),
                         "--load_ckpt_path", str(tmp_path / "list.pt"), *EVAL_SMALL], capsys)
    one_line_error(code, err, "list.pt")
    assert not (tmp_path / "new").exists()


def test_report_calls_a_run_that_ran_its_epochs_finished(tmp_path, capsys):
    from runtime.results.runs import load_run
    from runtime.results.scoring import run_outcome

    argv = TINY + ["--epochs", "2", "--start_eval_at", "1", "--quality_threshold", "1.0", "--log_dir", str(tmp_path)]
    assert call(argv, capsys, fake_data.FakeData())[0] == 0
    assert run_outcome(load_run(str(tmp_path))) == "finished"
