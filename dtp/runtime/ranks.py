"""Run a function on N local gloo ranks (forked, as `dtp apply` does on CPU) and collect what each
returns.

`on_ranks(fn, world, *args)` calls `fn(rank, world, *args)` on every rank, through the project's one
launcher (`dtp.runtime.launcher`: loopback rendezvous, no process or temp dir left behind).
"""

from __future__ import annotations

from dtp.runtime.launcher import launch_local


def on_ranks(fn, world: int, *args, timeout: float = 120, threads: int = 1) -> list:
    """fn(rank, world, *args) on every rank; the list of return values in rank order (RunError on
    failure). One intra-op thread per rank unless told: the benchmark's arms and utilization assume
    it."""
    return launch_local(fn, world, *args, timeout=timeout, prefix="dtp-ranks-", threads=threads)
