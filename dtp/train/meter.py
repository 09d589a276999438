"""Measuring a training step: time inside collectives and peak memory (counts:
dtp.runtime.comm.CommCounter)."""

from __future__ import annotations

import resource
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_COMM_NAMESPACES = ("_c10d_functional", "c10d", "c10d_functional")


class CommTimer(TorchDispatchMode):
    """Wall time spent in collective ops and in waiting for them (functional collectives are
    asynchronous: the wait is where the time goes). Includes time waiting for slower ranks:
    communication as a rank sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = func.namespace if hasattr(func, "namespace") else ""
        if namespace not in _COMM_NAMESPACES:
            return func(*args, **(kwargs or {}))
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - t0
        return out


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, kind): CUDA max allocated, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss"
