"""`dtp bench` proves its outputs writable before hours of benchmarks: /proc and devices are
refused, exit 2."""

from __future__ import annotations

import os
import stat

import pytest

from dtp.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--out", "/proc/dtp-bench"], "error: --out /proc/dtp-bench: cannot write there"),
        (
            ["--json", "/dev/null"],
            "error: --json /dev/null is a character device; dtp writes only regular files",
        ),
    ],
)
def test_bench_refuses_outputs_before_running(capsys, argv, message):
    assert main(["bench", "--smoke", "--no-fuzz", *argv]) == 2
    assert capsys.readouterr().err.startswith(message)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize(
    "value, message",
    [
        ("2", "error: --samples must be an integer from 3 to 1000, got 2"),
        ("1001", "error: --samples must be an integer from 3 to 1000, got 1001"),
        ("many", "--samples: expected a positive integer, got 'many'"),
    ],
)
def test_bench_bounds_its_samples(capsys, value, message):
    try:
        status = main(["bench", "--smoke", "--no-fuzz", "--samples", value])
    except SystemExit as exit_:  # argparse's own refusal
        status = exit_.code
    assert status == 2
    assert message in capsys.readouterr().err


def test_bench_samples_override_the_kind():
    from dtp.bench.run import configs

    cfgs = configs("quick", ("dtp", "megatron"), (2,), samples=60)
    assert [c.samples for part in cfgs.values() for c in part] == [60, 60]
    assert [c.samples for c in configs("quick", ("dtp",), (2,))["strong"]] == [20]
