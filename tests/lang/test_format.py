"""`dtp fmt`: canonical text, comments kept, idempotent; format → parse is the identity on the IR."""

from __future__ import annotations

import shutil
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plan_strategies import plans

from dtp import cli
from dtp.errors import PlanError
from dtp.fuzz.cases import PIECES, mutated_texts
from dtp.lang import ir
from dtp.lang.format import format_expr, format_plan
from dtp.lang.parse import parse

ROOT = Path(__file__).resolve().parents[2]
GPT2_TP = ROOT / "plans" / "gpt2.tp"

MESSY = """\
# header comment


dtp   1
plan   messy-plan.v2   version  7
mesh dp,tp
transformer.wte :vocab_parallel   # embedding
# about the blocks
transformer.h.[0..11]{
  attn.c_attn:colwise( packed = 3 ,local=true )


        attn.c_proj :  rowwise(input=shard( 1 ),output=replicate)  # row
  set attn.head_dim=head_dim/tp
  mlp { c_fc: colwise }
  # last in block
}   # closes h
set transformer.h.0.mlp.c_fc.out_features = ((out_features)) * (2 - tp) - (1 - tp)
lm_head: vocab_parallel
# trailing comment
"""

MESSY_FORMATTED = """\
# header comment

dtp 1
plan messy-plan.v2 version 7
mesh dp, tp

transformer.wte: vocab_parallel  # embedding
# about the blocks
transformer.h.[0..11] {
    attn.c_attn: colwise(packed=3, local=true)

    attn.c_proj: rowwise(input=shard(1), output=replicate)  # row
    set attn.head_dim = head_dim / tp
    mlp {
        c_fc: colwise
    }
    # last in block
}  # closes h
set transformer.h.0.mlp.c_fc.out_features = out_features * (2 - tp) - (1 - tp)
lm_head: vocab_parallel
# trailing comment
"""


def fmt(text: str) -> str:
    plan = parse(text)
    return format_plan(plan, plan.source)


def test_shipped_plan_is_canonical():
    text = GPT2_TP.read_text(encoding="utf-8")
    assert fmt(text) == text


def test_formats_messy_plan_keeping_comments():
    assert fmt(MESSY) == MESSY_FORMATTED
    assert parse(MESSY_FORMATTED) == parse(MESSY)
    assert [c.text for c in parse(MESSY_FORMATTED).comments] == [
        c.text for c in parse(MESSY).comments
    ]


def test_idempotent():
    for text in (MESSY, GPT2_TP.read_text(encoding="utf-8"), "dtp 1\n", "dtp 1\na {}\n# end\n"):
        once = fmt(text)
        assert fmt(once) == once


def test_empty_block_and_bare_plan():
    # a blank line always separates header and body
    assert fmt("dtp 1\na { }\n") == "dtp 1\n\na {\n}\n"
    assert fmt("\n\ndtp 1\n\n\n") == "dtp 1\n"
    assert fmt("dtp 1\nmesh tp\n") == "dtp 1\nmesh tp\n"  # an explicit `mesh tp` is kept


def test_expression_parentheses_are_minimal_but_sufficient():
    def E(text: str) -> ir.Expr:
        return parse(f"dtp 1\nset x = {text}\n").body[0].expr

    cases = {
        "a - (b - c)": "a - (b - c)",
        "(a - b) - c": "a - b - c",
        "a / (b * c)": "a / (b * c)",
        "(a * b) / c": "a * b / c",
        "(a + b) * c": "(a + b) * c",
        "a + (b * c)": "a + b * c",
        "a * (b + c) / (d - 1)": "a * (b + c) / (d - 1)",
        "((((7))))": "7",
    }
    for src, want in cases.items():
        assert format_expr(E(src)) == want
        assert E(want) == E(src)


