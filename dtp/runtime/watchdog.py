"""A rank that stops making progress ends the run (`--stall-timeout`), naming the rank and the step.

The training loop marks progress (`Heartbeat.beat(step, phase)`: a step's forward, backward,
optimizer step, save). A thread of each rank, the watchdog, publishes to the rendezvous store every
tick how long ago its rank last made progress. When its own rank has made none for the timeout, it
asks the store about the others, twice, a few ticks apart: a rank whose record did not move is not
running (SIGSTOPped, killed, its machine gone), and is the one named; when every rank runs, a rank
that still makes progress (rank 0 verifying alone) means the run is not stalled; else the rank
furthest behind is named, or, all at one place, the collective they all wait in. The watchdog then
reports where its launcher reads a rank's failure (DTP_ERROR_FILE for dtp's own ranks, stderr under
torchrun) and ends the process; the launcher or torchrun stops the rest.

A thread rather than the process group's collective timeout: that timeout ends the ranks that wait
with an error naming neither the rank that never came nor its step, and leaves a rank that is itself
stuck (not in a collective) running. torchtitan's `train_timeout_seconds` (100 s) is the default's
model.

`exit_on_term` is the other half of a rank that cannot be stopped from its main thread: torchrun
ends its workers with SIGTERM, whose Python handler runs only once the main thread returns from C++,
and a rank blocked in a gloo collective did not for the collective's whole timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

# a rank's record older than this many ticks, twice read, is a rank that is not running
TICKS_APART = 2
# the phases of a step, in order: the rank furthest behind is the one with the earliest (step, phase)
PHASES = ("start-up", "forward", "backward", "optimizer", "checks", "evaluation", "save")


@dataclass
class Heartbeat:
    """What the main thread last did and when (time.monotonic); the watchdog reads it."""

    step: int = 0
    phase: str = "start-up"
    at: float = 0.0

    def beat(self, step: int, phase: str) -> None:
        """Progress: this rank begins `phase` of `step` (1-based)."""
        self.step, self.phase, self.at = step, phase, time.monotonic()


@dataclass(frozen=True)
class Record:
    """One rank's published state: its watchdog's tick count, its step and phase, and for how long
    it has made no progress."""

    tick: int
    step: int
    phase: str
    idle: float

    @property
    def place(self) -> tuple[int, int]:
        """Where in the run it is, comparable: (step, phase's index)."""
        return self.step, PHASES.index(self.phase) if self.phase in PHASES else 0

    def where(self) -> str:
        """'step 25 (forward)'."""
        return f"step {self.step} ({self.phase})"


def verdict(me: int, timeout: float, first: dict, second: dict, world: int) -> str | None:
    """Whether the run is stalled, from every rank's record read twice (`first`, `second`: rank →
    Record; a rank missing never published): the sentence that names who stopped it, or None when
    some rank still makes progress."""
    # not running: never published, or published the same tick twice (a rank that first
    # published between the reads runs)
    stopped = [
        r
        for r in range(world)
        if r != me and (r not in second or (r in first and first[r].tick == second[r].tick))
    ]
    if stopped:
        # its own record may be a tick old; the step it never finished is the one `me` waits in
        here = f" at {second[me].where()}" if me in second else ""
        ranks = ", ".join(str(r) for r in stopped)
        return (
            f"{'rank' if len(stopped) == 1 else 'ranks'} {ranks} stopped running (a stopped or "
            f"killed process); rank {me} waited for it {timeout:g} s{here}"
        )
    if any(rec.idle < timeout for r, rec in second.items() if r != me):
        return None  # someone still works (rank 0 verifying alone, a slow save): not a stall
    places = {r: rec.place for r, rec in second.items()}
    behind = [r for r, p in places.items() if p == min(places.values())]
    if len(behind) == len(places):
        return (
            f"no rank has made progress for {timeout:g} s, all at {second[behind[0]].where()}: a "
            "collective that never completes, or every rank stuck in its own code"
        )
    named = ", ".join(f"rank {r}" for r in behind)
    return (
        f"{named} made no progress for {timeout:g} s at {second[behind[0]].where()}, "
        "where the others wait for it"
    )


class Watchdog:
    """The thread that ends this rank when the run stalls (`start`, `stop`); see the module's
    docstring. `report(where, message)` is called once, from the thread, before the process
    exits with status 1."""

    def __init__(self, heartbeat: Heartbeat, rank: int, world: int, timeout: float, store):
        self.heartbeat, self.rank, self.world, self.timeout = heartbeat, rank, world, timeout
        self.store = store
        self.interval = max(0.2, min(5.0, timeout / 10))
        # keys of this run and this torchrun round (a restarted round meets the old round's store)
        run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        self.prefix = f"dtp/stall/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self._done = threading.Event()
        self._tick = 0
        self._thread = threading.Thread(target=self._run, name="dtp-watchdog", daemon=True)

    def start(self) -> Watchdog:
        """Start watching; the rank counts as having made progress now, and says so at once (a
        rank stopped before the first tick is then still seen)."""
        self.heartbeat.at = time.monotonic()
        with contextlib.suppress(Exception):
            self._publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the thread ends within a tick)."""
        self._done.set()
        self._thread.join(timeout=2 * self.interval + 1)

    def _publish(self) -> None:
        hb = self.heartbeat
        self._tick += 1
        record = {"tick": self._tick, "step": hb.step, "phase": hb.phase}
        record["idle"] = time.monotonic() - hb.at
        self.store.set(f"{self.prefix}/{self.rank}", json.dumps(record))

    def _read(self) -> dict[int, Record]:
        keys = [f"{self.prefix}/{r}" for r in range(self.world)]
        out = {}
        for r, key in enumerate(keys):
            if self.store.check([key]):
                out[r] = Record(**json.loads(self.store.get(key)))
        return out

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            with contextlib.suppress(Exception):  # a store that does not answer: judged alone below
                self._publish()
            if time.monotonic() - self.heartbeat.at < self.timeout:
                continue
            message = self._judge()
            if message is not None and not self._done.is_set():
                hb = self.heartbeat
                self.report(
                    f"step {hb.step}",
                    f"stalled (--stall-timeout {self.timeout:g} s): {message}",
                )
                os._exit(1)

    def _judge(self) -> str | None:
        try:
            first = self._read()
            for _ in range(TICKS_APART):
                if self._done.wait(self.interval):
                    return None
                self._publish()
            second = self._read()
        except Exception as err:  # noqa: BLE001 - the store's host may be the rank that stopped
            hb = self.heartbeat
            return (
                f"no progress for {self.timeout:g} s at step {hb.step} ({hb.phase}), and the "
                f"rendezvous store does not answer ({type(err).__name__}): the rank that hosts "
                "it may be the one that stopped"
            )
        return verdict(self.rank, self.timeout, first, second, self.world)

    def report(self, where: str, message: str) -> None:
        """Where dtp's launcher reads a rank's failure (DTP_ERROR_FILE); under torchrun, stderr
        and torchrun's error file (its failure summary shows it)."""
        ours, theirs = os.environ.get("DTP_ERROR_FILE"), os.environ.get("TORCHELASTIC_ERROR_FILE")
        now = time.time()
        if ours:
            record = {"rank": self.rank, "where": where, "error": message, "time": now, "at": ""}
            _write_json(ours, record)
            return
        print(f"error: rank {self.rank} in {where}: {message}", file=sys.stderr, flush=True)
        if theirs:
            _write_json(theirs, {"message": f"{where}: {message}", "timestamp": str(int(now))})


