"""Safety where ranks run: loopback-only rendezvous, the rank that died first is named, timeouts,
and nothing left behind after SIGTERM or Ctrl-C (processes, temp dirs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

from conftest import default_sigint, dtp_cli, processes_with_mark

LOOPBACK = ("0100007F", "00000000000000000000000001000000")  # 127.0.0.1 in /proc/net/tcp and tcp6


def _listening(pids: list[int]) -> list[str]:
    """Local addresses of the TCP sockets these processes listen on (hex, as /proc/net/tcp* writes
    them)."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = (
                os.readlink(f"/proc/{pid}/fd/{fd}")
                if os.path.islink(f"/proc/{pid}/fd/{fd}")
                else ""
            )
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                out.append(f[1])
    return out


def _sockets_of_rank_and_launcher(rank: int, world: int) -> list[str]:
    return _listening([os.getpid(), os.getppid()])


def test_local_ranks_listen_on_loopback_only(tmp_path, monkeypatch):
    from dtp.runtime.ranks import on_ranks

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    r0, r1 = on_ranks(_sockets_of_rank_and_launcher, 2)
    assert r0 and r1  # the store (launcher) and gloo's own sockets
    assert all(addr.split(":")[0] in LOOPBACK for addr in r0 + r1), r0 + r1
    # the launcher's temp dir is gone
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("dtp-")] == []


def test_rank_that_exits_silently_is_named(repo):
    proc = dtp_cli(
        "apply",
        "plans/gpt2.tp",
        "tests.fixtures.hostile_models:exit_on_rank1",
        "--tp",
        "2",
        "--steps",
        "1",
        "--device",
        "cpu",
        "--timeout",
        "60",
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[0].startswith(
        "error: the sharded run failed: rank 1 exited (status 0) without returning a result"
    ), proc.stderr
    assert "Traceback" not in proc.stderr


def test_factory_that_changes_directory_does_not_move_plan_or_json(repo, tmp_path):
    out = tmp_path / "r.json"
    rel = os.path.relpath(out, repo)
    proc = dtp_cli(
        "apply",
        "plans/gpt2.tp",
        "tests.fixtures.hostile_models:chdir_tiny",
        "--tp",
        "2",
        "--steps",
        "1",
        "--device",
        "cpu",
        "--json",
        rel,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["parity"]["ok"]


def test_tiny_timeout_is_the_timeout_message_and_leaves_nothing(repo, tmp_path):
    mark = uuid.uuid4().hex
    proc = dtp_cli(
        "apply",
        "plans/gpt2.tp",
        "gpt2-tiny",
        "--tp",
        "2",
        "--device",
        "cpu",
        "--timeout",
        "0.001",
        env={"DTP_TEST_MARK": mark, "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 1
    first, _, where = proc.stderr.partition("; where each rank was: ")
    assert first.rstrip("\n") == (
        "error: the sharded run did not finish within --timeout 0.001 s; every rank was "
        "stopped (a rank may be stuck in a collective that another rank never joined)"
    )
    assert proc.stderr.count("\n") == 1 and (where == "" or where.startswith("rank ")), proc.stderr
    time.sleep(0.3)
    assert processes_with_mark(mark) == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("dtp-")] == []


def _start(repo, tmp_path, mark: str, *argv: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DTP_TEST_MARK": mark, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtp", *argv],
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    deadline = time.monotonic() + 90
    while (
        not any(p.name.startswith("dtp-") for p in tmp_path.iterdir())
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)  # the temp dir exists once ranks are starting
    time.sleep(1)
    return proc


def test_sigterm_during_apply_stops_ranks_and_removes_temp_dirs(repo, tmp_path):
    mark = uuid.uuid4().hex
    proc = _start(
        repo,
        tmp_path,
        mark,
        "apply",
        "plans/gpt2.tp",
        "tests.fixtures.broken_models:hang_on_rank1",
        "--tp",
        "2",
        "--device",
        "cpu",
        "--timeout",
        "120",
    )
    assert any(p.name.startswith("dtp-apply-") for p in tmp_path.iterdir())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (143, "terminated\n")
    time.sleep(0.3)
    assert processes_with_mark(mark) == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("dtp-")] == []


def test_ctrl_c_during_fuzz_is_one_line_and_leaves_nothing(repo, tmp_path):
    mark = uuid.uuid4().hex
    proc = _start(
        repo, tmp_path, mark, "fuzz", "--examples", "1000", "--max-world", "2", "--seed", "3"
    )
    time.sleep(1)  # the pools are running examples
    # as a terminal does: the whole foreground group gets Ctrl-C
    for pid in processes_with_mark(mark):
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    _, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (130, "interrupted\n")
    time.sleep(0.3)
    assert processes_with_mark(mark) == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("dtp-")] == []
