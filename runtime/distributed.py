"""Process-group helpers: one code path for one process and many.

Every collective here is a no-op when no process group is initialised (world size 1).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """More than one process (``init_distributed`` joined a process group)."""
        return self.world_size > 1


def select_device(requested: str, local_rank: int) -> torch.device:
    """``auto`` -> the local GPU (CUDA or ROCm) when there is one, else the CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA/ROCm GPU is available")
    return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))


def init_distributed(requested_device: str, local_rank: int) -> DistInfo:
    """Read torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE) and join the process group.

    NCCL (RCCL on ROCm) for GPUs, gloo on the CPU. Without torchrun: rank 0 of 1, no group.
    """
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", local_rank))
    device = select_device(requested_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            try:  # binds NCCL to this GPU up front (barriers then need no guess of the device)
                dist.init_process_group(backend=backend, device_id=device)
            except TypeError:  # a torch without the device_id argument
                dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(backend=backend)
    return DistInfo(rank, local_rank, world_size, device)


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if is_dist():
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place and return it."""
    if is_dist():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_objects(value) -> list:
    """``[value of rank 0, value of rank 1, ...]`` (picklable values); ``[value]`` at world size 1."""
    if not is_dist():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Rank 0's buffers (e.g. batch-norm running statistics) on every rank."""
    if is_dist():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def broadcast_int(value: int, device: torch.device) -> int:
    """Rank 0's ``value`` on every rank."""
    if not is_dist():
        return int(value)
    holder = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(holder, src=0)
    return int(holder.item())


def resolve_master_seed(seed: int, device: torch.device) -> int:
    """``seed`` itself, or (for -1) a seed drawn from the OS on rank 0 and broadcast."""
    if seed < 0:
        seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    return broadcast_int(seed, device)


def rank_seed(master_seed: int, rank: int) -> int:
    """One seed per rank, derived from the master seed."""
    return int(np.random.default_rng([master_seed, 0xC0FFEE]).integers(0, 2**31 - 1, size=rank + 1)[rank])


# Seconds from the start of cleanup() to the end of the process. All ranks meet in cleanup
# right after the result (checkpoints are written before the final barrier of a run), so only a
# rank whose peer died or hangs in its own teardown comes near this.
TEARDOWN_TIMEOUT_S = 60.0

# The watchdog: a separate process, because a rank can hang where no thread of its own can act
# (a C++ destructor holding the GIL, interpreter finalisation). It waits on a pipe whose write
# end only this process holds: end of file means this process is gone; a timeout means it hangs.
_WATCHDOG_CODE = """
import os, select, signal, sys, time
pid, seconds, rank = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if not select.select([sys.stdin], [], [], seconds)[0]:
    sys.stderr.write(f"main.py: error: rank {rank} still tearing down the process group {seconds:.0f} s "
                     f"after the run ended (a peer is gone or stuck); watchdog kills it (stacks follow)\\n")
    sys.stderr.flush()
    try:
        os.kill(pid, signal.SIGUSR2)  # the rank's faulthandler prints every thread's stack
        time.sleep(2)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""
_watchdog: subprocess.Popen | None = None


def start_exit_watchdog(timeout: float, rank: int) -> None:
    """Make sure this process ends within ``timeout`` seconds from now: after that a watchdog
    process prints one line naming the rank, dumps this process's Python stacks and kills it
    (exit by SIGKILL, non-zero). Does nothing when already started or when it cannot start."""
    global _watchdog
    if _watchdog is not None:
        return
    try:
        if hasattr(signal, "SIGUSR2"):
            import faulthandler

            faulthandler.register(signal.SIGUSR2, all_threads=True)
        # stdin is the pipe; stderr is this process's, so the line reaches the job's log
        _watchdog = subprocess.Popen([sys.executable, "-I", "-c", _WATCHDOG_CODE, str(os.getpid()),
                                      str(timeout), str(rank)], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL)
    except (OSError, ValueError, RuntimeError):
        _watchdog = None  # no watchdog: the teardown proceeds exactly as without one


def _never_free(group) -> None:
    """Keep ``group``'s C++ process group alive until the process ends (one extra reference
    that nothing drops): cleanup() runs when the process is about to exit, and freeing a gloo
    group can deadlock on torch 2.3. Its destructor joins gloo's worker threads with the GIL
    held (neither the group's binding nor DDP's reducer, which may hold the last reference,
    releases it), while a worker thread still has to free the last work it ran, whose tensors
    were created in Python and need the GIL to go. Seen as "rank N still tearing down" in about
    one two-process run out of four on torch 2.3 (gdb: main thread in ~ProcessGroupGloo ->
    thread::join, worker in ~AsyncWork -> take_gil). Never freed, the group's threads and
    sockets end with the process."""
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def cleanup(graceful: bool = True, timeout: float = TEARDOWN_TIMEOUT_S) -> None:
    """Leave the process group. On a normal exit all ranks meet first: a rank that destroys its
    group while a peer still uses the connection can abort the peer (seen with gloo). After an
    error the peers may never arrive, so no barrier then. With peers (world size > 1) a watchdog
    ends the process if it is still alive ``timeout`` seconds from now (``start_exit_watchdog``):
    call this only when the process is about to exit."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            start_exit_watchdog(timeout, dist.get_rank())
        try:
            if graceful:
                barrier()
        finally:
            if dist.get_backend() == "gloo":
                _never_free(dist.group.WORLD)
            dist.destroy_process_group()
