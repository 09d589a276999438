"""Local ranks: start `world` processes on this machine, rendezvous on loopback only, collect what
each returns.

The one launcher: every command that starts ranks on this machine goes through it (a prepared job
through dtp.runtime.preflight.launch, which joins torchrun's world instead when torchrun started
this process). torch's TCPStore listens on every interface (`::`) whatever host it is given, so the
parent binds a loopback socket itself and hands it to the store (`master_listen_fd`); gloo's and
NCCL's own sockets are pinned to the loopback interface. Under torchrun none of this runs: the
launcher's settings stand.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

from dtp.errors import DtpError, RunError, Terminated
from dtp.runtime import fork
from dtp.runtime.threads import threads_per_rank
from dtp.runtime.torchrun import RENDEZVOUS

# after a first failure, how long the other ranks get to report theirs before they are stopped
GRACE_S = 3.0


def die_with_parent() -> None:
    """Make this process receive SIGKILL when its parent dies (Linux), so no rank outlives its
    launcher."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def loopback_listener(world: int) -> socket.socket:
    """A socket listening on 127.0.0.1 only (an ephemeral port), for `serve_store` once every rank
    is started."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(max(128, world))
    return sock


def serve_store(sock: socket.socket, world: int, timeout: float):
    """The TCPStore server on `sock` (the store owns the descriptor from here on).

    Call it only after the ranks are forked: the server runs a thread, and a rank forked while that
    thread held a lock (it accepts and names the ranks already started) can block forever in its own
    store client. Ranks that connect before the server runs wait in the socket's backlog."""
    from torch.distributed import TCPStore

    # detach: Python must not close the descriptor a second time.
    return TCPStore(
        "127.0.0.1",
        sock.getsockname()[1],
        world,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
        master_listen_fd=sock.detach(),
    )


def init_rank(
    rank: int, world: int, port: int, device: str, timeout: float, threads: int = 1
) -> None:
    """In a started rank: die with the parent, leave signals to it, use `threads` intra-op threads,
    join the process group over loopback."""
    import torch
    import torch.distributed as dist

    die_with_parent()  # a rank must not outlive its launcher, even one killed with SIGKILL
    # Ctrl-C is the parent's: it stops every rank, once
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS=str(threads),
        GLOO_SOCKET_IFNAME="lo",
        NCCL_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=timeout)
    )
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout),
    )


def error_summary(err: BaseException, rank: int) -> dict:
    """What a rank's exception becomes on the parent: rank, where (module or phase), error, source
    line."""
    frames = traceback.extract_tb(err.__traceback__)
    message = " ".join(str(err).split())
    if len(message) > 400:
        message = message[:400] + " …"
    return {
        "rank": rank,
        "where": getattr(err, "__dtp_where__", None) or "start-up",
        # dtp's own errors are sentences for the user; anything else is named by its class
        "error": message if isinstance(err, DtpError) else f"{type(err).__name__}: {message}",
        "time": getattr(err, "__dtp_time__", None) or time.time(),
        "at": f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "",
    }


def _child(
    rank: int,
    world: int,
    port: int,
    device: str,
    timeout: float,
    out: str,
    fn,
    args: tuple,
    threads: int = 1,
) -> None:
    code = 1
    try:
        import faulthandler

        import torch.distributed as dist

        # On a timeout the parent sends SIGUSR1 before it kills: the rank writes where it is stuck.
        # A rank that crashes (SIGSEGV, SIGABRT, ...) writes where it crashed to the same file.
        stacks = open(Path(out, f"stack-{rank}.txt"), "w")
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        faulthandler.enable(file=stacks, all_threads=True)
        try:
            init_rank(rank, world, port, device, timeout, threads)
        except Exception as err:
            err.__dtp_where__ = RENDEZVOUS
            raise
        # where a rank's watchdog (dtp.runtime.watchdog) reports a stall before it ends the rank
        os.environ["DTP_ERROR_FILE"] = str(Path(out, f"error-{rank}.json"))
        try:
            result = fn(rank, world, *args)
        except BaseException as err:
            # when it raised: tearing the process group down below can take seconds, during which
            # the peers fail because of it, and their errors must come after this one
            err.__dtp_time__ = time.time()
            raise
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        tmp = Path(out, f"{rank}.pkl.tmp")
        tmp.write_bytes(pickle.dumps(result))
        tmp.rename(Path(out, f"{rank}.pkl"))
        code = 0
    except BaseException as err:  # noqa: BLE001 - the parent reports it as one paragraph
        with contextlib.suppress(Exception):
            Path(out, f"error-{rank}.json").write_text(json.dumps(error_summary(err, rank)))
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)  # no destructors: the forked copy of the parent's store must not run its own


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    if exitcode == 0:
        return "exited (status 0) without returning a result (does the model call sys.exit or os._exit?)"
    return f"exited with status {exitcode} without reporting an error"


