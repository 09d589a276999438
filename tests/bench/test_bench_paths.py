"""`dtp bench` proves its outputs writable before hours of benchmarks: /proc and devices are refused, exit 2."""
from __future__ import annotations

import os
import stat

import pytest

from dtp.cli import main


@pytest.mark.parametrize("argv, message", [
    (["--out", "/proc/dtp-bench"], "error: --out /proc/dtp-bench: cannot write there"),
    (["--json", "/dev/null"], "error: --json /dev/null is a character device; dtp writes only regular files"),
])
def test_bench_refuses_outputs_before_running(capsys, argv, message):
    assert main(["bench", "--smoke", "--no-fuzz", *argv]) == 2
    assert capsys.readouterr().err.startswith(message)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
