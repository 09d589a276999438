"""The linter configured in pyproject.toml ([tool.ruff]) finds nothing in dtp/ or tests/."""
from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_ruff_is_clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                           "dtp", "tests"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
