"""torchrun: whether torchrun launched this process (a coherent set of its variables, never a stray
one), joining its world, and leaving a rank. Under torchrun its rendezvous settings stand; otherwise
dtp.runtime.launcher starts the ranks on loopback."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from datetime import timedelta
from typing import Iterator, NoReturn

from dtp.errors import RunError, UsageError
from dtp.runtime.watchdog import exit_on_term

RENDEZVOUS = "rendezvous"  # where a rank failed that never joined the process group
TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_warned_partial = False  # the stray-variable warning is printed once per process


def _torchrun_problem(env) -> str | None:
    """Why a full torchrun set of variables cannot be a real launch (None: it is coherent)."""
    try:
        world, rank, local = (int(env[k]) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
        port = int(env["MASTER_PORT"])
    except ValueError:
        shown = ", ".join(f"{k}={env[k][:40]!r}" for k in TORCHRUN_VARS if k != "MASTER_ADDR")
        return f"torchrun's variables must be integers ({shown})"
    if not 0 <= rank < world:
        return f"RANK={rank} is not a rank of WORLD_SIZE={world} (0 ≤ RANK < WORLD_SIZE)"
    if not 0 <= local <= rank:
        return f"LOCAL_RANK={local} cannot exceed RANK={rank} (or be negative)"
    if not 0 < port < 65536 or not env["MASTER_ADDR"].strip():
        return f"MASTER_ADDR={env['MASTER_ADDR'][:80]!r} MASTER_PORT={port} is not an address to rendezvous at"
    return None


def torchrun_world() -> int | None:
    """WORLD_SIZE when torchrun launched this process, None for a local run; exit 2 (UsageError) for
    a full set of torchrun's variables that cannot be a launch, and one warning (then a local run)
    for a partial set.

    Only a coherent set counts (TORCHELASTIC_RUN_ID, which torchrun sets, or all of TORCHRUN_VARS):
    a stray WORLD_SIZE from a shell or job script must not make dtp join a rendezvous that never
    comes, or rendezvous beyond loopback."""
    global _warned_partial
    env = os.environ
    present = [k for k in TORCHRUN_VARS if k in env]
    if "TORCHELASTIC_RUN_ID" not in env and len(present) < len(TORCHRUN_VARS):
        if present and not _warned_partial:
            _warned_partial = True
            missing = ", ".join(k for k in TORCHRUN_VARS if k not in env)
            print(
                f"warning: {', '.join(present)} set but {missing} not: not a torchrun launch, so "
                "these are "
                "ignored and the ranks start here on loopback",
                file=sys.stderr,
            )
        return None
    missing = [k for k in TORCHRUN_VARS if k not in env]
    if missing:
        raise UsageError(
            f"TORCHELASTIC_RUN_ID is set but {', '.join(missing)} not: not a launch dtp can join"
        )
    problem = _torchrun_problem(env)
    if problem:
        raise UsageError(
            f"{problem}: not a launch dtp can join; unset these variables to run on this machine"
        )
    return int(env["WORLD_SIZE"])


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun-launched world (a coherent set; never raises
    or warns)."""
    env = os.environ
    if not all(k in env for k in TORCHRUN_VARS):
        return False
    return _torchrun_problem(env) is None


@contextlib.contextmanager
def torchrun_group(device: str, timeout: float | None = None) -> Iterator[int]:
    """This process as one rank of torchrun's world, torchrun's rendezvous settings standing: the
    process group joined (NCCL on CUDA, each rank on its LOCAL_RANK's GPU; gloo on CPU) and left
    again; yields the rank."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    kwargs = {"timeout": timedelta(seconds=timeout)} if timeout else {}
    try:
        store, rank, world = _rendezvous(timedelta(seconds=timeout or 1800))
        # A round torchrun restarts (--max-restarts) meets the agent's store again, which still
        # holds the dead round's addresses: gloo then connects to a port nobody listens on (half
        # the restarts here; pytorch/pytorch#167288 for NCCL). Each round keys its own.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            store=dist.PrefixStore(f"dtp/attempt-{attempt}", store),
            rank=rank,
            world_size=world,
            **kwargs,
        )
    # DistNetworkError, DistStoreError: no peer at MASTER_ADDR:PORT
    except (RuntimeError, ValueError) as err:
        rank, addr = (
            int(os.environ["RANK"]),
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        )
        message = " ".join(str(err).split())[:300]
        raise RunError(
            f"rank {rank} could not join torchrun's world at {addr} "
            f"({type(err).__name__}: {message})",
            rank,
            RENDEZVOUS,
            message,
        ) from None
    try:
        with exit_on_term():  # torchrun's SIGTERM ends a rank blocked in a collective, too
            yield dist.get_rank()
    finally:
        dist.destroy_process_group()


def loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface (every address it resolves to)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def rendezvous_note() -> str | None:
    """The first line a torchrun launch whose MASTER_ADDR is not loopback prints (None when it is):
    its store and process group are reachable from the network."""
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    if loopback(addr):
        return None
    return (
        f"note: MASTER_ADDR={addr[:80]} is not a loopback address: the rendezvous store "
        f"({addr[:80]}:{port}) and the process group listen on the network"
    )


def _rendezvous(timeout: timedelta):
    """(store, rank, world) as torch's env:// rendezvous gives them, except that where this rank
    hosts the store (no torchrun agent's store to join: variables set by hand or by a scheduler),
    the store listens on MASTER_ADDR only — torch's listens on every interface — and with a
    loopback MASTER_ADDR gloo's and NCCL's sockets stay on loopback too."""
    import torch.distributed as dist

    env = os.environ
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if loopback(addr):  # every rank is on this machine
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or rank != 0:
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
        return store, rank, world
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(max(128, world))
    except OSError:
        sock.close()
        raise
    # the store owns the descriptor from here on (detach: Python must not close it as well)
    store = dist.TCPStore(
        addr,
        port,
        world,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    return store, rank, world


def leave_rank(code: int) -> NoReturn:
    """End a torchrun rank without finalising the interpreter (as local ranks end, with `os._exit`).

    When a gloo collective completes, the waiting thread moves on while gloo's worker thread still
    holds the work and its tensors. If the main thread reaches interpreter finalisation first, that
    worker cannot take the GIL to release them and the rank aborts (SIGABRT, "terminate called
    without an active exception") after a run that succeeded (6 times in 325 `torchrun … dtp apply`
    runs here). Every rank has flushed and closed what it wrote by now; nothing is left for
    finalisation to do.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