def test_cli_fmt_check(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["fmt", "--check", "plans/gpt2.tp"]) == 0
    assert capsys.readouterr() == ("", "")
    messy = tmp_path / "messy.tp"
    messy.write_text(MESSY, encoding="utf-8")
    assert cli.main(["fmt", "--check", "plans/gpt2.tp", str(messy)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"{messy}: not formatted (run `dtp fmt --write {messy}`)\n"
    assert messy.read_text(encoding="utf-8") == MESSY  # --check never writes


def test_cli_fmt_stdout_and_write(tmp_path, capsys):
    messy = tmp_path / "messy.tp"
    messy.write_text(MESSY, encoding="utf-8")
    assert cli.main(["fmt", str(messy)]) == 0
    assert capsys.readouterr() == (MESSY_FORMATTED, "")
    assert messy.read_text(encoding="utf-8") == MESSY

    assert cli.main(["fmt", "--write", str(messy)]) == 0
    assert capsys.readouterr() == (f"formatted {messy}\n", "")
    assert messy.read_text(encoding="utf-8") == MESSY_FORMATTED
    assert cli.main(["fmt", "--write", str(messy)]) == 0  # already formatted: silent, unchanged
    assert capsys.readouterr() == ("", "")
    assert cli.main(["fmt", "--check", str(messy)]) == 0


def test_cli_fmt_write_leaves_canonical_file_untouched(tmp_path, capsys):
    copy = tmp_path / "gpt2.tp"
    shutil.copy(GPT2_TP, copy)
    before = copy.stat().st_mtime_ns
    assert cli.main(["fmt", "--write", str(copy)]) == 0
    assert capsys.readouterr() == ("", "")
    assert copy.stat().st_mtime_ns == before


def test_cli_fmt_reports_plan_errors(tmp_path, capsys):
    bad = tmp_path / "bad.tp"
    bad.write_text("dtp 1\na: colwise rowwise\n", encoding="utf-8")
    assert cli.main(["fmt", "--write", str(bad)]) == 2
    assert capsys.readouterr().err == (
        f"{bad}:2:12: error: unexpected 'rowwise': a statement must end at the end "
        "of its line\n    a: colwise rowwise\n               ^~~~~~~\n"
    )
    assert bad.read_text(encoding="utf-8") == "dtp 1\na: colwise rowwise\n"


# ---- properties ----------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_format_then_parse_is_identity(plan):
    text = format_plan(plan)
    again = parse(text)
    assert again == plan
    assert format_plan(again, again.source) == text


_GPT2 = GPT2_TP.read_text(encoding="utf-8")
_ALPHABET = st.sampled_from(PIECES + list("abc_.*?:{}()[]=,+-/#0123456789 \t\n"))


def test_comment_after_a_form_feed_survives_fmt():
    # str.splitlines() breaks lines at a form feed, the grammar does not: comments follow the
    # grammar
    plan = parse("dtp 1\x0c\na: colwise  # trailing\n")
    assert format_plan(plan, plan.source) == "dtp 1\n\na: colwise  # trailing\n"


def _parse_or_plan_error(text: str) -> None:
    try:
        plan = parse(text)
    except PlanError as err:
        assert err.diagnostics
        err.render()  # rendering a diagnostic never fails either
        return
    # Whatever parses also formats, to text that parses back to the same plan with the same
    # comments.
    text = format_plan(plan, plan.source)
    again = parse(text)
    assert again == plan
    assert [c.text for c in again.comments] == [c.text for c in plan.comments]
    assert format_plan(again, again.source) == text


@settings(max_examples=250, deadline=None)
@given(mutated_texts([_GPT2]))
def test_mutated_plans_only_raise_plan_error(text):
    _parse_or_plan_error(text)


@settings(max_examples=250, deadline=None)
@given(
    st.one_of(
        st.text(max_size=200),
        st.lists(_ALPHABET, max_size=60).map("".join),
        st.lists(_ALPHABET, max_size=60).map(lambda parts: "dtp 1\n" + "".join(parts)),
    )
)
def test_arbitrary_text_only_raises_plan_error(text):
    _parse_or_plan_error(text)
