"""The MLPerf log in the units the official RCP checker reads: every ``epoch_num`` is samples
trained (epochs x samples trained per epoch, padding not counted), as the RCPs
(``rcps_unet3d.json``: samples to converge = epochs x 168) and real v4.0 unet3d logs count. Forty
logs written by the project's own logger code (the functions a run calls, the plan resolved from
the flags and the data's counts) pass ``python -m mlperf_logging.rcp_checker``; the same runs in
epoch indices (the unit logged before) fail it; and at global batch 64 (168 = 2 x 64 + 40: each
epoch pads 24 samples), runs 15% faster than the RCP fail it in samples trained, as they should,
while the padded count (the unit logged before) would have let them pass. A tiny run at a batch
that does not divide its training cases logs samples trained in every epoch_num, and passes the
compliance checker."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import mlperf_logging
from data_loading.source import DataSummary
from mlperf_logging.mllog import constants as C
from runtime.arguments import parse_args
from runtime.clocked.evaluation import eval_metadata
from runtime.distributed import DistInfo
from runtime.resolve import resolve, resolve_data
from runtime.run_log import MLPerfLogger

RCPS = os.path.join(os.path.dirname(mlperf_logging.__file__), "rcp_checker", "training_4.0.0", "rcps_unet3d.json")
KITS = DataSummary(168, 42)


def dist(world: int) -> DistInfo:
    return DistInfo(rank=0, local_rank=0, world_size=world, device=torch.device("cpu"))


def plan(index: int, world: int, batch: int, lr: str):
    """The run's plan as a run resolves it: the flags, then KiTS19's counts."""
    flags = ["--data_dir", "/", "--device", "cpu", "--batch_size", str(batch), "--learning_rate", lr,
             "--lr_warmup_epochs", "1000", "--seed", str(index), "--submission_division", "closed"]
    return resolve_data(resolve(parse_args(flags), dist(world)), dist(world), KITS)


def write_log(folder, index: int, epochs: int, unit: str, world: int = 4, batch: int = 7, lr: str = "2.0") -> None:
    """A run that converged at ``epochs`` (evaluated every 20 epochs before it), logged by
    ``MLPerfLogger`` and the loop's ``eval_metadata``; ``unit``: "samples" (the project's), or the
    units logged before: "epochs" (the epoch index), "padded" (epochs x the padded samples per
    epoch)."""
    cfg = plan(index, world, batch, lr)
    log = MLPerfLogger(str(folder), enabled=True, name=f"result_{index}.txt")
    log.submission_info(cfg)
    log.start(C.INIT_START)
    log.end(C.INIT_STOP)
    log.start(C.RUN_START)
    log.hyperparameters(cfg, world)
    for epoch in [e for e in range(20, epochs, 20)] + [epochs]:
        at = {"samples": eval_metadata(cfg, epoch), "epochs": {"epoch_num": epoch},
              "padded": {"epoch_num": epoch * cfg.training.samples_per_epoch}}[unit]
        log.start(C.EVAL_START, metadata=at)
        log.event(C.EVAL_ACCURACY, value=0.95 if epoch == epochs else 0.5, metadata=at)
        log.end(C.EVAL_STOP, metadata=at)
    log.end(C.RUN_STOP, metadata={"status": "success"})
    log.close()


def rcp_check(folder) -> tuple[int, str]:
    check = subprocess.run([sys.executable, "-m", "mlperf_logging.rcp_checker", str(folder), "--rcp_version", "4.0.0",
                            "--log_output", str(folder / "rcp.log")], capture_output=True, text=True, timeout=300,
                           cwd=folder)
    output = check.stdout + check.stderr + (folder / "rcp.log").read_text()
    assert "RCP found" in output or "RCP Interpolation" in output, output[-2000:]
    return check.returncode, output


def rcp_epochs(name: str) -> list[float]:
    """40 runs spread over an RCP's own distribution (every 2nd of its sorted values), in epochs of
    168 samples (the file counts samples trained: multiples of 168, or at global batch 64 of 64,
    its creator's steps of 64 real samples)."""
    with open(RCPS) as handle:
        converged = json.load(handle)[name]["Epochs to converge"]
    return [s / 168 for s in sorted(converged)[5:85:2]]


@pytest.mark.parametrize("samples", [True, False])
def test_forty_runs_pass_the_rcp_checker_in_samples_and_fail_in_epochs(tmp_path, samples):
    epochs = rcp_epochs("unet3d_ref_28")
    assert len(epochs) == 40 and all(e == int(e) for e in epochs)
    folder = tmp_path / ("samples" if samples else "epochs")
    folder.mkdir()
    for index, epoch in enumerate(np.random.default_rng(0).permutation(epochs)):
        write_log(folder, index, int(epoch), "samples" if samples else "epochs")
    code, output = rcp_check(folder)
    if samples:
        assert code == 0 and "RCP test PASSED" in output, output[-2000:]
    else:
        assert code != 0 and "RCP test FAILED" in output, output[-2000:]


@pytest.mark.parametrize("unit", ["samples", pytest.param("padded", marks=pytest.mark.slow)])
def test_runs_faster_than_the_rcp_fail_in_samples_trained_where_padding_hid_them(tmp_path, unit):
    """Global batch 64 on one process: 192 samples per epoch by the rules' formula, 168 trained.
    Runs that converge in 85% of the epochs of the RCP at 64 are too fast for the checker (which
    holds a run at 64 to the interpolation of its pruned RCPs at 56 and 84: at least 93% of their
    mean): it fails them in samples trained; counted with padding (192 per epoch, 14% more) they
    would have passed."""
    cfg = plan(0, 1, 64, "2.0")
    assert (cfg.training.samples_per_epoch, cfg.training.samples_trained_per_epoch) == (192, 168)
    folder = tmp_path / unit
    folder.mkdir()
    for index, epoch in enumerate(rcp_epochs("unet3d_ref_64")):
        write_log(folder, index, int(epoch * 0.85), unit, world=1, batch=64)
    code, output = rcp_check(folder)
    if unit == "samples":
        assert code != 0 and "RCP test FAILED" in output, output[-2000:]
    else:
        assert code == 0 and "RCP test PASSED" in output, output[-2000:]


def test_a_tiny_run_at_a_batch_that_does_not_divide_its_cases_logs_samples_trained(tmp_path, capsys):
    """8 training cases at batch 3 (the real loader pads each epoch to 9, weight 0 on the
    padding): epoch 2 has trained 16 samples, not 18. Every epoch_num of the MLPerf log counts
    samples trained; block_start's epoch_count counts epochs (its name); the log passes the
    official compliance checker (rulesets 4.0.0 and 2.1.0)."""
    import easy_data
    from runtime.app import run
    from runtime.results.compliance import check_compliance
    from runtime.results.validity import read_events

    # ids 0-11 but the evaluation ids 3, 5 and 6: 8 training cases, one evaluation case (00000)
    data = easy_data.write_dataset(str(tmp_path / "data"), [0, 1, 2, 4, 7, 8, 9, 10, 11])
    log_dir = tmp_path / "run"
    argv = ["--data_dir", data, "--log_dir", str(log_dir), "--seed", "3", "--filters", "2", "4", "4", "8", "8",
            "--input_shape", "32", "32", "32", "--val_input_shape", "32", "32", "32", "--normalization", "batchnorm",
            "--batch_size", "3", "--optimizer", "adam", "--learning_rate", "0.01", "--device", "cpu",
            "--num_workers", "0", "--epochs", "2", "--start_eval_at", "2", "--evaluate_every", "1",
            "--quality_threshold", "0.999", "--submission_division", "open", "--submission_org", "TinyOrg",
            "--submission_platform", "cpu-tiny"]
    assert run(parse_args(argv)) in (0, 3)
    capsys.readouterr()
    events = read_events(str(log_dir / "unet3d.log"))
    values = {e["key"]: e.get("value") for e in events}
    assert (values["train_samples"], values["samples_per_epoch"], values["samples_trained_per_epoch"]) == (8, 9, 8)
    metadata = [(e["key"], e.get("metadata") or {}) for e in events]
    numbered = [(key, m["epoch"], m["epoch_num"]) for key, m in metadata if "epoch_num" in m]
    assert {key for key, _, _ in numbered} >= {"epoch_start", "epoch_stop", "eval_start", "eval_accuracy", "eval_stop",
                                               "run_stop"}
    assert all(samples == 8 * epoch for _, epoch, samples in numbered), numbered
    assert ("eval_accuracy", 2, 16) in numbered  # the reproduction logged 18 here
    last = [m for key, m in metadata if key == "run_stop"][0]
    assert (last["epoch"], last["epoch_num"]) == (2, 16)
    blocks = [m for key, m in metadata if key == "block_start"]
    assert {k: blocks[0][k] for k in ("first_epoch_num", "epoch_count", "first_epoch")} == {
        "first_epoch_num": 8, "epoch_count": 2, "first_epoch": 1}
    assert all(b["first_epoch_num"] == 8 * b["first_epoch"] for b in blocks)
    for ruleset in ("4.0.0", "2.1.0"):
        verdict = check_compliance(str(log_dir / "unet3d.log"), ruleset)
        assert verdict.checked and verdict.problems in ([], ()) or all("eval_accuracy" in p for p in verdict.problems), \
            verdict.problems
