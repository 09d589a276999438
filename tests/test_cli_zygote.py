"""The suite's warm `python -m dtp` (tests/cli_zygote.py, behind conftest.dtp_cli) is the fresh one:
the same exit status, stdout and stderr, and the same `sys.path` (pytest's holds tests/, a fresh
`python -m dtp`'s does not); a call it cannot make faithfully goes to a fresh interpreter."""

from __future__ import annotations

import os

import pytest
from cli_zygote import zygote
from conftest import REPO, dtp_cli


@pytest.mark.parametrize(
    "argv, code",
    [
        (("check", "plans/gpt2.tp", "gpt2-tiny", "--tp", "2"), 0),  # torch imported, a table
        (("check", "plans/gpt2.tp", "conftest:dtp_cli"), 2),  # a module only pytest's path holds
        (("fuzz", "--replay", "README.md"), 2),  # a usage error
        (("apply", "plans/gpt2.tp", "gpt2-tiny", "--tp", "0"), 2),  # a flag argparse refuses
    ],
)
def test_forked_command_line_is_the_fresh_one(argv, code):
    fresh = dtp_cli(*argv, env={}, timeout=120)  # an environment of its own: a fresh interpreter
    warm = zygote(REPO).run(list(argv), {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert fresh.returncode == code, fresh.stderr
    assert (warm.returncode, warm.stdout, warm.stderr) == (
        fresh.returncode,
        fresh.stdout,
        fresh.stderr,
    )


def test_what_a_fork_cannot_reproduce_goes_to_a_fresh_interpreter(monkeypatch):
    server = zygote(REPO)
    # a variable an earlier test left changed would send every later call of its worker to a fresh
    # interpreter (and means that test leaks its environment)
    assert server.serves(None), server.changed()
    assert not server.serves({"DTP_TEST_MARK": "x"})  # /proc/PID/environ keeps the server's
    monkeypatch.setenv("DTP_TEST_ZYGOTE_PROBE", "1")  # a variable a library may read at import
    assert not server.serves(None)
