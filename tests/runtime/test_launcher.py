"""The local launcher: a rank that cannot join the process group restarts the launch once, nothing
else does; a timeout names where each stuck rank was."""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import pytest

from dtp.errors import RunError
from dtp.runtime import launcher
from dtp.runtime.launcher import launch_local


def _flaky_join(marks: Path, fail_times: int):
    real = launcher.init_rank

    def init_rank(rank, world, port, device, timeout, threads=1):
        if rank == 1:
            tries = len(list(marks.iterdir()))
            (marks / f"try-{tries}").touch()
            if tries < fail_times:
                raise RuntimeError(
                    "Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer"
                )
        real(rank, world, port, device, timeout, threads)

    return init_rank


def _sum_of_ranks(rank, world, calls: str):
    import torch
    import torch.distributed as dist

    Path(calls, f"rank{rank}-{len(list(Path(calls).iterdir()))}").touch()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_a_failed_rendezvous_starts_the_ranks_once_more(tmp_path, monkeypatch, capsys):
    (marks := tmp_path / "marks").mkdir()
    (calls := tmp_path / "calls").mkdir()
    monkeypatch.setattr(launcher, "init_rank", _flaky_join(marks, 1))  # the forked ranks inherit it
    assert launch_local(_sum_of_ranks, 2, str(calls), timeout=60) == [1.0, 1.0]
    assert len(list(marks.iterdir())) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "warning: the run failed on rank 1 in rendezvous: RuntimeError: Gloo connectFullMesh"
    )
    assert err.endswith("; the ranks were started again\n")


def test_a_rendezvous_that_fails_twice_is_the_error(tmp_path, monkeypatch):
    (marks := tmp_path / "marks").mkdir()
    (calls := tmp_path / "calls").mkdir()
    monkeypatch.setattr(launcher, "init_rank", _flaky_join(marks, 2))
    with pytest.raises(
        RunError, match=r"^the run failed on rank 1 in rendezvous: RuntimeError: Gloo"
    ) as info:
        launch_local(_sum_of_ranks, 2, str(calls), timeout=60)
    assert info.value.rank == 1 and len(list(marks.iterdir())) == 2


def _fails_on_rank1(rank, world):
    if rank == 1:
        raise ValueError("the model's own error")
    return rank


def test_a_failure_after_the_rendezvous_is_never_retried(tmp_path, monkeypatch, capsys):
    (marks := tmp_path / "marks").mkdir()
    monkeypatch.setattr(launcher, "init_rank", _flaky_join(marks, 0))  # counts the starts of rank 1
    with pytest.raises(
        RunError, match=r"^the run failed on rank 1 in start-up: ValueError: the model's own error"
    ):
        launch_local(_fails_on_rank1, 2, timeout=60)
    assert len(list(marks.iterdir())) == 1
    assert "warning" not in capsys.readouterr().err


def _raises_then_exits_slowly(rank, world, raised: str):
    import torch.distributed as dist

    # the launcher tears the process group down after a rank's error: here that takes 2 s, as
    # gloo's can on a loaded machine, and the peer fails meanwhile because of this rank
    dist.destroy_process_group = lambda *a, **k: time.sleep(2.0)
    Path(raised).touch()
    raise ValueError("the model's own error")


def test_a_peer_failing_in_the_rendezvous_because_of_a_rank_is_not_the_error(
    tmp_path, monkeypatch, capsys
):
    """Seen on CI: rank 1 got through the rendezvous and raised; rank 0, still connecting, failed
    'closed by peer' and exited before rank 1 had. The first error is the one raised first."""
    (marks := tmp_path / "marks").mkdir()
    raised = tmp_path / "raised"

    def init_rank(rank, world, port, device, timeout, threads=1):
        (marks / f"rank{rank}").touch()
        if rank == 0:
            while not raised.exists():
                time.sleep(0.01)
            time.sleep(0.2)
            raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed")

    monkeypatch.setattr(launcher, "init_rank", init_rank)
    with pytest.raises(
        RunError, match=r"^the run failed on rank 1 in start-up: ValueError: the model's own error"
    ) as info:
        launch_local(_raises_then_exits_slowly, 2, str(raised), timeout=60)
    assert "(1 other rank(s) failed too)" in str(info.value)
    assert sorted(p.name for p in marks.iterdir()) == ["rank0", "rank1"]  # started once
    assert "warning" not in capsys.readouterr().err


