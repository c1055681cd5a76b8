"""The MLCommons reference's command lines run here unchanged (issue 48, item 8).

The reference has one parser: it takes every one of its flags in every mode, so its users pass one
set of flags to train and to evaluate. Here such a flag, given in a mode that does not use it, is
accepted with one line naming it (it has no effect), while this project's own flags stay refused
(tests/test_mode_flags.py). ``--benchmark --log_dir DIR`` writes the throughput where the
reference's does: a record of ``DIR/log.json`` with its keys.

Oracles: the flags of the reference's ``run_and_time.sh`` as it passes them; evaluate's printed
scores with and without the training flags (no effect: the same lines); the reference's statistics
worked out by hand; the per-step times the benchmark prints.
"""
import json
import os
import re

import pytest

import fake_data
from checkpoints import architecture, write_checkpoint
from main_runs import TINY, call, used_in
from runtime.arguments import parse_args
from runtime.run_files import BENCHMARK, METRICS_LOG
from runtime.training.latency import reference_stats

# The reference's run_and_time.sh: `python main.py --data_dir ${DATASET_DIR}` and these, its timed
# run's values.
RUN_AND_TIME = ["--epochs", "4000", "--evaluate_every", "20", "--start_eval_at", "1000", "--quality_threshold",
                "0.908", "--batch_size", "2", "--optimizer", "sgd", "--ga_steps", "1", "--learning_rate", "0.8",
                "--seed", "1", "--lr_warmup_epochs", "200"]
# More of the reference's flags, which its evaluate takes and does not read.
MORE_TRAINING = ["--input_shape", "128", "128", "128", "--num_workers", "8", "--init_learning_rate", "1e-4",
                 "--momentum", "0.9", "--weight_decay", "0", "--oversampling", "0.4", "--warmup_steps", "4",
                 "--lr_decay_epochs", "3000", "--lr_decay_factor", "1.0", "--pad_mode", "edge", "--layout", "NCDHW"]
# One evaluation volume of one window, a few training batches: the least a run needs.
def small_data():
    return fake_data.FakeData(n_train=4, n_val=1, val_shape=(32, 32, 32))


# Those that evaluate does not use, by hand: the schedule, the optimiser, the training loader.
NOT_IN_EVALUATE = {"--epochs", "--evaluate_every", "--start_eval_at", "--quality_threshold", "--batch_size",
                   "--optimizer", "--ga_steps", "--learning_rate", "--lr_warmup_epochs", "--input_shape",
                   "--num_workers", "--init_learning_rate", "--momentum", "--weight_decay", "--oversampling",
                   "--warmup_steps", "--lr_decay_epochs", "--lr_decay_factor", "--pad_mode"}


def named_flags(line: str) -> set[str]:
    """The flags a no-effect line names (before "have no effect")."""
    return set(re.findall(r"--\w+", line.split(" ha")[0]))


def test_the_reference_timed_run_flags_parse_in_train_and_in_evaluate(tmp_path):
    """run_and_time.sh's flags: train uses each of them; evaluate (which used to exit 2 on them)
    accepts them all and its line names exactly those it does not use."""
    from runtime.arguments import no_effect_line

    (tmp_path / "c.pt").touch()
    train = parse_args(["--data_dir", str(tmp_path), *RUN_AND_TIME])
    assert no_effect_line(train) == "" and train.learning_rate == 0.8
    evaluate = parse_args(["--data_dir", str(tmp_path), "--exec_mode", "evaluate", "--load_ckpt_path",
                           str(tmp_path / "c.pt"), "--save_ckpt_path", str(tmp_path / "s.pt"), *RUN_AND_TIME,
                           *MORE_TRAINING])
    line = no_effect_line(evaluate)
    assert named_flags(line) == NOT_IN_EVALUATE | {"--save_ckpt_path"}
    assert "have no effect in --exec_mode evaluate" in line and "MLCommons reference" in line


@pytest.fixture
def tiny_checkpoint(tmp_path):
    path = str(tmp_path / "c.pt")
    write_checkpoint(path, architecture((2, 4, 4, 8, 8), "batchnorm"))
    return path


