import pytest

from runtime.training.latency import latency_summary
from runtime.schedule import eval_schedule, learning_rate_at, samples_per_epoch


def test_warmup_is_linear_from_init():
    # lr = init + (lr - init) * epoch / warmup for epochs 1..warmup
    assert learning_rate_at(1, 0.8, 1e-4, 200) == pytest.approx(1e-4 + (0.8 - 1e-4) / 200)
    assert learning_rate_at(100, 0.8, 1e-4, 200) == pytest.approx(1e-4 + (0.8 - 1e-4) * 0.5)
    assert learning_rate_at(200, 0.8, 1e-4, 200) == pytest.approx(0.8)
    assert learning_rate_at(201, 0.8, 1e-4, 200) == 0.8


def test_no_warmup_and_multistep_decay():
    lrs = [learning_rate_at(e, 1.0, 1e-4, 0, (3, 5), 0.1) for e in range(1, 8)]
    # MultiStepLR stepped after each epoch: milestone 3 applies from epoch 4, milestone 5 from 6
    assert lrs == pytest.approx([1.0, 1.0, 1.0, 0.1, 0.1, 0.01, 0.01])


def test_samples_per_epoch_drops_incomplete_batches():
    assert samples_per_epoch(168, 1, 2) == 168
    assert samples_per_epoch(168, 1, 32) == 160
    assert samples_per_epoch(168, 8, 4) == 160  # 21 per rank -> 5 batches of 4
    assert samples_per_epoch(168, 5, 2) == 160  # 33 per rank (no padding duplicates), 16 batches
    assert samples_per_epoch(10, 4, 4) == 0


@pytest.mark.parametrize("global_batch, first, every", [(32, 1050, 21), (128, 1313, 27), (2, 1000, 20)])
def test_eval_schedule_spec_examples(global_batch, first, every):
    spe = samples_per_epoch(168, 1, global_batch)
    schedule = eval_schedule(spe)
    assert (schedule.start_eval_at, schedule.evaluate_every) == (first, every)


def test_eval_schedule_explicit_values_win_and_epochs():
    schedule = eval_schedule(168, 168, start_eval_at=3, evaluate_every=2)
    assert [e for e in range(1, 10) if schedule.is_eval_epoch(e)] == [3, 5, 7, 9]   # start, then every 2
    assert [schedule.evaluations_through(e) for e in (2, 3, 4, 9)] == [0, 1, 1, 4]
    with pytest.raises(ValueError):
        eval_schedule(0)


def test_latency_summary_known_values():
    s = latency_summary([0.1] * 9 + [1.0], items_per_iteration=4)
    assert s["throughput"] == pytest.approx(40 / 1.9)
    assert s["latency_mean_ms"] == pytest.approx(190.0)
    assert s["latency_p99_ms"] == pytest.approx(919.0)  # numpy linear: 0.1 + 0.91 * (1.0 - 0.1)
    with pytest.raises(ValueError):
        latency_summary([], 1)


def test_next_eval_epoch():
    from runtime.schedule import EvalSchedule
    from runtime.training.loop import next_eval_epoch

    schedule = EvalSchedule(start_eval_at=10, evaluate_every=4, fail_epoch=100)
    assert [next_eval_epoch(e, schedule, 30) for e in (1, 9, 10, 11, 13, 14, 15)] == [10, 10, 10, 14, 14, 14, 18]
    assert next_eval_epoch(27, schedule, 28) == 28        # no evaluation left: the last epoch
    assert next_eval_epoch(1, EvalSchedule(50, 5, 100), 20) == 20


@pytest.mark.parametrize("epoch,loss,dice,expected", [
    (5, 0.5, None, None),                                 # not evaluated: go on
    (5, 0.5, 0.5, None),                                  # evaluated, below target
    (5, 0.5, 0.908, "success"),                           # the target is >=
    (5, float("nan"), 0.95, "success"),                   # reaching the target wins
    (5, float("nan"), None, "aborted"),                   # diverged loss
    (5, float("inf"), 0.5, "aborted"),
    (5, 0.5, 5e-7, "aborted"),                            # diverged Dice
    (40, 0.5, None, "aborted"),                           # the MLPerf fail epoch
    (40, 0.5, 0.5, "aborted"),
    (39, 0.5, 0.5, None),
])
def test_run_status(epoch, loss, dice, expected):
    from runtime.training.loop import run_status

    status, why = run_status(epoch, loss, dice, fail_epoch=40, quality_threshold=0.908)
    assert status == expected
    assert bool(why) == (status == "aborted")
