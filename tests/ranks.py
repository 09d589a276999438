"""Run a test function on N real gloo ranks (forked, as `dtp apply` does on CPU) and collect its results."""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def on_ranks(fn, world: int, *args, timeout: float = 120) -> list:
    """fn(rank, world, *args) on every rank; the list of return values in rank order."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(fn, world, _free_port(), out, args), nprocs=world, join=False,
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