def test_evaluate_with_the_training_flags_runs_and_scores_as_without_them(tmp_path, capsys, tiny_checkpoint):
    """The reference's way of evaluating (one flag set for both modes) exits 0 with one line on
    stderr naming the flags with no effect, and prints the very scores of a run without them."""
    evaluate = ["--exec_mode", "evaluate", "--load_ckpt_path", tiny_checkpoint]
    code, plain, err = call(used_in("evaluate", TINY) + evaluate + ["--log_dir", str(tmp_path / "a")], capsys,
                            small_data())
    assert code == 0 and "note:" not in err
    given = TINY + evaluate + ["--log_dir", str(tmp_path / "b"), *RUN_AND_TIME]
    code, out, err = call(given, capsys, small_data())
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert code == 0, err
    assert len(notes) == 1 and {"--optimizer", "--learning_rate", "--epochs", "--batch_size"} <= named_flags(notes[0])
    scores = [line for line in out.splitlines() if re.match(r"^(mean_dice|l1_dice|l2_dice|eval_loss) ", line)]
    assert len(scores) >= 2 and scores == [line for line in plain.splitlines() if line in scores]


def test_reference_statistics_known_answers():
    """Steps of 0.1, 0.2 and 0.4 s at 2 samples each: the reference's throughput is the mean of the
    steps' rates, (20 + 10 + 5) / 3 samples/s (not 6 / 0.7); latencies in ms, numpy's linear
    percentiles of (100, 200, 400): at 90% rank 1.8 -> 200 + 0.8 * 200."""
    stats = reference_stats([0.1, 0.2, 0.4], 2, "train")
    assert set(stats) == {"throughput_train", "latency_train_mean", "latency_train_90", "latency_train_95",
                          "latency_train_99"}
    expected = {"throughput_train": 35 / 3, "latency_train_mean": 700 / 3, "latency_train_90": 360.0,
                "latency_train_95": 380.0, "latency_train_99": 396.0}
    assert stats == pytest.approx(expected, rel=1e-12)
    assert set(reference_stats([1.0], 1, "eval")) == {"throughput_eval", "latency_eval_mean", "latency_eval_90",
                                                      "latency_eval_95", "latency_eval_99"}


@pytest.mark.parametrize("mode", ["train", pytest.param("evaluate", marks=pytest.mark.slow)])
def test_benchmark_with_log_dir_writes_the_reference_keys_there(tmp_path, capsys, monkeypatch, tiny_checkpoint, mode):
    """``--benchmark --log_dir DIR`` (refused before) writes one benchmark record to DIR/log.json:
    the reference's keys, from the steps the run printed; without --log_dir nothing is written."""
    monkeypatch.chdir(tmp_path)  # where the default --log_dir, results, would go
    flags = (["--benchmark_steps", "2", "--warmup_steps", "1"] + (["--exec_mode", "evaluate", "--load_ckpt_path",
                                                                   tiny_checkpoint] if mode == "evaluate" else []))
    argv = used_in(f"{mode} --benchmark", TINY) + ["--benchmark", *flags]
    if mode == "train":
        code, out, _ = call(argv, capsys, small_data())
        assert code == 0 and os.listdir(tmp_path) == ["c.pt"]
    code, out, err = call(argv + ["--log_dir", str(tmp_path / "bench")], capsys, small_data())
    assert code == 0, err
    with open(tmp_path / "bench" / METRICS_LOG) as handle:
        (record,) = [json.loads(line) for line in handle]
    kind = "train" if mode == "train" else "eval"
    assert record["kind"] == BENCHMARK and record["timed_iterations"] == 2
    printed = re.search(rf"throughput_{kind}: .* latency mean ([\d.]+) ms", out)
    assert record[f"latency_{kind}_mean"] == pytest.approx(float(printed.group(1)), abs=0.05)
    assert {f"throughput_{kind}", f"latency_{kind}_mean", f"latency_{kind}_90", f"latency_{kind}_95",
            f"latency_{kind}_99"} <= set(record)
    if mode == "train":  # each timed step's time, printed to 0.1 ms: the mean of 2 samples over each
        steps = [float(ms) for ms in re.findall(r"^timed step \d+: ([\d.]+) ms", err, re.M)]
        assert len(steps) == 2
        assert record["throughput_train"] == pytest.approx(sum(2000 / ms for ms in steps) / 2, rel=5e-3)
        assert record["eval_seconds"] > 0
