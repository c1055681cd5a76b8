"""The throughput benchmark runs end to end on a CPU (smoke run, tiny shapes) and reports every
row; its largest-batch search finds the boundary."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cells(markdown: str, row: str) -> list[str]:
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {row} |"))
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


@pytest.mark.slow
def test_smoke_run_on_cpu(tmp_path):
    out = tmp_path / "table.md"
    # One thread: on a shared two-core machine OpenMP threads of tiny convolutions oversubscribe
    # the cores (10x slower); 64x32x32 keeps two instance-norm bottleneck voxels.
    cmd = [sys.executable, "-m", "benchmarks.bench_throughput", "--smoke", "--threads", "1",
           "--filters", "2", "4", "4", "8", "8", "--patch", "64", "32", "32", "--eval_shape", "64", "48", "48",
           "--data_dir", str(tmp_path / "data"), "--out", str(out), "--levers", "channels_last+bf16@2"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = out.read_text()
    assert table in proc.stdout                         # printed last, and written as markdown
    assert proc.stdout.rstrip().endswith(table.rstrip())
    for row in ("plain", "+ bf16", "+ channels_last", "+ device cache", "plain + channels_last only",
                "all levers, --loader synthetic", "all levers, batch 2", "bf16 + channels_last, batch 2"):
        cells = _cells(table, row)
        assert float(cells[2]) > 0 and float(cells[3]) > 0, row         # samples/s, ms/step
        assert float(cells[4]) > 0, row                                 # TFLOP/s
        assert cells[6] == "n/a", row                                   # no GPU memory on a CPU
        # No failed row. (A "loss nan" note can appear: instance norm over this tiny patch's two
        # bottleneck voxels makes bf16 training diverge now and then; the equivalence of the
        # paths is tested in test_speed_levers.py.)
        assert not cells[9].startswith(("failed", "out of memory")), (row, cells[9])
    assert _cells(table, "plain")[8] == "1.00x"
    assert "CUDA graphs need a CUDA GPU" in _cells(table, "+ cuda graphs")[9]
    assert "skipped in --smoke" in _cells(table, "+ compile")[9]
    assert "GPU only" in _cells(table, "all levers, largest batch")[9]
    for row in ("plain: fp32, 1 window per forward", "bf16 + 4 windows per forward + channels_last"):
        cells = _cells(table, row)
        assert cells[1:3] == ["1", "4"] and float(cells[3]) > 0, row    # 1 volume, 4 windows, seconds
    assert re.search(r"torch 2\.\d+", table) and "python -m benchmarks.bench_throughput --smoke" in table


def test_levers_rows_refuse_an_unknown_lever_before_any_work(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_throughput", "--smoke", "--levers", "bf16+fast",
                           "--data_dir", str(tmp_path / "data")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "--levers 'bf16+fast': unknown lever(s) ['fast']" in proc.stderr, proc.stderr
    assert not (tmp_path / "data").exists()


SEARCH = """
import json, sys
from benchmarks.bench_throughput import search_largest
out = []
for fits_up_to, limit in json.loads(sys.argv[1]):
    tried = []
    def runs(batch):
        tried.append(batch)
        return (batch <= fits_up_to, "out of memory" if batch > fits_up_to else "")
    out.append([*search_largest(runs, limit), len(tried)])
