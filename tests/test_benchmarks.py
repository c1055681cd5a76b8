"""Every benchmark runs as ``python -m benchmarks.NAME`` from the repository root and prints its
table (tiny smoke shapes; run as child processes: no test imports the benchmarks); the benchmarks
keep the harness's rules (no ``sys.path`` bootstraps); the FLOP count reproduces the spec's."""
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_loading.dataset import read_evaluation_ids
from test_mlcommons_reference import write_stand_in

ROOT = Path(__file__).resolve().parents[1]
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def bench(*argv, timeout=600, env=ONE_THREAD) -> str:
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc.stdout


def row(text: str, name: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def write_cases(folder: Path, evaluation: int = 0, side: int = 64) -> str:
    """Two training cases (and ``evaluation`` evaluation cases) of ``side``³: a kidney cube with a tumour."""
    folder.mkdir(parents=True, exist_ok=True)
    ev = read_evaluation_ids()
    ids = [f"{i:05d}" for i in range(100) if f"{i:05d}" not in set(ev)][:2] + ev[:evaluation]
    for n, case in enumerate(ids):
        label = np.zeros((1, side, side, side), np.uint8)
        label[0, 10:40, 10:40, 10:40], label[0, 15:25, 15:25, 15:25] = 1, 2
        image = np.random.default_rng(n).standard_normal(label.shape).astype(np.float32) + label
        np.save(folder / f"case_{case}_x.npy", image)
        np.save(folder / f"case_{case}_y.npy", label)
    return str(folder)


def test_no_test_imports_the_benchmarks_and_no_benchmark_bootstraps_the_path():
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "benchmarks" for n in names), path
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        text = path.read_text()
        assert "sys.path" not in text and "E402" not in text, path


def test_flop_count_reproduces_the_spec_and_scales_with_voxels():
    """954.6 GFLOP forward and 2.86 TFLOP with backward per 128³ sample (the spec's count);
    convolutions scale with voxels (64³: an eighth; with backward nearly, the first layer has no
    input gradient)."""
    counts = [[int(v) for v in re.findall(r"(\d+) FLOP", bench("benchmarks.harness", "flops", *[str(s)] * 3))]
              for s in (128, 64)]
    (forward, total), (small_forward, small_total) = counts
    assert abs(forward - 955e9) / 955e9 < 0.01 and abs(total - 2.86e12) / 2.86e12 < 0.01
    assert small_forward * 8 == forward and abs(small_total * 8 - total) / total < 1e-3


def test_the_convolution_floor_counts_every_convolution_of_a_step_once():
    """The convolution floor's layers (``bench_train_lockstep --child_conv layers SIDE BATCH``, untimed): the
    network's 23 convolutions and 5 transposed ones at their shapes in a 64³ step of batch 2, their GFLOP the
    network's (FlopCounterMode: 357521031168 FLOP per 64³ sample, ``python -m benchmarks.harness flops 64 64 64``),
    the six of the 320-filter blocks in NCDHW in float32, the four upsampling blocks' first after their
    concatenation split."""
    layers = json.loads(bench("benchmarks.bench_train_lockstep", "--child_conv", "layers", "64", "2"))
    assert len(layers) == 28 and sum("upsample_conv" in name for name, *_ in layers) == 5
    assert all(count == 1 and shape[0] == 2 for _, shape, count, *_ in layers)
    assert layers[0][:4] == ["input_block.conv1.0", [2, 1, 64, 64, 64], 1, 2 * 2 * 32 * 27 * 64 ** 3 * 2 / 1e9]
    assert sum(count * gflop for _, _, count, gflop, _, _ in layers) == pytest.approx(2 * 357.521031168, rel=1e-9)
    assert [name for name, *_, ncdhw, _ in layers if ncdhw] == [
        "downsample.3.conv1.0", "downsample.3.conv2.0", "bottleneck.conv1.0", "bottleneck.conv2.0",
        "upsample.0.conv1.0", "upsample.0.conv2.0"]
    assert [name for name, *_, split in layers if split] == [f"upsample.{i}.conv1.0" for i in range(1, 5)]


