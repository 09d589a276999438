"""Shared helpers: the repository root and a way to run the real `dtp` command line."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from cli_zygote import zygote

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def autograd_like_thread():
    """A thread named as autograd's device threads (`pt_autograd_0`), alive while in the block: what
    dtp.runtime.fork.autograd_forbids_fork looks for, without a GPU or torch 2.14's Inductor."""
    import ctypes

    from dtp.runtime import fork

    named, done = threading.Event(), threading.Event()

    def autograd_like():
        ctypes.CDLL(None).prctl(15, b"pt_autograd_0", 0, 0, 0)  # PR_SET_NAME
        named.set()
        done.wait()

    thread = threading.Thread(target=autograd_like, daemon=True)
    thread.start()
    try:
        named.wait(10)
        yield
    finally:
        done.set()
        thread.join()
        deadline = time.monotonic() + 10  # join returns before the thread's task is gone
        while fork.autograd_forbids_fork() and time.monotonic() < deadline:
            time.sleep(0.01)


@pytest.fixture(scope="session", autouse=True)
def _autograd_without_device_threads():
    """One backward on the CPU in each pytest worker before its first test. torch's autograd engine
    decides once per process, at its first backward, whether to run device threads; on torch 2.14 a
    process that has used Inductor (any torch.compile) decides yes without a GPU, and then no rank
    forked from it can run a backward: dtp's launcher spawns them instead (dtp/runtime/fork.py), and
    a test that patches this process for its ranks would lose the patch. A dtp command never
    compiles before its first backward; a worker running other tests before might."""
    import torch

    x = torch.ones(1, requires_grad=True)
    (x * 2).sum().backward()


def dtp_cli(
    *args: str, timeout: float = 180, env: dict | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Run `python -m dtp ARGS` from `cwd` (the repository root unless given; dtp is this checkout,
    installed or not): forked from this process's warm server (tests/cli_zygote.py), or, given an
    environment of its own (or under a test's changed one), a fresh interpreter; every process a
    fresh one starts carries a marker."""
    server = zygote(REPO)
    call_env = {**os.environ, "OMP_NUM_THREADS": "1", "DTP_TEST_MARK": uuid.uuid4().hex}
    if cwd != REPO:
        call_env["PYTHONPATH"] = str(REPO)
    if server.serves(env):
        return server.run(list(args), call_env, timeout, Path(cwd))
    return subprocess.run(
        [sys.executable, "-m", "dtp", *args],
        cwd=cwd,
        env={**call_env, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def default_sigint() -> None:
    """Popen's preexec_fn for a child that is sent Ctrl-C: SIGINT at its default, as a terminal's
    foreground job has it. A shell that starts the suite in the background hands SIGINT down
    ignored, and Python then keeps ignoring it (as it should: that is how nohup and `&` work), so
    the child would never see it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def processes_with_mark(mark: str) -> list[int]:
    """PIDs of live processes whose environment holds DTP_TEST_MARK=mark."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"DTP_TEST_MARK={mark}".encode() in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.fixture
def repo(monkeypatch) -> Path:
    """Run the test from the repository root (plans/ and tests/fixtures/ by relative path)."""
    monkeypatch.chdir(REPO)
    return REPO
