"""`dtp fmt`, `dtp check PLAN` (no MODEL) and `dtp --help` never import torch: they must stay
instant enough for an editor's save hook (torch alone takes seconds to import)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# The console script's own path (`entry`: main, then the torchrun check on the way out); the modules
# loaded are reported at interpreter exit, after everything the command did.
PROBE = """
import atexit, contextlib, io, json, sys
from dtp.cli import entry
atexit.register(lambda: sys.__stdout__.write(json.dumps(
    {"torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:3]}) + "\\n"))
sys.argv = ["dtp", *sys.argv[1:]]
with contextlib.redirect_stdout(io.StringIO()):
    entry()
"""


def _run(repo, *argv: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], cwd=repo, capture_output=True, text=True, timeout=60
    )
    return {"code": done.returncode, **json.loads(done.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize(
    "argv",
    [
        ("fmt", "plans/gpt2.tp"),
        ("fmt", "--check", "plans/gpt2-sp.tp"),
        ("check", "plans/llama.tp"),
        ("--help",),
    ],
)
def test_command_does_not_import_torch(repo, argv):
    result = _run(repo, *argv)
    assert result == {"code": 0, "torch": []}


def test_probe_sees_torch_when_a_model_is_checked(repo):
    """The probe itself can fail: checking against a model does import torch."""
    result = _run(repo, "check", "plans/gpt2.tp", "gpt2-tiny", "--tp", "2")
    assert result["code"] == 0 and "torch" in result["torch"]
