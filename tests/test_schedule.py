import math
from fractions import Fraction

import pytest

from runtime.training.latency import latency_summary
from runtime.schedule import eval_schedule, learning_rate_at, rules_schedule, samples_per_epoch


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


def test_samples_per_epoch_pads_the_last_batch_or_drops_it():
    # the rules: ceil(168 / global batch) * global batch, the global batch batch x world x ga
    assert samples_per_epoch(168, 1, 2) == 168
    assert samples_per_epoch(168, 1, 32) == 192
    assert samples_per_epoch(168, 8, 4) == 192
    assert samples_per_epoch(168, 5, 2) == 170
    assert samples_per_epoch(168, 1, 2, ga_steps=5) == 170
    assert samples_per_epoch(10, 4, 4) == 16
    # --last_batch drop: each rank's full batches of its shard, as before
    assert samples_per_epoch(168, 1, 32, last_batch="drop") == 160
    assert samples_per_epoch(168, 8, 4, last_batch="drop") == 160  # 21 per rank -> 5 batches of 4
    assert samples_per_epoch(168, 5, 2, last_batch="drop") == 160  # 33 per rank, 16 batches
    assert samples_per_epoch(10, 4, 4, last_batch="drop") == 0


def rules_text_schedule(global_batch):
    """The v4.0 rules' text ("Quality measure"), in exact fractions: samples_per_epoch =
    CEILING(168/global_batch_size) * global_batch_size; first evaluation at
    CEILING(1000*168/samples_per_epoch), every CEILING(20*168/samples_per_epoch), failed after
    CEILING(10000*168/samples_per_epoch)."""
    spe = math.ceil(Fraction(168, global_batch)) * global_batch
    return tuple(math.ceil(Fraction(k * 168, spe)) for k in (1000, 20, 10000))


@pytest.mark.parametrize("global_batch", [2, 16, 28, 32, 56, 64, 84, 128, 150])
def test_rules_schedule_is_the_rules_text(global_batch):
    schedule = rules_schedule(global_batch)
    assert (schedule.start_eval_at, schedule.evaluate_every, schedule.fail_epoch) == rules_text_schedule(global_batch)


def test_rules_schedule_known_values():
    # worked by hand: global batch 16 -> 176 samples per epoch; 64 -> 192; 150 -> 300
    assert rules_text_schedule(16) == (955, 20, 9546)
    assert rules_text_schedule(64) == (875, 18, 8750)
    assert rules_text_schedule(150) == (560, 12, 5600)  # a float ceil(10000 * (168 / 300)) says 5601
    assert rules_text_schedule(2) == rules_text_schedule(56) == (1000, 20, 10000)


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
