"""How many intra-op threads each local rank runs: the machine's cores shared out among the ranks."""

from __future__ import annotations

import os


def cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def threads_per_rank(world: int, requested: int | None = None) -> int:
    """Intra-op threads for each of `world` local ranks: `requested` (--threads), else an explicit
    OMP_NUM_THREADS (the test harness sets 1), else the cores shared out: ranks × threads = cores,
    so tp 1 uses the whole machine as plain PyTorch would, and ranks never oversubscribe it."""
    if requested is not None:
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, cores() // max(world, 1))