print(json.dumps(out))
"""


def test_search_largest_batch():
    """Known answers, in a child process (no test imports the benchmarks)."""
    cases = [(0, 64, 0), (1, 64, 1), (5, 64, 5), (8, 64, 8), (37, 64, 37), (64, 64, 64), (100, 64, 64), (3, 3, 3)]
    proc = subprocess.run([sys.executable, "-c", SEARCH, json.dumps([c[:2] for c in cases])], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for (fits_up_to, limit, expected), (got, why, tried) in zip(cases, json.loads(proc.stdout)):
        assert got == expected
        assert why == ("out of memory" if fits_up_to < limit else f"limit {limit}")
        assert tried <= 2 * limit.bit_length() + 1


LADDER = """
import json, sys
from benchmarks.bench_throughput import LEVERS, build_parser, check, plan_ladder, row_runs
out = {"check": [check(build_parser().parse_args(argv)) for argv in json.loads(sys.argv[1])]}
args = build_parser().parse_args(["--rows", "ladder,single,sweep", "--levers", "compile+bf16@3", "--batch_size", "2"])
out["evaluation"] = [[name for name, _ in plan_ladder(args, cuda)[1]] for cuda in (False, True)]
rows = plan_ladder(args, False)[0]
out["rows"] = [[r.name, list(r.levers), r.batch_size] for r in rows]
unavailable = {lever: "not here" if lever in ("fused_optimizer", "cuda_graphs") else None for lever in LEVERS}
for largest in ({}, {(True, True): (6, "out of memory")}):
    runs, dropped = row_runs(rows, unavailable, 2, largest)
    out.setdefault("runs", []).append({row.name: run and [list(run.levers), run.batch_size] or why
                                       for row, run, why in runs})
    out.setdefault("dropped", []).append(sorted(dropped))
print(json.dumps(out))
"""


def test_check_and_plan_of_the_ladder():
    """The pure steps before any work, known answers in a child process: every refusal of the command line in one
    line, the rows planned in order, and each row as a machine without some levers runs it."""
    argvs = [[], ["--patch", "64", "32"], ["--levers", "bf16+fast", "bf16@x"],
             ["--patch", "1", "2", "--rows", "ladder,x"]]
    proc = subprocess.run([sys.executable, "-c", LADDER, json.dumps(argvs)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    groups = "choose from ('ladder', 'single', 'synthetic', 'sweep')"
    assert out["check"] == [[], ["--patch takes 1 or 3 sizes, got [64, 32]"],
                            ["--levers 'bf16+fast': unknown lever(s) ['fast']; choose from bf16, channels_last, "
                             "device_cache, fused_optimizer, cudnn_benchmark, compile, cuda_graphs",
                             "--levers 'bf16@x': the batch after @ is a whole number"],
                            ["--patch takes 1 or 3 sizes, got [1, 2]", f"unknown --rows ['x']; {groups}"]]
    assert out["evaluation"] == [["plain: fp32, 1 window per forward", "bf16 + 4 windows per forward + channels_last"],
                                 ["plain: fp32, 1 window per forward", "bf16 + 4 windows per forward + channels_last",
                                  "+ cudnn benchmark + compile"]]
    names = [name for name, _, _ in out["rows"]]
    assert names[:8] == ["plain", "+ bf16", "+ channels_last", "+ device cache", "+ fused optimizer",
                         "+ cudnn benchmark", "+ compile", "+ cuda graphs"]
    assert names[8:] == ["plain + channels_last only", "plain + device cache only", "plain + compile only",
                         "plain + cuda graphs only", "all levers, batch 4", "all levers, batch 8",
                         "all levers, largest batch", "bf16 + compile, batch 3"]   # --levers: the ladder's order
    assert out["rows"][-1] == ["bf16 + compile, batch 3", ["bf16", "compile"], 3]
    fast = ["bf16", "channels_last", "device_cache", "cudnn_benchmark", "compile"]   # all but the two missing
    for runs, largest in zip(out["runs"], (None, 6)):
        # a ladder row or a single lever whose lever is missing is n/a; a row of several runs without it
        assert runs["+ fused optimizer"] == runs["+ cuda graphs"] == runs["plain + cuda graphs only"] == \
            "n/a: not here"
        assert runs["+ compile"] == [fast, 2] and runs["all levers, batch 4"] == [fast, 4]
        assert runs["plain"] == [[], 2] and runs["bf16 + compile, batch 3"] == [["bf16", "compile"], 3]
        assert runs["all levers, largest batch"] == (
            [fast, largest] if largest else "n/a: the largest-batch search runs on a GPU only")
    assert out["dropped"] == [["cuda_graphs", "fused_optimizer"]] * 2