def _write_json(path: str, value: dict) -> None:
    with contextlib.suppress(OSError):
        with open(f"{path}.tmp", "w") as f:
            json.dump(value, f)
        os.replace(f"{path}.tmp", path)


def store_client(timeout: float):
    """A connection of the watchdog's own to the rendezvous store (MASTER_ADDR:MASTER_PORT, set by
    dtp's launcher and by torchrun): short operations, so that a store that stops answering costs
    the watchdog seconds, not the process group's timeout."""
    # here, not at the top: dtp.runtime.torchrun, on the torch-free CLI path, imports this module
    from torch.distributed import TCPStore

    return TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout),
    )


@contextlib.contextmanager
def watching(heartbeat: Heartbeat, rank: int, world: int, timeout: float) -> Iterator[None]:
    """Run the watchdog while the block runs (timeout ≤ 0: no watchdog)."""
    if timeout <= 0:
        yield
        return
    dog = Watchdog(heartbeat, rank, world, timeout, store_client(max(5.0, timeout / 4))).start()
    try:
        yield
    finally:
        dog.stop()


@contextlib.contextmanager
def exit_on_term(grace: float = 5.0) -> Iterator[None]:
    """SIGTERM ends this process within `grace` seconds even while its main thread is blocked in
    C++ (a collective): the main thread's handler gets `grace` to clean up, then the process exits
    with 143. Main thread only; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write)
    done = threading.Event()

    def wait() -> None:
        while not done.is_set():
            with contextlib.suppress(OSError):
                got = os.read(read, 64)
                if signal.SIGTERM in got and not done.wait(grace):
                    print("terminated (SIGTERM while in a collective)", file=sys.stderr, flush=True)
                    os._exit(143)

    thread = threading.Thread(target=wait, name="dtp-sigterm", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous)
        os.close(write)  # ends the thread's read
        thread.join(timeout=1)
        os.close(read)
