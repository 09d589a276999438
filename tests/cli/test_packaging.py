"""The grammar, the profiles and every plan ship inside a non-editable wheel and are found there: an
installed dtp runs its own Quickstart (`dtp apply gpt2 gpt2-tiny`) from any directory."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest
from conftest import REPO


def test_wheel_carries_and_loads_the_grammar(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(REPO),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("dtp-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert "dtp/grammar/tp.lark" in names
        # `dtp bench`
        assert {"dtp/bench/run.py", "dtp/bench/megatron.py", "dtp/bench/gpu.py"} <= set(names)
        assert zf.read("dtp/grammar/tp.lark") == (REPO / "grammar" / "tp.lark").read_bytes()
        assert "dtp/profiles/dgx2h-v100.yaml" in names  # dtp simulate's shipped profiles
        site = tmp_path / "site"
        zf.extractall(site)
    code = (
        "import dtp, dtp.lang.parse as s; from pathlib import Path; "
        "assert Path(dtp.__file__).is_relative_to(Path(r'%s')), dtp.__file__; "
        "import dtp.simulate.profile as p; from dtp.files import shipped; "
        "assert shipped('profiles').is_relative_to(Path(r'%s')) and 'h200-sxm' in "
        "p.profile_names(); "
        "assert p.load('h200-sxm').name == 'h200-sxm'; "
        "assert shipped('plans/hf').is_relative_to(Path(r'%s')); "
        "assert (shipped('plans/hf') / 'llama.tp').is_file(); "
        "assert s.resolve_plan('gpt2').is_relative_to(Path(r'%s')), s.resolve_plan('gpt2'); "
        "assert s.load('gpt2').name == 'gpt2-megatron' and s.load('hf/llama').name == 'hf-llama'; "
        "print(len(s.parse('dtp 1\\nlm_head: vocab_parallel\\n').body))" % (site, site, site, site)
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_missing_shipped_data_is_named_not_guessed():
    from dtp.files import shipped

    assert shipped("grammar/tp.lark").is_file() and shipped("plans/hf").is_dir()
    with pytest.raises(
        FileNotFoundError, match="dtp is installed without its plans/nope: neither "
    ):
        shipped("plans/nope")
