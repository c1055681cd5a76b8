"""Every rank ends soon after the result: runtime.distributed's exit watchdog.

A rank that hangs in its teardown (a peer gone or stuck, a destructor that never returns) would
hold a SLURM job until its time limit. The watchdog is a separate process, so it acts even when
the rank's own threads cannot run: these tests hang the rank with the GIL held.
"""
import os
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILLED_LINE = "still tearing down the process group"


def run_script(code: str, timeout: float = 120, launcher=(sys.executable,)):
    """Run ``code`` (with the repository importable) and return (result, seconds)."""
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    result = subprocess.run([*launcher, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout)
    return result, time.monotonic() - start


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its parent to reap it counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses libc sleep and /proc")
def test_watchdog_kills_a_rank_that_hangs_holding_the_gil():
    result, seconds = run_script("""
        import ctypes
        from runtime.distributed import start_exit_watchdog
        start_exit_watchdog(2.0, rank=1)
        print("armed", flush=True)
        libc = ctypes.PyDLL(None)      # PyDLL keeps the GIL during the call: no thread can run
        while True:
            libc.sleep(60)             # returns early on a signal: sleep again
    """)
    assert result.stdout.strip() == "armed"
    assert result.returncode == -9, result.stderr        # SIGKILL: non-zero for torchrun and SLURM
    lines = [line for line in result.stderr.splitlines() if KILLED_LINE in line]
    assert len(lines) == 1 and lines[0].startswith("main.py: error: rank 1 "), result.stderr
    assert 'File "<string>", line' in result.stderr          # the hung rank's Python stack
    assert seconds < 60


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_watchdog_leaves_a_clean_exit_alone_and_ends_with_it():
    result, _ = run_script("""
        import runtime.distributed as D
        D.start_exit_watchdog(30.0, rank=0)
        D.start_exit_watchdog(30.0, rank=0)    # a second call starts no second watchdog
        print(D._watchdog.pid, flush=True)
    """)
    assert result.returncode == 0 and KILLED_LINE not in result.stderr, result.stderr
    watchdog = int(result.stdout)
    deadline = time.monotonic() + 20
    while not gone(watchdog) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(watchdog), "the watchdog outlived the process it watches"


@pytest.mark.slow
def test_torchrun_rank_whose_peer_never_arrives_is_ended_with_one_line():
    """Rank 1 never reaches the final barrier (stuck elsewhere): rank 0 would wait there for
    gloo's 30-minute timeout; the watchdog ends it, and torchrun then stops rank 1."""
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "--monitor_interval", "0.5")
    code = """
        import time
        import runtime.distributed as D
        info = D.init_distributed("cpu", 0)
        print(f"rank {info.rank} joined", flush=True)
        if info.rank == 1:
            time.sleep(600)
        D.cleanup(graceful=True, timeout=3.0)
    """
    result, seconds = run_torchrun(launcher, code)
    assert result.returncode != 0
    assert "rank 0 joined" in result.stdout and "rank 1 joined" in result.stdout, result.stdout
    lines = [line for line in result.stderr.splitlines() if KILLED_LINE in line]
    assert len(lines) == 1 and "main.py: error: rank 0 " in lines[0], result.stderr[-3000:]
    assert seconds < 120


def run_torchrun(launcher, code: str):
    """torchrun runs a file, not ``-c``: write the script next to nothing shared."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "rank.py")
        with open(script, "w", encoding="utf-8") as handle:
            handle.write(textwrap.dedent(code))
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
        start = time.monotonic()
        result = subprocess.run([*launcher, script], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=300)
        return result, time.monotonic() - start
