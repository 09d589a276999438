"""`dtp fmt`, `dtp check PLAN` (no MODEL) and `dtp --help` never import torch: they must stay instant enough
for an editor's save hook (torch alone takes seconds to import)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import contextlib, io, json, sys
from dtp.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exit:
        code = exit.code
print(json.dumps({"code": code, "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:3]}))
"""


def _run(repo, *argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=repo, capture_output=True, text=True,
                          timeout=60)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [("fmt", "plans/gpt2.tp"), ("fmt", "--check", "plans/gpt2-sp.tp"),
                                  ("check", "plans/llama.tp"), ("--help",)])
def test_command_does_not_import_torch(repo, argv):
    result = _run(repo, *argv)
    assert result == {"code": 0, "torch": []}


def test_probe_sees_torch_when_a_model_is_checked(repo):
    """The probe itself can fail: checking against a model does import torch."""
    result = _run(repo, "check", "plans/gpt2.tp", "gpt2-tiny", "--tp", "2")
    assert result["code"] == 0 and "torch" in result["torch"]
