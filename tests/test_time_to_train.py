"""The predicted MLPerf time to train: the published 8xH200 anchor, the RCPs as the installed
mlperf-logging ships them, the schedule's evaluations and the 40-run score rule, with known
answers (the published v4.0 results, mlcommons/training_results_v4.0, as docs/time-to-train.md
quotes them; enumeration, numpy)."""
import itertools
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from runtime.results import time_to_train as T

ROOT = Path(__file__).resolve().parents[1]

# MLPerf Training v4.0, NVIDIA 8 x H200 (MXNet), global batch 56 (mlperf-results.md): score
# 11.46 min, training at 608 samples/s, 1.67 s per evaluation (median), 168 samples per epoch,
# evaluations from epoch 1000 every 20 (MLPerf's schedule at 168 samples per epoch).
H200 = dict(train_throughput=608.0, eval_seconds=1.67, global_batch=56, world_size=8)
H200_SCORE_MIN = 11.46


def test_the_published_8xh200_score_is_predicted_within_5_percent():
    schedule = T.Schedule(samples_per_epoch=168, start_eval_at=1000, evaluate_every=20)
    p = T.predict(schedule=schedule, **H200)
    assert p.rcp.global_batch == 56 and len(p.rcp.samples) == 197      # the doc: 197 runs at batch 56
    assert abs(p.score_s / 60 / H200_SCORE_MIN - 1) < 0.05
    assert abs(p.run_mean_s / 60 / H200_SCORE_MIN - 1) < 0.05
    # the score is the mean of 32 of 40 runs: its band is narrower than one run's
    low, high = p.run_band_s
    assert low < p.score_band_s[0] < p.score_s < p.score_band_s[1] < high
    # 2140 mean epochs (the doc) on that schedule: 58 evaluations in a mean run
    assert p.mean_of("evaluations") == pytest.approx((2140 - 1000) / 20 + 1, abs=0.1)


def test_the_rcps_are_the_installed_packages_and_match_the_published_facts():
    path = T.rcp_path()
    import mlperf_logging

    assert Path(str(path)).resolve().is_relative_to(Path(mlperf_logging.__file__).resolve().parent)
    epochs = np.array(T.load_rcps()[56].epochs)
    # mlperf-results.md: mean 2140 epochs, median 2120, standard deviation 475 at global batch 56
    assert epochs.mean() == pytest.approx(2140, abs=1) and np.median(epochs) == 2120
    assert epochs.std(ddof=1) == pytest.approx(475, abs=1)
    assert sorted(T.load_rcps()) == [28, 56, 64, 84]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert not [name for name in tracked if name.endswith(T.RCP_FILE)]     # never a vendored copy


def test_the_score_rule_is_mlperfs_for_unet3d():
    from mlperf_logging.rcp_checker import rcp_checker

    assert T.SUBMISSION_RUNS == rcp_checker.submission_runs["training"]["unet3d"] == 40
    assert T.DROPPED_EACH_END == 4


@pytest.mark.parametrize("batch, kind, basis", [
    (28, T.MEASURED, (28,)), (56, T.MEASURED, (56,)), (64, T.MEASURED, (64,)), (84, T.MEASURED, (84,)),
    (40, T.INTERPOLATED, (28, 56)), (29, T.INTERPOLATED, (28, 56)),
    (60, T.INTERPOLATED, (56, 84)), (70, T.INTERPOLATED, (56, 84)),  # 64 is pruned: its mean is above the line
    (2, T.LOWER_BOUND, (28,)), (16, T.LOWER_BOUND, (28,)), (1, T.LOWER_BOUND, (28,)),
])
def test_the_rcp_of_a_global_batch_is_its_own_interpolated_or_a_lower_bound(batch, kind, basis):
    """What the official checker holds a run at each global batch to (rcp_checker.check_directory):
    its RCP; the two around it among the pruned RCPs; below the smallest, the smallest."""
    from mlperf_logging.rcp_checker import rcp_checker

    rcp = T.rcp_for(T.load_rcps(), batch)
    assert rcp.kind == kind
    assert (rcp.between if kind == T.INTERPOLATED else (rcp.global_batch,)) == basis
    checker = rcp_checker.RCP_Checker("training", "4.0.0", "unet3d", False)
    if kind == T.INTERPOLATED:
        low = checker._find_top_min_rcp(batch, "pruned_rcps")["BS"]
        high = checker._find_bottom_max_rcp(batch, "pruned_rcps")["BS"]
        assert (low, high) == basis
    elif kind == T.LOWER_BOUND:
        assert checker._find_top_min_rcp(batch, "pruned_rcps") is None
        assert checker._find_min_rcp("pruned_rcps")["BS"] == basis[0]
    assert T.rcp_basis(rcp, batch).startswith({T.MEASURED: "RCP at", T.INTERPOLATED: "interpolated",
                                               T.LOWER_BOUND: "a lower bound"}[kind])


