"""The MLPerf log in the units the official RCP checker reads: ``eval_accuracy``'s ``epoch_num`` is
samples trained (epochs x samples_per_epoch), as the RCPs (``rcps_unet3d.json``) and real v4.0
unet3d logs count. Forty logs written by the project's own logger code (the functions a run calls)
pass ``python -m mlperf_logging.rcp_checker``; the same runs in epoch indices (the unit logged
before) fail it."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import mlperf_logging
from mlperf_logging.mllog import constants as C
from runtime.arguments import parse_args, replace
from runtime.clocked.evaluation import eval_metadata
from runtime.distributed import DistInfo
from runtime.resolve import resolve
from runtime.run_log import MLPerfLogger
from runtime.schedule import samples_per_epoch

RCPS = os.path.join(os.path.dirname(mlperf_logging.__file__), "rcp_checker", "training_4.0.0", "rcps_unet3d.json")
CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
WORLD, BATCH = 4, 7  # global batch 28, which the 4.0.0 RCPs have


def write_log(folder, index: int, epochs: int, samples: bool) -> None:
    """A run that converged at ``epochs`` (evaluated every 20 epochs before it), logged by
    ``MLPerfLogger`` and the loop's ``eval_metadata``; ``samples=False``: the epoch index as
    ``epoch_num`` (the old unit)."""
    spe = samples_per_epoch(168, WORLD, BATCH)
    cfg = replace(resolve(parse_args(["--data_dir", "/", "--device", "cpu", "--batch_size", str(BATCH),
                                      "--learning_rate", "2.0", "--lr_warmup_epochs", "1000", "--seed", str(index)]),
                          CPU),
                  num_train_cases=168, num_eval_cases=42, samples_per_epoch=spe, submission_division="closed")
    log = MLPerfLogger(str(folder), enabled=True, name=f"result_{index}.txt")
    log.submission_info(cfg)
    log.start(C.INIT_START)
    log.end(C.INIT_STOP)
    log.start(C.RUN_START)
    log.hyperparameters(cfg, WORLD)
    for epoch in [e for e in range(20, epochs, 20)] + [epochs]:
        at = eval_metadata(cfg, epoch) if samples else {"epoch_num": epoch}
        log.start(C.EVAL_START, metadata=at)
        log.event(C.EVAL_ACCURACY, value=0.95 if epoch == epochs else 0.5, metadata=at)
        log.end(C.EVAL_STOP, metadata=at)
    log.end(C.RUN_STOP, metadata={"status": "success"})
    log.close()


def rcp_check(folder) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlperf_logging.rcp_checker", str(folder), "--rcp_version", "4.0.0",
                           "--log_output", str(folder / "rcp.log")], capture_output=True, text=True, timeout=300,
                          cwd=folder)


@pytest.mark.parametrize("samples", [True, False])
def test_forty_runs_pass_the_rcp_checker_in_samples_and_fail_in_epochs(tmp_path, samples):
    with open(RCPS) as handle:
        converged = json.load(handle)["unet3d_ref_28"]["Epochs to converge"]  # samples, multiples of 168
    # 40 runs spread over the RCP's own distribution (every 2nd of its sorted values), in epochs
    epochs = [s // 168 for s in sorted(converged)[5:85:2]]
    assert len(epochs) == 40 and all(s % 168 == 0 for s in converged)
    folder = tmp_path / ("samples" if samples else "epochs")
    folder.mkdir()
    for index, epoch in enumerate(np.random.default_rng(0).permutation(epochs)):
        write_log(folder, index, int(epoch), samples)
    check = rcp_check(folder)
    output = check.stdout + check.stderr + (folder / "rcp.log").read_text()
    assert "RCP found" in output, output[-2000:]
    if samples:
        assert check.returncode == 0 and "RCP test PASSED" in output, output[-2000:]
    else:
        assert check.returncode != 0 and "RCP test FAILED" in output, output[-2000:]
