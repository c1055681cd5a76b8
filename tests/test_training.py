"""Training loop, checkpoints, resume and pre-emption on tiny shapes (fake data, CPU)."""
import json
import os
import signal

import pytest
import torch

import fake_data
from main_runs import used_in
from runtime.arguments import parse_args
from runtime.checkpoint import load_checkpoint

# Batch norm at 32^3 keeps CPU steps cheap (instance norm needs 64^3: its 1^3 bottleneck fails).
TINY = ["--loader", "synthetic", "--filters", "2", "4", "4", "8", "8", "--input_shape", "32", "32", "32",
        "--val_input_shape", "32", "32", "32", "--normalization", "batchnorm", "--batch_size", "2", "--optimizer", "adam",
        "--learning_rate", "0.01", "--seed", "7", "--device", "cpu", "--num_workers", "0"]


@pytest.fixture
def fake_loaders():
    return fake_data.FakeData()


def app_run(cfg):
    from runtime.app import run

    return run(cfg, data=fake_data.FakeData())


def run(tmp_path, name, *extra):
    log_dir = tmp_path / name
    cfg = parse_args(TINY + ["--log_dir", str(log_dir), "--save_ckpt_path", str(tmp_path / f"{name}.pt"),
                             *extra])
    code = app_run(cfg)
    return code, log_dir, tmp_path / f"{name}.pt"


def test_train_writes_logs_and_checkpoint(tmp_path, fake_loaders, capsys):
    code, log_dir, ckpt_path = run(tmp_path, "a", "--epochs", "3", "--start_eval_at", "2",
                                   "--evaluate_every", "1")
    assert code == 0
    out = capsys.readouterr().out
    assert "RUN_SUMMARY,image_segmentation,7," in out and "eval epoch 2: mean_dice" in out
    records = [json.loads(line) for line in (log_dir / "log.json").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    assert [r["epoch"] for r in records if r["kind"] == "eval"] == [2, 3]
    ckpt = load_checkpoint(str(ckpt_path))
    for key in ("best_model_state_dict", "last_model_state_dict", "optimizer_state_dict", "epoch",
                "scaler_state_dict", "rng", "config", "best_mean_dice", "master_seed"):
        assert key in ckpt, key
    assert ckpt["epoch"] == 3 and ckpt["master_seed"] == 7
    assert "output.conv.bias" in ckpt["last_model_state_dict"]
    mllog = (log_dir / "unet3d.log").read_text()
    for key in ("cache_clear", "init_start", "run_start", "run_stop", "eval_accuracy", "block_start",
                "weights_initialization", "samples_per_epoch"):
        assert f'"key": "{key}"' in mllog, key
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.parametrize("semantics", ["reference", "project"])
def test_schedule_line_names_the_first_epoch_that_evaluates(tmp_path, fake_loaders, capsys, semantics):
    """Either --semantics evaluates at --start_eval_at and every --evaluate_every epochs after it
    (the current MLCommons code's rule), and the schedule line says so (the log's eval records
    are the oracle); a run whose first evaluation lies beyond --epochs is told that too."""
    code, log_dir, _ = run(tmp_path, semantics, "--epochs", "5", "--start_eval_at", "3", "--evaluate_every", "2",
                           "--semantics", semantics)
    assert code == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in (log_dir / "log.json").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "eval"] == [3, 5]
    assert "first eval at epoch 3, then every 2;" in out
    code, log_dir, _ = run(tmp_path, "none", "--epochs", "2", "--start_eval_at", "3")
    out = capsys.readouterr().out
    records = [json.loads(line) for line in (log_dir / "log.json").read_text().splitlines()]
    assert code == 0 and not [r for r in records if r["kind"] == "eval"]
    assert "; no evaluation within --epochs 2;" in out


def _weights(path):
    return load_checkpoint(str(path))["last_model_state_dict"]


