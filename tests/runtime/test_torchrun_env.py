"""torchrun detection that a stray variable cannot fake: only TORCHELASTIC_RUN_ID or the
full, coherent set of WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT is a launch; a
partial set is ignored with one warning (the ranks start here, on loopback), an incoherent full set
is exit 2 at once — never a rendezvous that hangs past --timeout, never a store listening beyond
loopback."""

from __future__ import annotations

import time

import pytest
from conftest import dtp_cli

from dtp.errors import UsageError
from dtp.runtime import torchrun

FULL = {
    "WORLD_SIZE": "2",
    "RANK": "1",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}
CLEAN = (*torchrun.TORCHRUN_VARS, "TORCHELASTIC_RUN_ID")


@pytest.fixture
def env(monkeypatch):
    """Set exactly these torchrun variables (the others removed); the once-per-process warning
    re-armed."""

    def set_env(values: dict) -> None:
        for k in CLEAN:
            monkeypatch.delenv(k, raising=False)
        for k, v in values.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(torchrun, "_warned_partial", False)

    return set_env


def test_the_full_coherent_set_is_a_launch(env, capsys):
    env(FULL)
    assert torchrun.torchrun_world() == 2 and torchrun.under_torchrun()
    assert capsys.readouterr().err == ""


def test_no_variables_is_a_quiet_local_run(env, capsys):
    env({})
    assert torchrun.torchrun_world() is None and not torchrun.under_torchrun()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "values",
    [
        {"WORLD_SIZE": "2"},
        {"WORLD_SIZE": "abc"},
        # no MASTER_ADDR
        {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
        {k: v for k, v in FULL.items() if k != "MASTER_PORT"},
    ],
)
def test_a_partial_set_is_ignored_with_one_warning(env, capsys, values):
    env(values)
    assert torchrun.torchrun_world() is None and torchrun.torchrun_world() is None
    assert not torchrun.under_torchrun()
    err = capsys.readouterr().err
    assert (
        err.startswith("warning: ")
        and "ranks start here on loopback" in err
        and err.count("\n") == 1
    ), err


@pytest.mark.parametrize(
    "values,message",
    [
        ({**FULL, "RANK": "5"}, "RANK=5 is not a rank of WORLD_SIZE=2"),
        ({**FULL, "WORLD_SIZE": "abc"}, "torchrun's variables must be integers"),
        ({**FULL, "RANK": "-1"}, "RANK=-1 is not a rank of WORLD_SIZE=2"),
        ({**FULL, "RANK": "0", "LOCAL_RANK": "1"}, "LOCAL_RANK=1 cannot exceed RANK=0"),
        ({**FULL, "MASTER_PORT": "70000"}, "is not an address to rendezvous at"),
        (
            {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"},
            "TORCHELASTIC_RUN_ID is set but RANK, LOCAL_RANK",
        ),
    ],
)
def test_an_incoherent_full_set_is_a_usage_error(env, values, message):
    env(values)
    with pytest.raises(UsageError, match="not a launch dtp can join") as err:
        torchrun.torchrun_world()
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not torchrun.under_torchrun()  # dtp's exit path (cli.entry) never raises on it


def test_apply_with_an_incoherent_set_exits_2_at_once(repo):
    start = time.monotonic()
    proc = dtp_cli(
        "apply",
        "plans/gpt2.tp",
        "gpt2-tiny",
        "--steps",
        "1",
        "--timeout",
        "60",
        env={**FULL, "RANK": "5", "MASTER_PORT": "29999"},
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.startswith("error: RANK=5 is not a rank of WORLD_SIZE=2")
        and "Traceback" not in proc.stderr
    )
    assert time.monotonic() - start < 30


def test_apply_with_a_stray_world_size_runs_here_with_a_warning(repo):
    proc = dtp_cli(
        "apply",
        "plans/gpt2.tp",
        "gpt2-tiny",
        "--steps",
        "1",
        "--timeout",
        "120",
        env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("ranks start here on loopback") == 1, proc.stderr
    assert "parity" in proc.stdout.lower()
