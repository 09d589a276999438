"""`dtp simulate --reproduce` reads the plans dtp ships through the package (dtp.files.shipped),
never the working directory, so an installed dtp reproduces the published rows from any directory.
`--reproduce all` takes about a minute on the 2-core CPU machine, so one source runs whole from an
empty directory, and the paper's sweep (tests/simulate/test_reproduce.py runs it) is followed only
to the plan it is handed."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtp.cli import main
from dtp.files import shipped
from dtp.simulate import sweep


def test_a_source_reproduces_from_an_empty_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--reproduce", "torchtitan-a100", "--markdown", "rows.md"]) == 0
    out = capsys.readouterr().out
    assert "| 8B FSDP 64, per-op checkpointing |" in out and "(fitted)" in out
    assert (tmp_path / "rows.md").read_text() == out
    # nothing written here but the output
    assert [p.name for p in tmp_path.iterdir()] == ["rows.md"]


class _Handed(Exception):
    pass


def test_the_paper_sweep_is_handed_the_shipped_plan(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def prepare(plan, strong_model):
        raise _Handed(plan)

    monkeypatch.setattr(sweep, "prepare", prepare)
    with pytest.raises(_Handed) as handed:
        main(["simulate", "--reproduce", "megatron2019"])
    assert (
        Path(handed.value.args[0]) == shipped("plans/gpt2.tp")
        and Path(handed.value.args[0]).is_absolute()
    )
