"""``--benchmark``'s step and time budget, training's evaluation pass and the predicted time to
train it prints (tiny network, fake data, CPU)."""
import math
import re

import pytest

import fake_data
from main_runs import TINY, call, one_line_error, used_in
from runtime.results import time_to_train as T
from runtime.training.benchmark import Budget, share_seconds

# FakeData: 6 training cases (3 batches of 2 per epoch), 3 evaluation volumes of 40x36x44
# (windows of 32^3 at overlap 0.5: 3 x 2 x 3 = 18 each, after the benchmark's trim).


def bench(tmp_path, capsys, *extra):
    mode = "evaluate --benchmark" if "evaluate" in extra else "train --benchmark"  # --benchmark writes no log
    return call(used_in(mode, TINY) + ["--benchmark", *extra], capsys, fake_data.FakeData())


def timed(out: str) -> int:
    return int(re.search(r"throughput_train: .*\((\d+) timed iterations\)", out).group(1))


def test_a_step_budget_times_that_many_steps_across_epochs(tmp_path, capsys):
    code, out, err = bench(tmp_path, capsys, "--benchmark_steps", "4", "--warmup_steps", "1")
    assert code == 0
    assert timed(out) == 4              # 5 steps: past the first epoch's 3 batches, --epochs not given
    assert "timing stopped after 4 timed steps (--benchmark_steps 4)" in out
    assert err.count("timed step") == 4 and err.count("warm-up step") == 1


def test_a_time_budget_stops_after_the_step_that_spends_it(tmp_path, capsys):
    code, out, _ = bench(tmp_path, capsys, "--benchmark_seconds", "1e-6", "--warmup_steps", "1")
    assert code == 0 and timed(out) == 1
    assert "(--benchmark_seconds 1e-06)" in out


def test_given_epochs_cap_a_budget(tmp_path, capsys):
    code, out, _ = bench(tmp_path, capsys, "--benchmark_steps", "50", "--epochs", "1", "--warmup_steps", "1")
    assert code == 0 and timed(out) == 2 and "timing stopped" not in out


def test_without_a_budget_every_step_of_the_epochs_is_timed(tmp_path, capsys):
    code, out, _ = bench(tmp_path, capsys, "--epochs", "2", "--warmup_steps", "2")
    assert code == 0 and timed(out) == 4 and "timing stopped" not in out


def test_the_flag_without_a_value_is_a_cpu_budget(tmp_path, capsys):
    from runtime.arguments import BENCHMARK_SECONDS_CPU, BENCHMARK_STEPS_CPU, parse_args

    cfg = parse_args(TINY + ["--benchmark", "--benchmark_steps", "--benchmark_seconds", "--epochs", "3"])
    assert (cfg.benchmark_steps, cfg.benchmark_seconds, cfg.epochs) == (BENCHMARK_STEPS_CPU, BENCHMARK_SECONDS_CPU, 3)
    assert BENCHMARK_STEPS_CPU * 20 <= 600            # about 20 s a 128^3 step on a CPU: minutes, not an hour


def test_training_benchmark_predicts_the_time_to_train(tmp_path, capsys):
    code, out, _ = bench(tmp_path, capsys, "--benchmark_steps", "2", "--warmup_steps", "1")
    assert code == 0
    # the evaluation pass: one volume with a step budget, the other two by their windows
    line = next(line for line in out.splitlines() if line.startswith("evaluation: "))
    assert "1 of 3 evaluation volumes timed, the rest extrapolated" in line and "scaled to 42" in line
    # no RCP at global batch 2: the one at 28 bounds it, and the output says so
    assert "time to train (MLPerf, predicted): global batch 2 on 1 rank(s)" in out
    assert "RCP unet3d_ref_28 as a LOWER BOUND: no RCP at global batch 2" in out and "(100 reference runs" in out
    assert "168 samples per epoch, evaluations from epoch 1000 every 20" in out
    assert "score (mean of 40 runs less the 4 fastest and 4 slowest)" in out


def test_the_printed_prediction_follows_from_the_printed_measurements(tmp_path, capsys):
    code, out, _ = bench(tmp_path, capsys, "--benchmark_steps", "2", "--warmup_steps", "1",
                         "--start_eval_at", "500", "--evaluate_every", "10")
    assert code == 0
    throughput = float(re.search(r"global batch 2 on 1 rank\(s\), ([\d.e+-]+) samples/s", out).group(1))
    eval_seconds = float(re.search(r"samples/s, ([\d.e+-]+) s per evaluation", out).group(1))
    assert "evaluations from epoch 500 every 10" in out
    # both inputs are printed to 4 significant digits: the prediction from the true values lies
    # between those from the printed ones' ends (more throughput and less evaluation is faster)
    schedule = T.Schedule(168, 500, 10)
    fast = T.predict(throughput + half_digit(throughput), eval_seconds - half_digit(eval_seconds), 2, schedule)
    slow = T.predict(throughput - half_digit(throughput), eval_seconds + half_digit(eval_seconds), 2, schedule)
    score = re.search(r"\): ([\d.]+ (?:min|h|days)) expected", out).group(1)
    mean = re.search(r"one run: mean ([\d.]+ (?:min|h|days))", out).group(1)
    for printed, lo, hi in ((score, fast.score_s, slow.score_s), (mean, fast.run_mean_s, slow.run_mean_s)):
        seconds, half = duration_seconds(printed)
        assert lo - half <= seconds <= hi + half, (printed, lo, hi)


