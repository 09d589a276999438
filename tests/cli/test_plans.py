"""A PLAN argument may name a shipped plan (`gpt2`, `hf/llama`) from any directory; `dtp plans`
lists them."""

from __future__ import annotations

from conftest import REPO

from dtp.cli import main


def test_dtp_plans_lists_every_shipped_plan_by_name(capsys):
    assert main(["plans"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    expected = sorted(
        str(p.relative_to(REPO / "plans").with_suffix("")) for p in (REPO / "plans").rglob("*.tp")
    )
    assert names == expected and "gpt2" in names and "hf/llama" in names


def test_a_plan_name_works_outside_the_checkout(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["check", "gpt2", "gpt2-tiny", "--tp", "2"]) == 0
    assert capsys.readouterr().out.startswith("gpt2: ok on gpt2-tiny: ")
    assert main(["check", "gpt3", "gpt2-tiny"]) == 2
    assert capsys.readouterr().err == (
        "error: plan gpt3 is neither a file nor a plan dtp ships; did you mean 'gpt2'?; "
        "`dtp plans` lists them\n"
    )


def test_a_file_of_that_name_wins(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # the user's own file, not the shipped plan
    (tmp_path / "gpt2").write_text(
        "dtp 1\ntransformer.h.*.mlp.c_fc: colwise\ntransformer.h.*.mlp.c_proj: rowwise\n"
    )
    assert main(["check", "gpt2", "gpt2-tiny", "--tp", "2"]) == 0
    assert "4 modules claimed by 2 rules" in capsys.readouterr().out