@pytest.mark.slow
def test_pipeline(tmp_path):
    out = bench("benchmarks.bench_pipeline", "--cases", "2", "--shape", "100", "100", "100", "--patch", "64",
                "--samples", "4", "--naive_samples", "2", "--dir", str(tmp_path))
    assert row(out, "naive (reference-like, 1 process)")[2] == "1.0x"
    for name in ("cache none, 0 workers", "cache memory, 2 workers", "cache device, torch path on CPU"):
        assert float(row(out, name)[1]) > 0 and row(out, name)[2].endswith("x")


@pytest.mark.slow
def test_preprocess():
    out = bench("benchmarks.bench_preprocess", "--cases", "2", "--size", "small", "--repeats", "2")
    assert row(out, "1 workers")[3] == "1.00x" and float(row(out, "2 workers")[2]) > 0
    assert "round 2 2 workers" in out and "python -m benchmarks.bench_preprocess" in out


@pytest.mark.slow
def test_train_lockstep(tmp_path):
    out = bench("benchmarks.bench_train_lockstep", "--data_dir", write_cases(tmp_path / "data"), "--variants",
                "fp32,fast", "--shapes", "64x1", "--rounds", "2", "--steps", "1", "--warmup_steps", "1",
                "--conv_side", "16", "--threads", "1", "--work", str(tmp_path / "work"), "--per_layer",
                "--isa", "AVX2")   # float32 channels-last on every CPU: the floor's float32-only paths run
    assert row(out, "fp32")[2] == "1.00x" and row(out, "fp32")[7] == "float32"
    fast = row(out, "fast")
    assert float(fast[1]) > 0 and fast[2].endswith("x") and ("of float32_cl" in fast[4] or "of bfloat16_cl" in fast[4])
    for cells in (row(out, "fp32"), fast):   # the convolution floor: seconds (share of the step), ceiling
        assert re.fullmatch(r"\d+\.\d\d \(\d+%\)", cells[5]) and float(cells[5].split()[0]) > 0, cells
        assert cells[6].endswith("x") and float(cells[6][:-1]) > 0, cells
    assert "## AVX2, threads 1: convolution rate" in out and "ISA:" in out.splitlines()[0]
    # the floor layer by layer: its FLOPs are the network's as torch's FlopCounterMode counts them
    assert "of float32_cl" in fast[4]
    for key in ("float32", "float32_cl"):
        line = re.search(rf"convolution floor {key}: (\d+\.\d\d) s, \d+ GFLOP/s; its layers (\d+)-(\d+) GFLOP/s; "
                         rf"every layer at the best one's rate: (\d+\.\d\d) s \(fp32's step / that: \d+\.\d\dx\)", out)
        assert line and int(line[2]) <= int(line[3]) and 0 < float(line[4]) <= float(line[1]), key
    layers = [line.split("|")[1:-1] for line in out.splitlines() if re.match(r"\| (input_block|downsample|bottleneck|upsample|output)", line)]
    assert len(layers) == 2 * 28   # 23 convolutions and 5 transposed ones, in each of the two types
    counted = int(re.findall(r"(\d+) FLOP", bench("benchmarks.harness", "flops", "64", "64", "64"))[1]) / 1e9
    for part in (layers[:28], layers[28:]):
        assert sum(int(cells[2]) * float(cells[3]) for cells in part) == pytest.approx(counted, rel=1e-4)