@pytest.mark.parametrize("batch", [85, 500])
def test_above_the_largest_rcp_there_is_no_prediction(batch):
    with pytest.raises(T.TimeToTrainError, match=f"no RCP at global batch {batch} or above.*Missing RCP"):
        T.rcp_for(T.load_rcps(), batch)


def _rcp_file(tmp_path, means: dict[int, int]) -> Path:
    """An RCP file of 12 runs per global batch around each mean (samples, multiples of 168)."""
    offsets = [-5, -4, -3, -2, -1, 0, 0, 1, 2, 3, 4, 5]
    records = {f"unet3d_ref_{batch}": {"Benchmark": "unet3d", "BS": batch, "Hyperparams": {},
                                       "Epochs to converge": [(mean + 40 * o) * 168 for o in offsets]}
               for batch, mean in means.items()}
    path = tmp_path / "rcps_unet3d.json"
    path.write_text(json.dumps(records))
    return path


@pytest.mark.parametrize("means, kept", [
    (None, [28, 56, 84]),                                                # the installed file: 64 pruned
    ({8: 2300, 16: 2000, 32: 2400, 48: 2200, 64: 2500}, [16, 48, 64]),  # 8 slower than 16; 32 above 16-48
    ({16: 2000, 24: 2020, 32: 2080, 40: 2300}, [16, 24, 32, 40]),       # convex: all kept
])
def test_pruning_is_the_official_checkers(tmp_path, means, kept):
    from mlperf_logging.rcp_checker import rcp_checker

    path = Path(str(T.rcp_path())) if means is None else _rcp_file(tmp_path, means)
    with open(path) as handle:
        checker = rcp_checker.RCP_Checker("training", "4.0.0", "unet3d", False, rcp_file=handle)
    assert sorted(record["BS"] for record in checker.pruned_rcp_data.values()) == kept
    assert sorted(T.pruned(T.load_rcps(path))) == kept


@pytest.mark.parametrize("batch, low, high", [(30, 28, 56), (40, 28, 56), (60, 56, 84), (70, 56, 84), (83, 56, 84)])
def test_an_interpolated_rcp_has_the_checkers_interpolated_mean_and_spread(batch, low, high):
    from mlperf_logging.rcp_checker import rcp_checker

    checker = rcp_checker.RCP_Checker("training", "4.0.0", "unet3d", False)
    by_batch = {record["BS"]: record for record in checker.rcp_data.values()}
    _, official = checker._create_interp_rcp(batch, by_batch[low], by_batch[high])
    rcp = T.rcp_for(T.load_rcps(), batch)
    assert rcp.name == f"unet3d_interp_{batch}" and rcp.between == (low, high)
    assert T.olympic_mean(rcp.samples) == pytest.approx(official["RCP Mean"], rel=0.005)
    assert float(np.std(rcp.samples)) == pytest.approx(official["RCP Stdev"], rel=0.03)
    assert T.olympic_mean(T.load_rcps()[56].samples) == pytest.approx(by_batch[56]["RCP Mean"])


