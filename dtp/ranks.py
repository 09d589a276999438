"""Run a function on N local gloo ranks (forked, as `dtp apply` does on CPU) and collect what each returns.

For tests and benchmarks: `on_ranks(fn, world, *args)` calls `fn(rank, world, *args)` on every rank.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import signal
import socket
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def die_with_parent() -> None:
    """Make this process receive SIGKILL when its parent dies (Linux), so no rank outlives its launcher."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    """A free TCP port on localhost for a process group's store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, out: str, args: tuple) -> None:
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def on_ranks(fn, world: int, *args, timeout: float = 120) -> list:
    """fn(rank, world, *args) on every rank; the list of return values in rank order."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(fn, world, free_port(), out, args), nprocs=world, join=False,
                                 start_method="fork")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):  # True once every rank is done
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world)]