def death_of(out: Path, rank: int, exitcode: int | None, entry=_child) -> str:
    """How a rank that reported nothing ended ("was killed by SIGSEGV at x.py:3 f <- …"): where it
    crashed is what its faulthandler wrote to `out`/stack-RANK.txt, read from the thread that runs
    `entry` (the rank's function)."""
    death = _death(exitcode)
    if exitcode is not None and exitcode < 0 and exitcode != -signal.SIGKILL:
        # faulthandler wrote the rank's stack as it crashed; SIGKILL leaves no trace
        if where := _frames(out, rank, entry):
            death += f" at {where}"
    return death


def _failure(out: Path, rank: int, exitcode: int | None) -> RunError:
    """A RunError for a rank that failed; `.time` is when it raised (0 for a rank that died
    silently)."""
    path = out / f"error-{rank}.json"
    with contextlib.suppress(ValueError, OSError, KeyError):
        e = json.loads(path.read_text())
        err = RunError(
            f"the run failed on rank {rank} in {e['where']}: {e['error']}",
            rank=rank,
            where=e["where"],
            error=e["error"],
        )
        err.time = e["time"]
        return err
    death = death_of(out, rank, exitcode)
    err = RunError(f"the run failed: rank {rank} {death}", rank=rank, where=None, error=death)
    err.time = 0.0
    return err


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM raises Terminated (a KeyboardInterrupt) in the main thread, so cleanup runs as for
    Ctrl-C."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def rank_context(device: str = "cpu"):
    """The multiprocessing context ranks start in: fork on CPU (no re-import of torch), spawn on
    CUDA (CUDA cannot be forked) and where autograd's threads forbid a fork (dtp.runtime.fork)."""
    import torch.multiprocessing as mp

    spawn = device == "cuda" or fork.autograd_forbids_fork()
    return mp.get_context("spawn" if spawn else "fork")


def start_ranks(target, world: int, args: tuple, device: str = "cpu", ctx=None) -> list:
    """Start `world` processes running target(rank, *args) in `ctx` (`rank_context(device)` unless
    given: queues among `args` must come from the same context)."""
    ctx = ctx or rank_context(device)
    procs = [ctx.Process(target=target, args=(rank, *args), daemon=True) for rank in range(world)]
    if ctx.get_start_method() == "fork":
        fork.start(procs)  # what a forked rank must not inherit: see dtp.runtime.fork
    else:
        for p in procs:
            p.start()
    return procs


