"""The project's local launcher: start N ranks on loopback, run a function on each, return the results.

(Minimal version on the train branch; the launcher branch's replaces it at merge with the same API.)
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from dtp.errors import RunError


def under_torchrun() -> bool:
    """Whether this process is one rank of a world torchrun (or another launcher) started."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, out: str, device: str, timeout: float, args: tuple) -> None:
    import ctypes

    import torch
    import torch.distributed as dist

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # die with the parent
    except (OSError, AttributeError):
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops every rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        result = fn(rank, world, *args)
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    except Exception as err:  # noqa: BLE001 - reported by the parent as one paragraph
        message = " ".join(f"{type(err).__name__}: {err}".split())[:500]
        Path(out, f"{rank}.err").write_text(message)
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch_local(fn, world: int, *args, timeout: float, device: str = "cpu", prefix: str = "dtp-") -> list:
    """Start `world` local ranks (fork+gloo on CPU, spawn+NCCL on CUDA), rendezvous on loopback only, init the
    process group on each, call fn(rank, world, *args), return the results in rank order (pickled back).
    Raises RunError (one paragraph) on failure/timeout; cleans up everything, also on Ctrl-C."""
    import logging

    import torch.multiprocessing as mp

    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # failures are reported here
    with tempfile.TemporaryDirectory(prefix=prefix) as out:
        ctx = mp.start_processes(_entry, args=(fn, world, _free_port(), out, device, timeout, args), nprocs=world,
                                 join=False, start_method="spawn" if device == "cuda" else "fork")
        deadline = time.monotonic() + timeout
        crashed = None
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise RunError(f"the ranks did not finish within {timeout:g} s; every rank was stopped")
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as err:
            crashed = err
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=5)
        errors = sorted(Path(out).glob("*.err"), key=lambda p: int(p.stem))
        if errors:
            more = f" ({len(errors) - 1} other rank(s) failed too)" if len(errors) > 1 else ""
            raise RunError(f"rank {errors[0].stem} failed: {errors[0].read_text()}{more}")
        if crashed is not None:
            raise RunError(f"a rank died: {' '.join(str(crashed).split())[:300]}")
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world)]