def test_resume_equals_uninterrupted(tmp_path, fake_loaders):
    common = ["--start_eval_at", "3", "--evaluate_every", "1"]
    assert run(tmp_path, "full", "--epochs", "3", *common)[0] == 0
    assert run(tmp_path, "part", "--epochs", "1", *common)[0] == 0
    assert load_checkpoint(str(tmp_path / "part.pt"))["epoch"] == 1
    assert run(tmp_path, "part", "--epochs", "3", "--resume", *common)[0] == 0
    full, resumed = _weights(tmp_path / "full.pt"), _weights(tmp_path / "part.pt")
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    full_opt = load_checkpoint(str(tmp_path / "full.pt"))["optimizer_state_dict"]["state"]
    res_opt = load_checkpoint(str(tmp_path / "part.pt"))["optimizer_state_dict"]["state"]
    assert torch.equal(full_opt[0]["exp_avg"], res_opt[0]["exp_avg"])


def test_sigterm_mid_epoch_saves_and_resume_is_exact(tmp_path, fake_loaders, monkeypatch):
    common = ["--epochs", "2", "--start_eval_at", "2", "--evaluate_every", "1"]
    assert run(tmp_path, "full", *common)[0] == 0

    original_iter = fake_data.FakeTrainLoader.__iter__

    def iter_with_signal(self):
        for i, batch in enumerate(original_iter(self)):
            if self.epoch == 2 and i == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # SLURM pre-emption during the 2nd batch
            yield batch

    monkeypatch.setattr(fake_data.FakeTrainLoader, "__iter__", iter_with_signal)
    handler_before = signal.getsignal(signal.SIGTERM)
    code, _, ckpt_path = run(tmp_path, "pre", *common)
    assert signal.getsignal(signal.SIGTERM) is handler_before  # the run put the handler back
    assert code == 0
    ckpt = load_checkpoint(str(ckpt_path))
    assert ckpt["status"] == "preempted" and ckpt["epoch"] == 1 and ckpt["step_in_epoch"] == 2
    monkeypatch.setattr(fake_data.FakeTrainLoader, "__iter__", original_iter)
    assert run(tmp_path, "pre", *common, "--resume")[0] == 0
    full, resumed = _weights(tmp_path / "full.pt"), _weights(ckpt_path)
    assert all(torch.equal(full[k], resumed[k]) for k in full)


