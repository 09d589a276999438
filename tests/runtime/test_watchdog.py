"""A rank that stops making progress ends the run within --stall-timeout, named with its step, under
dtp's launcher and under torchrun; torchrun's SIGTERM ends a rank blocked in a collective; a store
a rank hosts listens on MASTER_ADDR only."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from datetime import timedelta

from conftest import dtp_cli, processes_with_mark

from dtp.runtime.torchrun import _rendezvous, rendezvous_note
from dtp.runtime.watchdog import Record, verdict

TRAIN = [
    "train",
    "plans/gpt2.tp",
    "tests.fixtures.faults:gpt_stopped",
    "--tp",
    "2",
    "--steps",
    "100000",  # hours at this size: only the watchdog can end it
    "--batch",
    "4",
    "--seq",
    "32",
    "--eval-every",
    "100000",
    "--verify-every",
    "0",
    "--device",
    "cpu",
]


def _rec(tick: int, step: int, phase: str = "forward", idle: float = 40.0) -> Record:
    return Record(tick=tick, step=step, phase=phase, idle=idle)


def test_verdict_names_the_rank_that_stopped_then_the_one_behind():
    first = {0: _rec(5, 25), 1: _rec(9, 25), 2: _rec(5, 25)}
    # rank 1's record did not move between the reads: its process does not run
    second = {0: _rec(7, 25), 1: _rec(9, 25), 2: _rec(7, 25)}
    assert verdict(0, 30, first, second, 3) == (
        "rank 1 stopped running (a stopped or killed process); rank 0 waited for it 30 s at step "
        "25 (forward)"
    )
    # a rank that never published is not running either; one that first published between the
    # reads is
    assert verdict(0, 30, {0: _rec(1, 3)}, {0: _rec(2, 3), 1: _rec(1, 3)}, 3).startswith(
        "rank 2 stopped running"
    )
    # every rank runs, one still makes progress (rank 0 verifying alone): not a stall
    moving = {0: _rec(7, 25, idle=2.0), 1: _rec(10, 25), 2: _rec(7, 25)}
    assert verdict(1, 30, first, moving, 3) is None
    # every rank runs and waits; rank 2 is a phase behind the others
    behind = {0: _rec(7, 25, "backward"), 1: _rec(10, 25, "backward"), 2: _rec(6, 25)}
    assert verdict(0, 30, first, behind, 3) == (
        "rank 2 made no progress for 30 s at step 25 (forward), where the others wait for it"
    )
    same = {0: _rec(7, 25), 1: _rec(10, 25), 2: _rec(6, 25)}
    assert verdict(0, 30, first, same, 3).startswith(
        "no rank has made progress for 30 s, all at step 25 (forward)"
    )


def test_a_stopped_rank_ends_the_run_within_the_stall_timeout(repo, tmp_path):
    mark = uuid.uuid4().hex
    start = time.monotonic()
    proc = dtp_cli(
        *TRAIN,
        "--stall-timeout",
        "3",
        "--timeout",
        "3600",
        "--out",
        str(tmp_path / "run"),
        env={"DTP_STOP_AT": "3", "DTP_TEST_MARK": mark},
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith(
        "error: the run failed on rank 0 in step 3: stalled (--stall-timeout 3 s): rank 1 stopped "
        "running (a stopped or killed process); rank 0 waited for it 3 s at step 3 (forward)"
    ), proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 100  # not the hour --timeout allows
    assert processes_with_mark(mark) == []  # the stopped rank too (SIGKILL reaches it)


def _torchrun(args: list[str], env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    return subprocess.Popen(
        [*cmd, "-m", "dtp", *args],
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_under_torchrun_the_stalled_rank_is_named_and_the_job_fails(repo, tmp_path):
    mark = uuid.uuid4().hex
    args = [*TRAIN, "--stall-timeout", "3", "--out", str(tmp_path / "run")]
    proc = _torchrun(args, {"DTP_STOP_AT": "3", "DTP_TEST_MARK": mark})
    try:
        _, err = proc.communicate(timeout=150)  # torchrun waits 30 s for the stopped worker
    finally:
        _kill_group(proc, mark)
    assert proc.returncode == 1, err[-2000:]
    assert (
        "error: rank 0 in step 3: stalled (--stall-timeout 3 s): rank 1 stopped running (a stopped "
        "or killed process); rank 0 waited for it 3 s at step 3 (forward)"
    ) in err, err[-2000:]
    # torchrun's own failure summary carries it too (its error file)
    assert (
        "step 3: stalled (--stall-timeout 3 s): rank 1 stopped running"
        in err.split("Root Cause")[-1]
    )
    assert processes_with_mark(mark) == []


def _kill_group(proc: subprocess.Popen, mark: str) -> None:
    """torchrun and its workers (in sessions of their own), whatever state the test left them in."""
    for pid in [proc.pid, *processes_with_mark(mark)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _worker(mark: str, local_rank: int) -> int | None:
    """The torchrun worker (not the agent) of this test with this LOCAL_RANK."""
    for pid in processes_with_mark(mark):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={local_rank}".encode() in env:
            return pid
    return None


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_torchrun_sigterm_ends_a_rank_blocked_in_a_collective(repo, tmp_path):
    mark = uuid.uuid4().hex
    args = [*TRAIN, "--stall-timeout", "0", "--out", str(tmp_path / "run")]
    proc = _torchrun(args, {"DTP_STOP_AT": "3", "DTP_TEST_MARK": mark})
    try:
        deadline = time.monotonic() + 90
        stopped = None
        while time.monotonic() < deadline and stopped is None:
            time.sleep(0.5)
            pid = _worker(mark, 1)
            stopped = pid if pid and _state(pid) == "T" else None
        assert stopped, "rank 1 never stopped itself"
        time.sleep(2)  # rank 0 is now inside step 3's first collective, waiting for rank 1
        rank0 = _worker(mark, 0)
        os.kill(rank0, signal.SIGTERM)
        sent = time.monotonic()
        while os.path.exists(f"/proc/{rank0}") and _state(rank0) != "Z":
            assert time.monotonic() - sent < 20, "rank 0 ignored SIGTERM inside the collective"
            time.sleep(0.2)
    finally:
        _kill_group(proc, mark)
        _, err = proc.communicate(timeout=60)
    assert "terminated" in err, err[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening_on(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            addr, _, hexport = f[1].rpartition(":")
            if f[3] == "0A" and int(hexport, 16) == port:
                out.append(addr)
    return out


def test_a_store_rank_0_hosts_listens_on_master_addr_only(monkeypatch):
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(key, "")  # recorded, so that what _rendezvous sets is undone after
        monkeypatch.delenv(key)
    for host in ("127.0.0.1", "localhost"):
        port = _free_port()
        env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR=host)
        for key, value in {**env, "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        store, rank, world = _rendezvous(timedelta(seconds=10))
        store.set("k", "v")
        assert (rank, world, store.get("k")) == (0, 1, b"v")
        # a loopback MASTER_ADDR keeps gloo's and NCCL's sockets on loopback too
        assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == ("lo", "lo")
        # 127.0.0.1 (or ::1), never 0.0.0.0 or ::, which torch's own env:// store listens on
        assert _listening_on(port) in (["0100007F"], ["00000000000000000000000001000000"])
        del store
    assert rendezvous_note() is None  # localhost
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert rendezvous_note() == (
        "note: MASTER_ADDR=10.1.2.3 is not a loopback address: the rendezvous store "
        f"(10.1.2.3:{port}) and the process group listen on the network"
    )