def test_convergence_comparison_known_answers():
    """The exact Mann-Whitney U p-value: 3 seeds against 3 wholly apart is 2/20 (never below 5%),
    4 against 4 wholly apart is 2/70; overlapping epochs are not told apart."""
    def p_value(*pairs):
        out = bench("benchmarks.bench_convergence", "--compare", *pairs)
        return float(re.search(r"p = ([0-9.]+)", out).group(1)), out
    assert p_value("a=1,2,3", "b=4,5,6")[0] == 0.1
    p, out = p_value("a=1,2,3,4", "b=5,6,7,8")
    assert p == 0.029 and "told apart at the 5% level" in out and "a: epochs [1, 2, 3, 4], 4 of 4 reached the target, mean 2.5" in out
    p, out = p_value("fp32=16,52,16", "fast=34,40,42")
    assert p > 0.05 and "not told apart" in out
    p, out = p_value("a=1,2,3,x", "b=5,6,7,8")         # a run that never reached ranks last
    assert p == 0.343 and "a: epochs [1, 2, 3, x], 3 of 4 reached the target, mean 2.0" in out
    # paired by seed: b slower for 3 seeds, faster for 1, a tie (both not reached): 2 * 5/16
    out = bench("benchmarks.bench_convergence", "--compare", "a=10,20,30,40,x", "b=11,21,31,39,x")
    assert "b needed more epochs than a for 3 seeds, fewer for 1, as many for 1; sign test (exact, two-sided) p = 0.625" in out


@pytest.mark.slow
def test_convergence(tmp_path):
    out = bench("benchmarks.bench_convergence", "--data_dir", write_cases(tmp_path / "data", evaluation=1),
                "--seeds", "0", "--settings", "fp32", "--epochs", "1", "--work", str(tmp_path / "work"))
    cells = row(out, "0")
    # one epoch ends the run below the target: not reached, and the summary counts it so
    assert cells[1] == "fp32" and cells[2] == "finished" and cells[3] == "not reached", out
    assert "fp32: epochs [x], 0 of 1 reached the target" in out


@pytest.mark.slow
def test_predict_against_the_stand_in_reference(tmp_path):
    """torch fp32 against the mlcommons variant (a stand-in reference tree: a constant network)."""
    out = bench("benchmarks.bench_predict", "--reference_code", write_stand_in(tmp_path / "ref"), "--variants",
                "mlcommons,torch_fp32", "--shape", "64", "96", "96", "--resampled", "64", "96", "96", "--filters", "4",
                "8", "16", "32", "32", "--roi", "64", "--rounds", "2", "--workdir", str(tmp_path / "work"))
    mlcommons, torch_fp32 = row(out, "mlcommons"), row(out, "torch_fp32")
    assert mlcommons[2] == torch_fp32[2] == "27"                   # windows, from predict's summary
    assert mlcommons[4] == "1.00x" and mlcommons[7] == "100.000%" and float(torch_fp32[3]) > 0
    assert torch_fp32[4].endswith("x") and "round 2 torch_fp32" in out
    # predict's stage seconds: inferring apart from the other stages, each part of the scan's total
    assert 0 < float(torch_fp32[9]) < float(torch_fp32[3]) and 0 <= float(torch_fp32[10]) < float(torch_fp32[3])


RUN_CHILD = """
import json, os, sys, time
from pathlib import Path
from benchmarks.harness import run_child
log = Path(sys.argv[1])
wall, _, code, text = run_child([sys.executable, "-c", "import sys; print('said'); sys.exit(3)"], log)
out = [code, text.strip()]
wall, _, code, text = run_child(["bash", "-c", "sleep 60 & echo $!; wait"], log, timeout=2)
grandchild = int(text.split()[0])
for _ in range(50):   # the background sleep, a child of the killed bash: stopped too
    try:
        os.kill(grandchild, 0)
        time.sleep(0.1)
    except ProcessLookupError:
        break
else:
    grandchild = "alive"
print(json.dumps(out + [code, wall < 30, grandchild != "alive"]))
"""


def test_run_child_exit_code_output_and_timeout(tmp_path):
    """A child's exit code and output; past its timeout it is stopped with what it started, exit 124."""
    proc = subprocess.run([sys.executable, "-c", RUN_CHILD, str(tmp_path / "log")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == [3, "said", 124, True, True]


def test_predict_refuses_an_unknown_variant():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_predict", "--variants", "torch_int8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "choose from" in proc.stderr and "Traceback" not in proc.stderr