def test_gradient_accumulation_equals_larger_batch(tmp_path, fake_loaders):
    """ga_steps=2 with batch 1 takes the same optimizer steps on the same samples as batch 2
    (SGD; instance norm makes samples independent), up to float rounding."""
    sgd = ["--optimizer", "sgd", "--learning_rate", "0.05", "--epochs", "1", "--start_eval_at", "5",
           "--normalization", "instancenorm", "--input_shape", "64", "64", "64"]
    assert run(tmp_path, "b2", *sgd)[0] == 0
    assert run(tmp_path, "ga", *sgd, "--batch_size", "1", "--ga_steps", "2")[0] == 0
    a, b = _weights(tmp_path / "b2.pt"), _weights(tmp_path / "ga.pt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_evaluate_mode_prints_mean_dice(tmp_path, fake_loaders, capsys):
    assert run(tmp_path, "a", "--epochs", "1", "--start_eval_at", "1")[0] == 0
    cfg = parse_args(used_in("evaluate", TINY) + ["--exec_mode", "evaluate", "--load_ckpt_path", str(tmp_path / "a.pt"),
                             "--log_dir", str(tmp_path / "ev")])
    capsys.readouterr()
    assert app_run(cfg) == 0
    out = capsys.readouterr().out
    assert out.startswith("mean_dice ") and "l2_dice" in out


@pytest.mark.parametrize("benchmark", [False, True], ids=["evaluate", "evaluate-benchmark"])
def test_evaluate_builds_no_optimizer_and_no_train_step(tmp_path, capsys, monkeypatch, benchmark):
    """Evaluate and --benchmark's evaluation score a network: no optimizer, no gradient scaler
    and no train step is built for them (runtime.build's makers of those are never called)."""
    import runtime.build as build
    import runtime.clocked.start as start
    from checkpoints import architecture, write_checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("a training part built for a run that does not train")

    for maker in ("make_optimizer", "eager_train_step", "graphed_train_step"):
        monkeypatch.setattr(build, maker, refuse)
    built = []
    real_build = start.build_components
    monkeypatch.setattr(start, "build_components", lambda *a, **k: built.append(real_build(*a, **k)) or built[-1])
    if benchmark:
        flags = used_in("evaluate --benchmark", TINY) + ["--benchmark", "--warmup_steps", "1", "--epochs", "1"]
    else:
        write_checkpoint(tmp_path / "w.pt", architecture((2, 4, 4, 8, 8), "batchnorm"))
        flags = used_in("evaluate", TINY) + ["--load_ckpt_path", str(tmp_path / "w.pt"), "--log_dir", str(tmp_path / "ev")]
    assert app_run(parse_args(flags + ["--exec_mode", "evaluate"])) == 0
    assert "mean_dice " in capsys.readouterr().out or benchmark
    assert [(c.optimizer, c.scaler, c.step) for c in built] == [(None, None, None)]


def test_benchmark_mode_prints_throughput(tmp_path, fake_loaders, capsys):
    # --benchmark writes no checkpoint and no log: it refuses --save_ckpt_path and --log_dir
    assert app_run(parse_args(TINY + ["--benchmark", "--epochs", "2", "--warmup_steps", "2"])) == 0
    out = capsys.readouterr().out
    assert "throughput_train:" in out and "p99" in out and "(4 timed iterations)" in out


def test_bf16_autocast_trains_on_cpu(tmp_path, fake_loaders):
    """bf16 autocast is really on (its loss differs from fp32's) and trains the same model (the
    losses agree closely, the checkpoint keeps float32 master weights)."""
    losses = {}
    for name, flags in (("fp32", []), ("bf16", ["--amp", "--amp_dtype", "bf16"])):
        code, log_dir, ckpt_path = run(tmp_path, name, *flags, "--epochs", "1", "--start_eval_at", "1")
        assert code == 0
        records = [json.loads(line) for line in (log_dir / "log.json").read_text().splitlines()]
        losses[name] = next(r["loss"] for r in records if r["kind"] == "train")
        weights = load_checkpoint(str(ckpt_path))["last_model_state_dict"]
        assert weights["output.conv.weight"].dtype == torch.float32
    assert losses["bf16"] != losses["fp32"]
    assert abs(losses["bf16"] - losses["fp32"]) < 0.05 * losses["fp32"]


def test_fp16_on_cpu_is_a_clear_error(tmp_path, fake_loaders):
    from runtime.arguments import UsageError

    with pytest.raises(UsageError, match="--amp_dtype bf16"):
        run(tmp_path, "fp16", "--amp", "--amp_dtype", "fp16")


def test_evaluate_benchmark_prints_throughput_eval(tmp_path, fake_loaders, capsys):
    cfg = parse_args(used_in("evaluate --benchmark", TINY) + ["--exec_mode", "evaluate", "--benchmark",
                                                              "--warmup_steps", "1", "--epochs", "2"])
    assert app_run(cfg) == 0
    out = capsys.readouterr().out
    assert "throughput_eval:" in out and "volumes/s" in out and "(5 timed iterations)" in out


def test_plot_draws_curves_after_each_evaluation(tmp_path, fake_loaders):
    pytest.importorskip("matplotlib")
    code, log_dir, _ = run(tmp_path, "plot", "--plot", "--epochs", "2", "--start_eval_at", "1", "--evaluate_every", "1")
    assert code == 0
    png = (log_dir / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    code, log_dir, _ = run(tmp_path, "noplot", "--epochs", "1", "--start_eval_at", "1")
    assert code == 0 and not (log_dir / "curves.png").exists()


def test_resume_of_a_run_that_reached_its_target_trains_no_further(tmp_path, fake_loaders, capsys):
    """A job requeued just as its run succeeded (or any second --resume): nothing to resume, exit
    0, the checkpoint and the logs as they were, no new MLPerf log."""
    args = ("--epochs", "4", "--start_eval_at", "1", "--evaluate_every", "1", "--quality_threshold", "1e-9")
    code, log_dir, ckpt_path = run(tmp_path, "done", *args)
    assert code == 0 and load_checkpoint(str(ckpt_path))["status"] == "success"
    before = ckpt_path.read_bytes(), sorted(os.listdir(log_dir)), (log_dir / "log.json").read_text()
    capsys.readouterr()
    code, _, _ = run(tmp_path, "done", *args, "--resume")
    out = capsys.readouterr().out
    assert code == 0 and "already ended (success at epoch 1); nothing to resume" in out, out
    assert (ckpt_path.read_bytes(), sorted(os.listdir(log_dir)), (log_dir / "log.json").read_text()) == before
