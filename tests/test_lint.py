"""The linter and formatter configured in pyproject.toml ([tool.ruff]) find nothing in dtp/, tests/, bench/."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_ruff_is_clean() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--no-cache",
            "--output-format",
            "concise",
            "dtp",
            "tests",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_is_the_house_format() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "dtp", "tests", "bench"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_lines_over_100_characters_are_under_2_percent() -> None:
    """What the formatter cannot wrap (a table row, a URL, a long message kept whole) stays rare."""
    for folder in ("dtp", "tests"):
        lines = [
            line for path in (REPO / folder).rglob("*.py") for line in path.read_text().splitlines()
        ]
        long = sum(len(line) > 100 for line in lines)
        assert long / len(lines) < 0.02, (
            f"{folder}: {long} of {len(lines)} lines over 100 characters"
        )
