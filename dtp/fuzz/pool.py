"""A persistent pool of gloo ranks for one mesh shape: started once, then fed one case after
another.

Starting ranks costs seconds (process start, process group); a fuzz example costs a fraction of one.
A case that crashes or hangs a rank costs the pool: it is stopped and the next case starts a fresh
one. A rank killed by a signal is named with where it crashed, as `dtp apply` names its ranks (each
rank's faulthandler writes its frames to the pool's scratch folder).
"""

from __future__ import annotations

import faulthandler
import queue
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from dtp.runtime.launcher import (
    death_of,
    init_rank,
    loopback_listener,
    rank_context,
    serve_store,
    start_ranks,
    stop_ranks,
)
from dtp.runtime.mesh import make_mesh
from dtp.verify.rank import RunConfig, run

RANK_TIMEOUT_S = 120.0  # a collective that waits longer than this on a pool rank fails it
READY = "ready"  # what a rank answers once it has joined the process group and built the mesh


def _worker(
    rank: int, world: int, port: int, jobs: list, results, tp: int, dp: int, scratch: str
) -> None:
    # where a crash (SIGSEGV, SIGABRT, ...) leaves this rank's frames, for `death_of`
    faulthandler.enable(file=open(Path(scratch, f"stack-{rank}.txt"), "w"), all_threads=True)
    # loopback rendezvous; Ctrl-C is the parent's
    init_rank(rank, world, port, "cpu", RANK_TIMEOUT_S)
    mesh = make_mesh(tp, dp)
    results.put((rank, READY, None))
    while True:
        cfg = jobs[rank].get()
        if cfg is None:
            break
        try:
            report = run(cfg, mesh)
            results.put((rank, report, None))
        except Exception as err:  # noqa: BLE001 - the fuzzer reports it
            where = getattr(err, "__dtp_where__", "")
            message = " ".join(f"{type(err).__name__}: {err}".split())[:500]
            results.put((rank, None, f"rank {rank} failed in {where}: {message}"))
    dist.destroy_process_group()


class Hang(Exception):
    """The pool did not answer within the timeout."""


class RankPool:
    """`world = dp × tp` forked ranks with one gloo process group and one (dp, tp) mesh."""

    def __init__(self, tp: int, dp: int = 1):
        self.tp, self.dp, self.world = tp, dp, tp * dp
        # gloo's loopback connect fails now and then: one more start, as `launch_local` does
        if not self._start() and not self._start():
            raise RuntimeError(f"the rank pool for tp {tp} × dp {dp} did not start twice in a row")

    def _start(self) -> bool:
        """Start the ranks; whether every one joined (otherwise they are stopped)."""
        ctx = rank_context()
        self.jobs = [ctx.Queue() for _ in range(self.world)]
        self.results = ctx.Queue()
        self.tmp = tempfile.TemporaryDirectory(prefix="dtp-fuzz-")
        sock = loopback_listener(self.world)
        self.procs = start_ranks(
            _worker,
            self.world,
            (
                self.world,
                sock.getsockname()[1],
                self.jobs,
                self.results,
                self.tp,
                self.dp,
                self.tmp.name,
            ),
            ctx=ctx,
        )
        # after the fork: see serve_store
        self.store = serve_store(sock, self.world, RANK_TIMEOUT_S)
        deadline, ready = time.monotonic() + RANK_TIMEOUT_S, 0
        while ready < self.world and time.monotonic() < deadline and self.alive:
            try:
                ready += self.results.get(timeout=0.2)[1] == READY
            except queue.Empty:
                continue
        if ready < self.world:
            self.close()
        return ready == self.world

    def run(self, cfg: RunConfig, timeout: float = 120.0) -> dict:
        """Rank 0's report for `cfg`; raises RuntimeError (a rank failed) or Hang. Either closes the
        pool."""
        for q in self.jobs:
            q.put(cfg)
        deadline = time.monotonic() + timeout
        report, errors, answered, grace = None, [], 0, 0.0
        while answered < self.world:
            try:
                rank, rep, err = self.results.get(
                    timeout=max(0.05, min(1.0, deadline - time.monotonic()))
                )
            except queue.Empty:
                # a rank that died comes first: its peers' errors (a reset connection) follow from
                # it, or (a rank raised, then a peer aborted) the first of them says the rest
                if any(not p.is_alive() for p in self.procs):
                    died = "; ".join([self._deaths(), *errors[:1]])
                    self.close()
                    raise RuntimeError(died) from None
                if time.monotonic() > deadline or (errors and time.monotonic() > grace):
                    self.close()
                    if errors:
                        raise RuntimeError(errors[0]) from None
                    raise Hang(f"no answer within {timeout:g} s") from None
                continue
            answered += 1
            if err:
                errors.append(err)
                grace = time.monotonic() + 3.0  # the other ranks may be stuck in a collective
            if rank == 0:
                report = rep
        if errors:
            self.close()
            raise RuntimeError(errors[0])
        return report

    def _deaths(self) -> str:
        """Each rank that died, how, and where it crashed (before `close` removes the scratch)."""
        scratch = Path(self.tmp.name)
        return "; ".join(
            f"rank {r} {death_of(scratch, r, p.exitcode, entry=_worker)}"
            for r, p in enumerate(self.procs)
            if not p.is_alive()
        )

    @property
    def alive(self) -> bool:
        """Whether every rank is still running."""
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        """Stop every rank."""
        for q in self.jobs:
            try:
                q.put_nowait(None)
            except (ValueError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=0.5)
        stop_ranks(self.procs)
        self.store = None  # closes the listening socket
        self.tmp.cleanup()

    def path(self, name: str) -> Path:
        """A scratch file for case inputs."""
        return Path(self.tmp.name) / name


class Pools:
    """One RankPool per mesh shape, started on first use and restarted after a failure."""

    def __init__(self) -> None:
        self.pools: dict[tuple[int, int], RankPool] = {}

    def get(self, tp: int, dp: int) -> RankPool:
        """The live pool for (tp, dp)."""
        pool = self.pools.get((tp, dp))
        if pool is None or not pool.alive:
            pool = self.pools[(tp, dp)] = RankPool(tp, dp)
        return pool

    def close(self) -> None:
        """Stop every pool."""
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
