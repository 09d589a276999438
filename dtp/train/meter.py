"""Measuring a training step: time inside collectives, collective counts, peak memory."""
from __future__ import annotations

import resource
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtp.comm import CommCounter

_COMM_NAMESPACES = ("_c10d_functional", "c10d", "c10d_functional")


class CommTimer(TorchDispatchMode):
    """Wall time spent in collective ops and in waiting for them (functional collectives are asynchronous:
    the wait is where the time goes). Includes time waiting for slower ranks: communication as a rank sees it."""

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


class PhaseCounter(CommCounter):
    """dtp's collective counter without CommDebugMode's module tracker (its per-module bookkeeping breaks
    on forwards recomputed by activation checkpointing; a counter per phase needs no module names)."""

    def __enter__(self):
        self.comm_counts.clear()
        tracker = self.advanced_module_tracker  # never entered: it stays at one name with no parents
        tracker.module_parents_dict.setdefault(tracker.name, set())
        TorchDispatchMode.__enter__(self)
        return self

    def __exit__(self, *args):
        TorchDispatchMode.__exit__(self, *args)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, kind): CUDA max allocated, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss"


def sync(device: torch.device) -> None:
    """Wait for the device (timing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def recompute_collectives(collectives: list, blocks: list[str]) -> list:
    """With activation checkpointing, backward re-runs each block's forward: its forward collectives again
    (Megatron's extra all-reduces), counted in the backward phase."""
    from dataclasses import replace

    inside = [c for c in collectives if c.phase == "forward" and c.group == "tp"
              and any(c.module.startswith(b + ".") or c.module == b for b in blocks)]
    return [replace(c, phase="backward", reason=f"recomputed forward: {c.reason}") for c in inside]