def test_the_prediction_at_global_batch_2_says_it_is_a_lower_bound_from_batch_28():
    """No 4.0.0 RCP at global batch 2: never silently batch 28's."""
    p = T.predict(1.0, 100.0, 2, T.Schedule(168, 1000, 20))
    assert p.rcp.kind == T.LOWER_BOUND and p.rcp.global_batch == 28
    text = "\n".join(T.prediction_lines(p, [28, 56, 64, 84]))
    assert "RCP unet3d_ref_28 as a LOWER BOUND: no RCP at global batch 2 (mlperf-logging training_4.0.0 has " \
           "them at 28, 56, 64, 84)" in text
    lines = T.prediction_lines(p, [28, 56, 64, 84])
    assert lines[2].endswith("; a lower bound") and lines[3].endswith("; a lower bound")  # one run, the score
    assert p.as_dict()["rcp_kind"] == T.LOWER_BOUND and "lower bound" in p.as_dict()["rcp_basis"]
    share = "\n".join(T.evaluation_share_lines(3.0, 2, T.Schedule(168, 1000, 20)))
    assert share.endswith("; a lower bound") and "LOWER BOUND: no RCP at global batch 2" in share


@pytest.mark.parametrize("spe, start, every, samples, epoch, evaluations", [
    (168, 1000, 20, 2380 * 168, 2380, 70),      # on the grid
    (168, 1000, 20, 2380 * 168 + 1, 2400, 71),  # one sample more: the next evaluation
    (168, 1000, 20, 10 * 168, 1000, 1),         # before the first evaluation: converged there
    (128, 1313, 27, 504000, 3959, 99),          # 3937.5 epochs of 128: epoch 3938, then 1313 + k*27
    (8, 2, 420, 8, 2, 1),                       # --start_eval_at 2 on tiny data: the first evaluation is 2
])
def test_a_run_converges_at_the_first_evaluation_after_its_samples(spe, start, every, samples, epoch, evaluations):
    from runtime.schedule import EvalSchedule
    from runtime.training.loop import eval_schedule_of

    schedule = T.Schedule(spe, start, every)
    assert schedule.converged_epoch(samples) == epoch and schedule.evaluations(epoch) == evaluations
    # the training loop's own decisions: the epochs it evaluates, from the run's config
    cfg = type("Cfg", (), dict(start_eval_at=start, evaluate_every=every, fail_epoch=10 ** 6))
    loop = eval_schedule_of(cfg)
    assert isinstance(loop, EvalSchedule)
    evaluated = [e for e in range(1, epoch + 1) if loop.is_eval_epoch(e)]
    first_after = next(e for e in range(-(-samples // spe), epoch + 1) if loop.is_eval_epoch(e))
    assert (first_after, len(evaluated)) == (epoch, evaluations)
    assert schedule.first_eval_epoch == evaluated[0]
    run = T.run_time(samples, schedule, train_throughput=spe * 2.0, eval_seconds=3.0)
    assert run.train_seconds == pytest.approx(epoch / 2.0) and run.eval_seconds == pytest.approx(3.0 * evaluations)


def test_a_padded_epoch_converges_by_samples_trained_and_takes_the_time_of_samples_computed():
    """Global batch 64 by the rules' schedule (192 samples an epoch, 168 of them trained): an RCP
    run of 2000 epochs of 168 samples converges at the first evaluation at or after epoch 2000
    (875 + 63 x 18 = 2009), not after 1750 epochs of 192; each epoch computes 192 samples."""
    schedule = T.Schedule(192, 875, 18, 168)
    assert schedule.converged_epoch(2000 * 168) == 2009 and schedule.evaluations(2009) == 64
    run = T.run_time(2000 * 168, schedule, train_throughput=192.0, eval_seconds=2.0)
    assert run.train_seconds == pytest.approx(2009.0) and run.eval_seconds == pytest.approx(128.0)
    assert "192 samples per epoch (168 trained" in T.schedule_text(schedule)
    assert T.Schedule(168, 1000, 20).trained_per_epoch == 168  # no padding: the same count


def _enumerated_trimmed_mean(values, runs, drop):
    total = 0.0
    for draw in itertools.product(values, repeat=runs):          # every draw equally likely
        kept = sorted(draw)[drop:runs - drop]
        total += sum(kept) / len(kept)
    return total / len(values) ** runs


@pytest.mark.parametrize("values, runs, drop", [([1.0, 2.0], 3, 1), ([1.0, 2.0, 4.0], 4, 1),
                                                ([3.0, 1.0, 1.0, 7.0], 5, 2), ([5.0, 2.0, 9.0], 5, 1)])
def test_expected_trimmed_mean_equals_enumeration(values, runs, drop):
    assert T.expected_trimmed_mean(values, runs, drop) == pytest.approx(_enumerated_trimmed_mean(values, runs, drop))


def test_expected_trimmed_mean_of_a_coin_is_the_median_of_three():
    assert T.expected_trimmed_mean([1.0, 2.0], runs=3, drop=1) == pytest.approx(1.5)


def test_score_band_brackets_the_expectation_and_is_reproducible():
    values = list(np.random.default_rng(1).gamma(4.0, 500.0, size=150))
    band = T.trimmed_mean_band(values)
    assert band == T.trimmed_mean_band(values)
    assert band[0] < T.expected_trimmed_mean(values) < band[1]


@pytest.mark.parametrize("q", [0, 5, 37.5, 50, 95, 100])
def test_percentile_is_numpys_linear(q):
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    assert T.percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_unreadable_rcps_and_bad_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(T.TimeToTrainError, match="missing.json"):
        T.load_rcps(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"x": {"Benchmark": "unet3d", "BS": 2}}')
    with pytest.raises(T.TimeToTrainError, match="bad.json"):
        T.load_rcps(tmp_path / "bad.json")
    schedule = T.Schedule(168, 1000, 20)
    for bad in (0.0, float("nan"), -1.0):
        with pytest.raises(T.TimeToTrainError, match="training throughput"):
            T.predict(bad, 1.0, 56, schedule)


def test_prediction_text_names_the_rcp_the_band_and_the_rule():
    p = T.predict(schedule=T.Schedule(168, 1000, 20), **H200)
    text = "\n".join(T.prediction_lines(p, [28, 56, 64, 84]))
    assert "global batch 56 on 8 rank(s)" in text and "unet3d_ref_56 (197 reference runs" in text
    assert "mean of 40 runs less the 4 fastest and 4 slowest" in text and "5th-95th percentile" in text
    assert f"{p.score_s / 60:.2f} min expected" in text
    small = "\n".join(T.prediction_lines(T.predict(1.0, 100.0, 40, T.Schedule(168, 1000, 20)), [28, 56]))
    assert "RCP unet3d_interp_40: no RCP at global batch 40" in small and "between those at 28 and 56" in small
    assert " days" in small


@pytest.mark.parametrize("semantics", ["reference", "project"])
def test_benchmark_predicts_the_evaluations_the_loop_makes_under_either_semantics(tmp_path, semantics):
    from runtime.arguments import parse_args
    from checkpoints import flags_plan
    from runtime.training.benchmark import benchmark_schedule

    flags = ["--data_dir", str(tmp_path), "--batch_size", "128", "--start_eval_at", "1313", "--evaluate_every", "27",
             "--semantics", semantics]
    # the rules' padded last batch: 256 samples an epoch, but 168 trained (padding weighs 0): epoch
    # 3000 has trained 504000, then 1313 + 63 * 27 (counting the padding, 1969 and 1988, was wrong)
    padded = benchmark_schedule(flags_plan(parse_args(flags)), world_size=1)
    assert (padded.samples_per_epoch, padded.trained_per_epoch) == (256, 168)
    assert padded.converged_epoch(504000) == 3014
    # the reference's drop: 128 an epoch, epoch 3938 trains them, then 1313 + 98 * 27
    drop = benchmark_schedule(flags_plan(parse_args([*flags, "--last_batch", "drop"])), world_size=1)
    assert drop.converged_epoch(504000) == 3959


def test_the_report_package_imports_no_numpy_for_the_prediction():
    code = ("import sys; import runtime.results.time_to_train as t; "
            "assert 'numpy' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    subprocess.run([os.environ.get("PYTHON", __import__("sys").executable), "-c", code], cwd=ROOT, check=True)