def _line_of(fn, text: str) -> int:
    """The file line of `fn`'s first source line holding `text`."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _stuck_on_rank0(rank, world):
    import time

    if rank == 0:
        time.sleep(3600)
    return rank


def test_a_timeout_says_where_each_rank_was(tmp_path):
    with pytest.raises(RunError) as info:
        launch_local(_stuck_on_rank0, 2, timeout=10)
    message = str(info.value)
    assert message.startswith(
        "the run did not finish within --timeout 10 s; every rank was stopped"
    )
    where = message.split("; where each rank was: ")[1]
    line = _line_of(_stuck_on_rank0, "time.sleep(3600)")
    assert where.startswith(f"rank 0: test_launcher.py:{line} _stuck_on_rank0 <- launcher.py:"), (
        message
    )
    assert "rank 1" not in where  # it returned its result


def test_a_fuzz_rank_pool_whose_rendezvous_fails_starts_once_more(tmp_path, monkeypatch):
    from dtp.fuzz import pool

    (marks := tmp_path / "marks").mkdir()
    monkeypatch.setattr(pool, "init_rank", _flaky_join(marks, 1))
    ranks = pool.RankPool(2)
    try:
        assert ranks.alive and len(list(marks.iterdir())) == 2
    finally:
        ranks.close()
    assert not ranks.alive


_FINALISING = """
import atexit, sys
atexit.register(lambda: print("finalised", flush=True))  # runs only if the interpreter is finalised
sys.argv = ["dtp", "check", sys.argv[1], "gpt2-tiny"]
from dtp.cli import entry
entry()
"""


@pytest.mark.parametrize("torchrun", [True, False])
def test_a_torchrun_rank_leaves_without_finalising_the_interpreter(repo, tmp_path, torchrun):
    # Finalising can abort a rank whose run succeeded (gloo's worker thread still holds the last
    # collective's tensors); a torchrun rank must skip it, and keep its exit status.
    import os
    import subprocess
    import sys

    bad = tmp_path / "bad.tp"
    bad.write_text((repo / "plans/gpt2.tp").read_text().replace("colwise", "colwize", 1))
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_RUN_ID",
        )
    }
    if torchrun:  # the full set torchrun exports (a partial one is a stray variable, not a launch)
        env.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"
        )
    for plan, code in ((repo / "plans/gpt2.tp", 0), (bad, 2)):
        proc = subprocess.run(
            [sys.executable, "-c", _FINALISING, str(plan)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == code, proc.stderr
        assert ("finalised" in proc.stdout) is not torchrun


def _threads(rank, world):
    import os

    import torch

    return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]


def test_ranks_share_out_the_cores_unless_told(monkeypatch):
    from dtp.runtime.threads import cores, threads_per_rank

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_per_rank(1) == cores() and threads_per_rank(2 * cores()) == 1
    assert threads_per_rank(1, 3) == 3  # --threads
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the test harness's, or the user's
    assert threads_per_rank(1) == 1
    assert launch_local(_threads, 2, timeout=60, threads=2) == [(2, "2"), (2, "2")]


def _crash_on_rank0(rank, world):
    import ctypes

    if rank == 0:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return rank


def test_a_crashed_rank_is_named_with_where_it_crashed():
    with pytest.raises(RunError) as info:
        launch_local(_crash_on_rank0, 2, timeout=60)
    line = _line_of(_crash_on_rank0, "ctypes.string_at(0)")
    message = str(info.value)
    # the innermost frame is ctypes' own string_at, which calls into C
    assert message.startswith("the run failed: rank 0 was killed by SIGSEGV at __init__.py:"), (
        message
    )
    assert f" string_at <- test_launcher.py:{line} _crash_on_rank0 <- launcher.py:" in message


class _Holder:
    pass


def _collect(rank, world):
    import gc

    return gc.collect() >= 0


def test_a_rank_never_collects_what_it_inherits():
    """A process group this process still holds, in a reference cycle nothing collected yet: a
    forked rank that collected it would run its destructor without the group's worker threads and
    hang there (as it did before the launcher froze what the ranks inherit)."""
    import gc
    import weakref
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    gc.disable()  # the cycle stays until the ranks have forked
    try:
        store = dist.TCPStore(
            "127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        group = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=30))
        group.allreduce([torch.ones(2)]).wait()  # its threads have run
        holder = _Holder()
        holder.group, holder.store, holder.cycle = group, store, holder
        alive = weakref.ref(holder)
        del holder, group, store
        assert launch_local(_collect, 2, timeout=30) == [True, True]
        assert alive() is not None  # the ranks forked with the cycle in this process
    finally:
        gc.enable()
        gc.collect()  # here, where the group's threads are, its destructor joins them
    assert alive() is None


def _parallel_work(rank, world):
    import torch

    torch.randn(1 << 22).exp_().sum()  # a parallel region on the rank's two threads
    return torch.get_num_threads()


def test_ranks_run_on_two_threads_after_this_process_did():
    """GNU OpenMP's pool of a thread that ran a parallel region on two threads is inherited by a
    process forked from that thread, without its threads: the rank's first parallel region waited
    for them forever (dtp train --tp 1 on 2 cores hung so)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.randn(1 << 22).exp_().sum()  # this thread's pool now exists
    finally:
        torch.set_num_threads(before)
    assert launch_local(_parallel_work, 2, timeout=30, threads=2) == [2, 2]


def _backward_where(rank, world):
    import sys

    import torch

    x = torch.ones(3, requires_grad=True)
    (x * 2).sum().backward()
    return float(x.grad.sum()), "--multiprocessing-fork" in sys.orig_argv  # a spawned child's


def test_ranks_are_spawned_where_autograd_threads_forbid_a_fork():
    """torch marks every child forked after autograd started its device threads unable to run a
    backward (torch 2.14 starts them for an Inductor-compiled backward on the CPU too): the ranks of
    such a process are spawned. A thread named as autograd's stands in for them here."""
    from conftest import autograd_like_thread

    from dtp.runtime import fork

    assert not fork.autograd_forbids_fork()
    assert launch_local(_backward_where, 2, timeout=60) == [(6.0, False)] * 2  # forked
    with autograd_like_thread():
        assert fork.autograd_forbids_fork()
        assert launch_local(_backward_where, 2, timeout=120) == [(6.0, True)] * 2  # spawned
    assert not fork.autograd_forbids_fork()