def stop_ranks(procs: list) -> None:
    """Kill and reap every rank still running."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        # SIGKILL cannot be ignored; on a loaded machine it can take a moment to land
        p.join(timeout=30)


def _stuck_at(procs: list, out: Path, done: set[int]) -> str:
    """Where each live rank is (its innermost frames, from faulthandler), as a sentence; '' if none
    could tell."""
    live = [r for r, p in enumerate(procs) if r not in done and p.is_alive()]
    for r in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(1.0)
    lines = [f"rank {r}: {where}" for r in live if (where := _frames(out, r))]
    return "; where each rank was: " + "; ".join(lines) if lines else ""


def _frames(out: Path, rank: int, entry=_child) -> str:
    """The innermost frames of the rank's main thread (the one that runs the function `entry`), from
    what faulthandler wrote last ('x.py:3 f <- y.py:9 g'); '' if it wrote nothing."""
    try:
        text = Path(out, f"stack-{rank}.txt").read_text(errors="replace")
    except OSError:
        return ""
    # The last dump; in it, the rank's main thread is the block that runs `entry` (others are
    # torch's or gloo's own).
    text = text.rsplit("Fatal Python error", 1)[-1]
    blocks = [
        [_frame(f.strip()) for f in b.splitlines() if f.strip().startswith("File ")]
        for b in text.split("\n\n")
    ]
    # the frame of `entry` itself, by its file and name (another module's `_worker` is not it)
    file, name = Path(entry.__code__.co_filename).name, entry.__name__

    def runs_entry(frames: list[str]) -> bool:
        return any(f.startswith(f"{file}:") and f.endswith(f" {name}") for f in frames)

    frames = next((b for b in blocks if runs_entry(b)), [f for b in blocks for f in b])
    return " <- ".join(frames[:3])


def _frame(line: str) -> str:
    """'File "/x/y.py", line 3 in f' → 'y.py:3 f'."""
    try:
        path, rest = line[len('File "') :].split('", line ', 1)
        number, _, func = rest.partition(" in ")
        return f"{Path(path).name}:{number} {func}"
    except ValueError:
        return line


def _wait(procs: list, out: Path, left: float, timeout: float) -> list[RunError]:
    """Wait for every rank, at most `left` seconds; the failures, first one first ([] when all
    returned a result). `timeout` is the user's, for the message."""
    deadline = time.monotonic() + left
    # (time raised, round seen, rank, error): a rank's own error is raised before the errors it
    # causes in its peers, even when it exits after them (tearing its process group down)
    failures: list[tuple[float, int, int, RunError]] = []
    seen: set[int] = set()
    grace_end, rounds = None, 0
    while len(seen) < len(procs):
        now = time.monotonic()
        if now >= deadline:
            where = _stuck_at(procs, out, seen)
            raise RunError(
                f"the run did not finish within --timeout {timeout:g} s; every rank was stopped "
                "(a rank may be stuck in a collective that another rank never joined)" + where
            )
        if grace_end is not None and now >= grace_end:
            break
        live = [p.sentinel for r, p in enumerate(procs) if r not in seen]
        multiprocessing.connection.wait(live, timeout=min(0.2, deadline - now))
        rounds += 1
        for r, p in enumerate(procs):
            if r in seen or p.exitcode is None:
                continue
            seen.add(r)
            if p.exitcode != 0 or not (out / f"{r}.pkl").exists():
                # A rank that died silently (time 0) caused its peers' connection errors, not the
                # reverse.
                err = _failure(out, r, p.exitcode)
                failures.append((err.time, rounds, r, err))
                grace_end = grace_end or time.monotonic() + GRACE_S
    return [err for _, _, _, err in sorted(failures, key=lambda f: f[:3])]


def launch_local(
    fn,
    world: int,
    *args,
    timeout: float,
    device: str = "cpu",
    prefix: str = "dtp-",
    threads: int | None = None,
) -> list:
    """Start `world` local ranks (fork+gloo on CPU, spawn+NCCL on CUDA), rendezvous on loopback
    only, init the process group on each, call fn(rank, world, *args), return the results in rank
    order. Raises RunError (one paragraph naming the failing rank and what it raised, or the
    timeout) and leaves no process, temp dir or port behind, also on Ctrl-C/SIGTERM.

    A launch whose first failure is a rank that could not join the process group is started once
    more, within what is left of `timeout`: gloo's loopback connect fails now and then (about once
    in a few thousand starts here). The failed rank never ran `fn`; ranks that had begun it are
    stopped first. Each rank runs `threads_per_rank(world, threads)` intra-op threads."""
    threads = threads_per_rank(world, threads)
    deadline = time.monotonic() + timeout
    with terminate_as_interrupt():
        for attempt in (1, 2):
            failures, results = _launch_once(
                fn, world, args, timeout, deadline - time.monotonic(), device, prefix, threads
            )
            if not failures:
                return results
            first = failures[0]
            if attempt == 1 and first.where == RENDEZVOUS and deadline - time.monotonic() > 1.0:
                print(f"warning: {first}; the ranks were started again", file=sys.stderr)
                continue
            if len(failures) > 1:
                first.args = (f"{first} ({len(failures) - 1} other rank(s) failed too)",)
            raise first
    raise AssertionError("unreachable")


def _launch_once(
    fn,
    world: int,
    args: tuple,
    timeout: float,
    left: float,
    device: str,
    prefix: str,
    threads: int = 1,
) -> tuple[list[RunError], list]:
    """One start of the ranks: (failures, results in rank order); `left` is the time this start may
    take."""
    procs: list = []
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        sock, store = loopback_listener(world), None
        try:
            # Ranks' own process-group timeout is longer than ours: the parent always decides, with
            # one message.
            procs = start_ranks(
                _child,
                world,
                (world, sock.getsockname()[1], device, timeout + 30, tmp, fn, args, threads),
                device,
            )
            store = serve_store(sock, world, timeout + 30)
            failures = _wait(procs, Path(tmp), left, timeout)
        finally:
            stop_ranks(procs)
            sock.close()  # a no-op once the store owns the descriptor
            del store  # closes the listening socket
        if failures:
            return failures, []
        return [], [pickle.loads(Path(tmp, f"{r}.pkl").read_bytes()) for r in range(world)]