def half_digit(x: float) -> float:
    """Half a unit in the last place of x printed with 4 significant digits."""
    return 0.5 * 10.0 ** (math.floor(math.log10(abs(x))) - 3)


def duration_seconds(text: str) -> tuple[float, float]:
    """duration_text's seconds back, and half a unit in its last printed place."""
    value, unit = text.split()
    scale = {"min": 60.0, "h": 3600.0, "days": 86400.0}[unit]
    decimals = len(value.split(".")[1]) if "." in value else 0
    return float(value) * scale, 0.5 * 10.0 ** -decimals * scale


def test_evaluate_benchmark_budget_and_evaluation_share(tmp_path, capsys):
    code, out, _ = bench(tmp_path, capsys, "--exec_mode", "evaluate", "--benchmark_steps", "2",
                         "--warmup_steps", "0")
    assert code == 0 and "(2 timed iterations)" in out
    assert "timing stopped after 2 timed volumes (--benchmark_steps 2)" in out
    seconds = float(re.search(r"evaluation: ([\d.e+-]+) s per evaluation of the 42 cases", out).group(1))
    throughput = float(re.search(r"throughput_eval: ([\d.]+) volumes/s", out).group(1))
    assert seconds == pytest.approx(42 / throughput, rel=0.02)
    assert "evaluations in one run: mean 54.7" in out          # the RCP at 28 on 168/1000/20


def test_a_budget_without_benchmark_is_refused_in_one_line(tmp_path, capsys):
    for flag in ("--benchmark_steps", "--benchmark_seconds"):
        code, _, err = call(TINY + ["--log_dir", str(tmp_path / "t"), flag, "3"], capsys)  # refused by the parser
        assert code == 2
        one_line_error(code, err, flag, "--benchmark", "--exec_mode train")


@pytest.mark.parametrize("flag, value", [("--benchmark_seconds", "0"), ("--benchmark_seconds", "inf"),
                                         ("--benchmark_seconds", "abc"), ("--benchmark_steps", "0"),
                                         ("--benchmark_steps", "1.5")])
def test_a_bad_budget_is_refused_in_one_line(tmp_path, capsys, flag, value):
    code, _, err = call(TINY + ["--benchmark", flag, value], capsys)
    assert code == 2
    one_line_error(code, err, flag)


@pytest.mark.parametrize("times, windows, volumes, total, expected", [
    ([2.0, 3.0], [4, 6], 2, 10, 5.0),          # every volume timed: measured
    ([2.0], [4], 3, 10, 5.0),                  # 0.5 s per window x 10 windows
    ([2.0], [4], 3, None, 6.0),                # shapes unknown: per volume
])
def test_an_evaluation_share_is_extrapolated_by_windows(times, windows, volumes, total, expected):
    assert share_seconds(times, windows, volumes, total) == pytest.approx(expected)


def test_budget_spent():
    assert Budget().spent(10**6, 1e9) is None and not Budget().given
    assert Budget(steps=3).spent(3, 0.0) == "--benchmark_steps 3" and Budget(steps=3).spent(2, 1e9) is None
    assert Budget(seconds=2.5).spent(1, 2.5) == "--benchmark_seconds 2.5"


@pytest.mark.slow
def test_two_ranks_stop_at_the_same_step_and_share_the_evaluation(tmp_path):
    """A time budget is spent at different moments on different ranks: rank 0 decides for all
    (DDP would hang on a rank that stepped alone); the evaluation pass is each rank's share."""
    from test_end_to_end import torchrun

    proc = torchrun(*TINY, "--benchmark", "--benchmark_seconds", "0.5", "--warmup_steps", "1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("throughput_train:") == 1                       # rank 0 speaks
    assert "(--benchmark_seconds 0.5" in proc.stdout
    assert re.search(r"evaluation: [\d.e+-]+ s per evaluation on 2 rank\(s\) \(\d+ of 42 evaluation volumes", proc.stdout)
    assert "global batch 4 on 2 rank(s)" in proc.stdout and "168 samples per epoch" in proc.stdout
