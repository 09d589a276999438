"""The parser and IR: positions, comments, pattern semantics, specificity, and hostile inputs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dtp import cli
from dtp.errors import PlanError, Pos, UsageError
from dtp.lang import ir
from dtp.lang.parse import MAX_INT, load, parse
from dtp.layout.resolve import matches, specificity

ROOT = Path(__file__).resolve().parents[2]
GPT2_TP = ROOT / "plans" / "gpt2.tp"


def P(text: str) -> ir.Pattern:
    """The pattern of a one-rule plan `TEXT: replicate`."""
    return parse(f"dtp 1\n{text}: replicate\n").body[0].pattern


def diag_lines(err: PlanError) -> list[tuple[int, int, str]]:
    return [(d.pos.line, d.pos.column, d.message) for d in err.diagnostics]


# ---- positions ---------------------------------------------------------------------------------------


def test_positions_of_header_rules_styles_and_options():
    plan = load(GPT2_TP)
    f = str(GPT2_TP)
    assert (plan.version_pos, plan.plan_pos, plan.mesh_pos) == (
        Pos(f, 4, 5),
        Pos(f, 5, 1),
        Pos(f, 6, 1),
    )
    assert (
        plan.file == f
        and plan.name == "gpt2-megatron"
        and plan.plan_version == 1
        and plan.mesh == ("tp",)
    )
    wte, block, lm_head = plan.body
    assert (wte.pos, wte.pattern.pos, wte.style.pos) == (Pos(f, 8, 1), Pos(f, 8, 1), Pos(f, 8, 18))
    assert (block.pos, block.end) == (Pos(f, 10, 1), Pos(f, 15, 1))
    c_attn, attn_proj, c_fc, mlp_proj = block.body
    assert (c_attn.pos.line, c_attn.pos.column) == (11, 5)
    assert (c_attn.style.pos.line, c_attn.style.pos.column) == (11, 18)
    (packed,) = c_attn.style.options
    assert (packed.key, packed.value) == ("packed", 3)
    assert (packed.pos.line, packed.pos.column) == (11, 26)
    assert (packed.value_pos.line, packed.value_pos.column) == (11, 33)
    assert [(r.pos.line, r.style.pos.column) for r in (attn_proj, c_fc, mlp_proj)] == [
        (12, 18),
        (13, 15),
        (14, 17),
    ]
    assert (lm_head.pos.line, lm_head.style.pos.column) == (17, 10)


def test_positions_of_set_statements_and_expressions():
    src = (
        "dtp 1\n"
        "transformer.h.* {\n"
        "    set attn.c_attn.out_features = (out_features * 2) / tp - 1\n"
        "}\n"
        "set n = 7\n"
    )
    plan = parse(src, "x.tp")
    block, top = plan.body
    s = block.body[0]
    assert s == ir.SetAttr(
        ir.Pattern(("attn", "c_attn")),
        "out_features",
        ir.BinOp(
            "-",
            ir.BinOp("/", ir.BinOp("*", ir.Var("out_features"), ir.Num(2)), ir.Var("tp")),
            ir.Num(1),
        ),
    )
    assert (s.pos.line, s.pos.column) == (3, 5)  # `set`
    assert (s.pattern.pos.line, s.pattern.pos.column) == (3, 9)  # the target
    minus, div = s.expr, s.expr.left
    mul = div.left
    cols = [
        minus.pos.column,
        div.pos.column,
        mul.pos.column,
        mul.left.pos.column,
        mul.right.pos.column,
        div.right.pos.column,
        minus.right.pos.column,
    ]
    assert cols == [60, 55, 50, 37, 52, 57, 62]  # - / * out_features 2 tp 1
    assert all(
        e.pos.line == 3 and e.pos.file == "x.tp" for e in (minus, div, mul, mul.left, div.right)
    )
    assert top == ir.SetAttr(ir.Pattern(()), "n", ir.Num(7))
    assert (top.pos.line, top.pos.column, top.pattern.pos.column) == (5, 1, 5)
    assert (block.end.line, block.end.column) == (4, 1)


def test_positions_are_not_part_of_equality():
    a = parse("dtp 1\na.b: colwise(packed=3)\n")
    b = parse("\n\ndtp   1\n\n\n    a.b  :   colwise( packed = 3 )   # moved\n")
    assert a == b
    assert a.body[0].pos.line == 2 and b.body[0].pos.line == 6


def test_comments_are_captured_with_position_and_kind():
    plan = load(GPT2_TP)
    got = [(c.pos.line, c.pos.column, c.trailing, c.text) for c in plan.comments]
    assert got == [
        (
            1,
            1,
            False,
            "# Megatron-LM tensor parallelism for GPT-2 (Shoeybi et al., 2019, section 3):",
        ),
        (
            2,
            1,
            False,
            "# attention heads and the MLP's first matrix split by columns, the second matrices by "
            "rows,",
        ),
        (
            3,
            1,
            False,
            "# the embedding and the loss split by vocabulary. 4 all-reduces per block per training "
            "step.",
        ),
        (8, 34, True, "# VocabParallelEmbedding: rows split, output all-reduced"),
        (11, 37, True, "# fused q, k, v: every rank holds whole heads of each"),
        (17, 26, True, "# tied to wte; logits stay sharded, cross-entropy is vocab-parallel"),
    ]
    indented = parse("dtp 1\na {\n    # inside   \n}\n").comments
    assert [(c.pos.line, c.pos.column, c.trailing, c.text) for c in indented] == [
        (3, 5, False, "# inside")
    ]


def test_crlf_line_endings_parse_like_lf():
    text = GPT2_TP.read_text(encoding="utf-8")
    assert parse(text.replace("\n", "\r\n")) == parse(text)


# ---- values and patterns ------------------------------------------------------------------------------


def test_option_values_are_typed():
    rule = parse(
        "dtp 1\na: colwise(packed=3, local=true, x=false, input=shard(-1), output=partial, "
        "y=replicate, z=shard, w=foo(2))\n"
    ).body[0]
    assert [(o.key, o.value) for o in rule.style.options] == [
        ("packed", 3),
        ("local", True),
        ("x", False),
        ("input", ir.Layout("shard", -1)),
        ("output", ir.Layout("partial")),
        ("y", ir.Layout("replicate")),
        ("z", "shard"),
        ("w", "foo(2)"),
    ]
    assert rule.style.option("packed") == 3 and rule.style.option("missing", 7) == 7
    assert parse("dtp 1\na: colwise()\n").body[0].style == ir.Style("colwise", ())


def test_pattern_segments():
    assert P("transformer.h.[0..11].**.c_*").segments == (
        "transformer",
        "h",
        ir.IndexRange(0, 11),
        "**",
        "c_*",
    )
    assert P("[3..3]").segments == (ir.IndexRange(3, 3),)
    assert P("a.[10..20].[1..2]").segments == ("a", ir.IndexRange(10, 20), ir.IndexRange(1, 2))
    assert P("ln_?.0").segments == ("ln_?", "0")
    assert str(P("transformer.h.[0..11].**.c_*")) == "transformer.h.[0..11].**.c_*"


def test_flatten_applies_block_prefixes():
    plan = parse(
        "dtp 1\na.* {\n    b {\n        c: colwise\n        set d.e = 1\n    }\n}\nf: rowwise\n"
    )
    rules, sets, blocks = ir.flatten(plan)
    assert [(str(r.pattern), r.style.name, r.pos.line) for r in rules] == [
        ("a.*.b.c", "colwise", 4),
        ("f", "rowwise", 8),
    ]
    assert [(str(s.pattern), s.attr, s.pos.line) for s in sets] == [("a.*.b.d", "e", 5)]
    assert [str(b) for b in blocks] == ["a.*", "a.*.b"]


@pytest.mark.parametrize(
    "pattern, path, expected",
    [
        ("transformer.h.*.attn", "transformer.h.0.attn", True),
        ("transformer.h.*.attn", "transformer.h.10.attn", True),
        ("transformer.h.*.attn", "transformer.h.attn", False),  # `*` is exactly one segment
        ("transformer.h.*.attn", "transformer.h.0.1.attn", False),  # ... and does not cross a dot
        ("transformer.*", "transformer", False),
        ("*", "lm_head", True),
        ("*", "transformer.wte", False),
        ("c_*", "c_attn", True),
        ("c_*", "c_", True),
        ("c_*", "xc_attn", False),
        ("ln_?", "ln_1", True),
        ("ln_?", "ln_12", False),
        ("**", "lm_head", True),
        ("**", "transformer.h.0.mlp.c_fc", True),
        ("**.c_fc", "c_fc", True),  # `**` spans zero segments
        ("**.c_fc", "transformer.h.0.mlp.c_fc", True),
        ("**.c_fc", "transformer.h.0.mlp.c_fc.x", False),
        ("transformer.**.c_fc", "transformer.c_fc", True),
        ("transformer.**.c_fc", "transformer.h.0.mlp.c_fc", True),
        ("transformer.**.c_fc", "c_fc", False),
        ("transformer.**", "transformer", True),
        ("transformer.**", "transformerx.h", False),
        ("**.mlp.**", "transformer.h.0.mlp.c_fc", True),
        ("**.mlp.**", "transformer.h.0.attn.c_attn", False),
        ("**.**.ln_f", "transformer.ln_f", True),
        ("h.[0..1].x", "h.0.x", True),
        ("h.[0..1].x", "h.1.x", True),  # inclusive at the top
        ("h.[0..1].x", "h.2.x", False),
        ("h.[2..5].x", "h.1.x", False),
        ("h.[2..5].x", "h.5.x", True),
        ("h.[0..11]", "h.011", True),  # a decimal value, compared as a number
        ("h.[0..11]", "h.12", False),
        ("h.[0..1]", "h.a", False),  # a range only matches digits
        ("h.[0..1]", "h.-1", False),
        ("a.b", "a.b", True),
        ("a.b", "a.bc", False),
        ("a.b", "a", False),
    ],
)
def test_matches(pattern, path, expected):
    assert matches(P(pattern), path) is expected


def test_matches_empty_pattern_and_path():
    assert matches(ir.Pattern(()), "") is True
    assert matches(ir.Pattern(()), "a") is False
    assert matches(ir.Pattern(("**",)), "") is True


def test_specificity_order():
    ordered = [
        "transformer.h.0.mlp.c_fc",
        "transformer.h.[0..3].mlp.c_fc",
        "transformer.h.1?.mlp.c_fc",
        "transformer.h.*.mlp.c_fc",
        "transformer.**.mlp.c_fc",
        "transformer.*.*.mlp.*",
        "**.c_fc",
        "**",
    ]
    keys = [specificity(P(p)) for p in ordered]
    assert keys == sorted(keys, reverse=True) and len(set(keys)) == len(keys)
    assert specificity(P("transformer.h.*.mlp.c_fc")) == (4, 0, 0, 1, 0)
    assert specificity(P("**.c_fc")) == (1, 0, 0, 0, -1)
    assert specificity(P("a.[0..1].c_*.*.**")) == (1, 1, 1, 1, -1)
    # Ties are possible: equal keys are what `check` reports as "equally specific".
    assert specificity(P("transformer.*.0.mlp.c_fc")) == specificity(P("transformer.h.*.mlp.c_fc"))


# ---- parse errors the grammar cannot see -----------------------------------------------------------------


@pytest.mark.parametrize(
    "src, expected",
    [
        ("dtp 1\na.[3..1]: colwise\n", [(2, 1, "empty index range [3..1]")]),
        ("dtp 1\na.b**: colwise\n", [(2, 1, "'**' must be a whole segment, not 'b**'")]),
        (
            "dtp 1\nset a.* = 1\n",
            [(2, 5, "`set` needs MODULE.ATTR ending in an attribute name, not '*'")],
        ),
        (
            "dtp 1\nset a.[0..1] = 1\n",
            [(2, 5, "`set` needs MODULE.ATTR ending in an attribute name, not '[0..1]'")],
        ),
        (
            "dtp 1\nmesh dp\n",
            [(2, 6, "the mesh needs a `tp` dimension (e.g. `mesh tp` or `mesh dp, tp`)")],
        ),
        (
            "dtp 1\nmesh pp, dp, tp\n",
            [(2, 1, "unsupported mesh `pp, dp, tp`; use `mesh tp` or `mesh dp, tp`")],
        ),
        (
            "dtp 1\na: colwise(packed=" + "9" * 40 + ")\n",
            [(2, 19, "number too large: " + "9" * 30)],
        ),
        ("dtp 1\nset x = " + str(MAX_INT + 1) + "\n", [(2, 9, f"number too large: {MAX_INT + 1}")]),
        ("dtp 3\n", [(1, 5, "unsupported language version 3; this dtp reads `dtp 1`")]),
    ],
)
def test_semantic_parse_errors(src, expected):
    with pytest.raises(PlanError) as info:
        parse(src)
    assert diag_lines(info.value) == expected


def test_largest_number_is_accepted():
    plan = parse(f"dtp 1\nset x = {MAX_INT}\n")
    assert plan.body[0].expr == ir.Num(MAX_INT)


def test_nesting_limit():
    ok = parse("dtp 1\n" + "a {\n" * 64 + "}\n" * 64)
    depth, node = 0, ok.body[0]
    while isinstance(node, ir.Block):
        depth += 1
        node = node.body[0] if node.body else None
    assert depth == 64
    with pytest.raises(PlanError) as info:
        parse("dtp 1\n" + "a {\n" * 65 + "}\n" * 65)
    assert diag_lines(info.value) == [(66, 1, "blocks nested more than 64 deep")]


def test_multiple_semantic_errors_are_sorted_by_position():
    with pytest.raises(PlanError) as info:
        parse("dtp 1\nb.[2..1]: colwise\nplan late\na.[9..0]: colwise\n")
    assert diag_lines(info.value) == [
        (2, 1, "empty index range [2..1]"),
        (3, 1, "`plan` must come before the first rule"),
        (4, 1, "empty index range [9..0]"),
    ]
    assert info.value.render().endswith("\n3 errors")


# ---- hostile inputs through the command line ---------------------------------------------------------------


def run_check(capsys, *args: str) -> tuple[int, str, float]:
    start = time.monotonic()
    rc = cli.main(["check", *args])
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert out == ""
    return rc, err, elapsed


@pytest.fixture
def model():
    from dtp import models

    models.build("gpt2-tiny")  # warm the zoo so the timings below measure the plan, not imports


def write(tmp_path: Path, data: bytes | str, name: str = "p.tp") -> str:
    path = tmp_path / name
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)
    return str(path)


def test_missing_file(tmp_path, capsys, model):
    with pytest.raises(UsageError, match="does not exist"):
        load(tmp_path / "nope.tp")
    rc, err, elapsed = run_check(capsys, str(tmp_path / "nope.tp"), "gpt2-tiny")
    assert (rc, err) == (2, f"error: plan file {tmp_path / 'nope.tp'} does not exist\n")
    assert elapsed < 2.0


def test_directory(tmp_path, capsys, model):
    with pytest.raises(UsageError):
        load(tmp_path)
    rc, err, elapsed = run_check(capsys, str(tmp_path), "gpt2-tiny", "--tp", "2")
    assert (rc, err) == (2, f"error: {tmp_path} is a directory, not a .tp plan file\n")
    assert elapsed < 2.0


def test_binary_file(tmp_path, capsys, model):
    path = write(tmp_path, b"dtp 1\nlm_head: vocab\x00_parallel\n")
    with pytest.raises(PlanError):
        load(path)
    rc, err, elapsed = run_check(capsys, path, "gpt2-tiny")
    assert (rc, err) == (
        2,
        f"{path}:2:1: error: this is a binary file, not a .tp plan (it contains NUL bytes)\n",
    )
    assert elapsed < 2.0


def test_non_utf8_file(tmp_path, capsys, model):
    path = write(tmp_path, b"dtp 1\n# caf\xe9\nlm_head: vocab_parallel\n")
    with pytest.raises(PlanError):
        load(path)
    rc, err, elapsed = run_check(capsys, path, "gpt2-tiny")
    assert (rc, err) == (
        2,
        f"{path}:2:6: error: not UTF-8 text (byte 0xe9); a .tp plan is a text file\n",
    )
    assert elapsed < 2.0


@pytest.mark.parametrize("text", ["", "   \n\t\n", "\n"])
def test_empty_file(tmp_path, capsys, model, text):
    path = write(tmp_path, text)
    rc, err, elapsed = run_check(capsys, path, "gpt2-tiny")
    assert rc == 2
    assert err.startswith(f"{path}:1:1: error: empty plan; a plan starts with `dtp 1`\n")
    assert elapsed < 2.0


def test_one_megabyte_line_syntax_error(tmp_path, capsys, model):
    path = write(tmp_path, "dtp 1\nlm_head: vocab_parallel " + "x" * 1_000_000 + "\n")
    rc, err, elapsed = run_check(capsys, path, "gpt2-tiny")
    assert rc == 2
    head, line, caret = err.splitlines()
    assert head == (
        f"{path}:2:25: error: unexpected '{'x' * 37}...': a statement must end at the end of its "
        "line"
    )
    # the excerpt is a window, not the megabyte
    assert line == "    lm_head: vocab_parallel " + "x" * 96
    assert caret == "    " + " " * 24 + "^" + "~" * 79  # underlines at most 80 characters
    assert elapsed < 2.0


def test_one_megabyte_pattern(tmp_path, capsys, model):
    path = write(tmp_path, "dtp 1\n" + "a" * 1_000_000 + ": colwise\n")
    rc, err, elapsed = run_check(capsys, path, "gpt2-tiny", "--tp", "2")
    assert rc == 2
    lines = err.splitlines()
    assert lines[0].startswith(f"{path}:2:1: error: pattern 'aaaa")
    assert lines[0].endswith("' matches no module")
    assert lines[1:] == ["    " + "a" * 120, "    ^" + "~" * 119]
    assert elapsed < 2.0


def test_one_megabyte_comment_is_fine(tmp_path, capsys, model):
    path = write(
        tmp_path,
        "dtp 1\n#"
        + "c" * 1_000_000
        + "\ntransformer.wte: vocab_parallel\nlm_head: vocab_parallel\n",
    )
    start = time.monotonic()
    rc = cli.main(["check", path, "gpt2-tiny", "--tp", "2"])
    assert time.monotonic() - start < 2.0
    out, err = capsys.readouterr()
    assert rc == 0  # a warning only: only the embedding and the head are sharded
    assert err.startswith(
        f"{path}:1:1: warning: this plan leaves 86% of the parameter bytes replicated"
    )
    assert (
        out
        == f"{path}: ok on gpt2-tiny: 2 modules claimed by 2 rules, 0 attribute rewrites; tp=2\n"
    )


def test_five_thousand_nested_blocks(tmp_path, capsys, model):
    path = write(tmp_path, "dtp 1\n" + "transformer {\n" * 5000 + "}\n" * 5000)
    rc, err, elapsed = run_check(capsys, path, "gpt2-tiny")
    assert (rc, err) == (
        2,
        f"{path}:66:1: error: blocks nested more than 64 deep\n    transformer {{\n    ^\n",
    )
    assert elapsed < 2.0


def test_five_thousand_unclosed_parens(tmp_path, capsys, model):
    path = write(tmp_path, "dtp 1\nset a.b = " + "(" * 5000 + "1\n")
    rc, err, elapsed = run_check(capsys, path, "gpt2-tiny")
    assert rc == 2
    assert (
        err.splitlines()[0]
        == f"{path}:2:5012: error: unexpected end of line: unclosed '(' in the expression; expected ')'"
    )
    assert elapsed < 2.0


def test_absurd_numbers(tmp_path, capsys, model):
    big = "1" + "0" * 40  # 10**40
    path = write(
        tmp_path,
        f"dtp 1\nlm_head: vocab_parallel\ntransformer.wte: vocab_parallel(output=shard({big}))\n",
    )
    rc, err, elapsed = run_check(capsys, path, "gpt2-tiny", "--tp", "2")
    assert rc == 2 and elapsed < 2.0
    assert err.splitlines()[0] == f"{path}:3:46: error: number too large: {big[:30]}"

    path = write(tmp_path, f"dtp 1\nset transformer.h.*.attn.head_dim = head_dim / {big}\n", "q.tp")
    rc, err, elapsed = run_check(capsys, path, "gpt2-tiny", "--tp", "2")
    assert rc == 2 and elapsed < 2.0
    assert err.splitlines()[0] == f"{path}:2:48: error: number too large: {big[:30]}"

    rc, err, elapsed = run_check(capsys, str(GPT2_TP), "gpt2-tiny", "--tp", big)
    assert rc == 2 and elapsed < 2.0
    lines = err.splitlines()
    assert lines[0].startswith(
        f"{GPT2_TP}:8:18: error: transformer.wte: vocab_parallel shards the vocabulary of "
        f"256 rows (weight dim 0) over tp={big}"
    )
    assert lines[3] == (
        f"{GPT2_TP}:11:18: error: transformer.h.0.attn.c_attn (and 1 more module): colwise shards "
        f"out_features=192 per packed part (3 parts of 64) (weight dim 0) over tp={big}, which does "
        ""
        "not divide it; tp values that work: 1, 2, 4, 8, 16, 32, 64"
    )
    assert lines[-1] == "8 errors"


def test_bad_tp_flag_is_a_usage_error(capsys):
    for value in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as info:
            cli.main(["check", str(GPT2_TP), "gpt2-tiny", "--tp", value])
        assert info.value.code == 2
        assert "--tp: expected a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text",
    [
        "dtp 1\na colwise\n",
        "# a comment first\ndtp 1\na colwise\n",
        "dtp 1\nb: rowwise\na colwise\n",
        "dtp 1\nx {\n    a colwise\n}\n",
    ],
)
def test_labelled_syntax_message_wherever_the_mistake_stands(text):
    # the label identifies the mistake by parser state, not by how deep the parser's stack is
    with pytest.raises(PlanError) as info:
        parse(text)
    assert info.value.diagnostics[0].message == (
        "unexpected 'colwise': expected ':' and a style after the pattern, or '{' to open a block"
    )


def test_when_blocks_parse_format_and_pick_a_branch():
    """`when config.ATTR [OP VALUE] { } else { }`: IR with positions, fmt round trip, branch by
    config."""
    from types import SimpleNamespace

    from dtp.lang import conditions
    from dtp.lang import format as fmt

    text = (
        "dtp 1\na {\n    when config.multi_query { # mq\n        b: colwise\n    } else {\n        "
        "c: rowwise\n"
        "    }\n}\nwhen config.n_kv != 2 {\n    set d.n = n / tp\n}\n"
    )
    plan = parse(text, "p.tp")
    when = plan.body[0].body[0]
    assert isinstance(when, ir.When) and when.condition == ir.Condition(ir.ConfigRef("multi_query"))
    assert (when.pos.line, when.pos.column, when.end.line, when.else_end.line) == (3, 5, 5, 7)
    assert plan.body[1].condition == ir.Condition(ir.ConfigRef("n_kv"), "!=", ir.Literal(2))
    out = fmt.format_plan(plan, text)
    assert parse(out) == plan and fmt.format_plan(parse(out), out) == out
    assert "    when config.multi_query {  # mq\n" in out and "    } else {\n" in out

    def styles(config) -> list[tuple[str, str]]:
        rules, sets, _ = ir.flatten(plan, lambda w: conditions.holds(w.condition, config))
        return [(str(r.pattern), r.style.name) for r in rules] + [
            (str(s.pattern), s.attr) for s in sets
        ]

    assert styles(SimpleNamespace(multi_query=True, n_kv=2)) == [("a.b", "colwise")]
    assert styles(SimpleNamespace(multi_query=False, n_kv=1)) == [("a.c", "rowwise"), ("d", "n")]
    assert len(ir.flatten(plan)[0]) == 2  # without a model both branches are checked
    with pytest.raises(
        conditions.ConditionError,
        match=r"no attribute 'multi_query'; did you mean 'config.multi_quer'",
    ):
        styles(SimpleNamespace(multi_quer=True, n_kv=2))
    with pytest.raises(conditions.ConditionError, match=r"`config.multi_query` is 'yes' \(str\)"):
        styles(SimpleNamespace(multi_query="yes", n_kv=2))


def test_when_reads_tp_and_set_reads_config():
    """`when config.ATTR < tp` is chosen per tp (an error without one); `set` may read
    `config.ATTR`."""
    from types import SimpleNamespace

    from dtp.lang import conditions
    from dtp.lang import format as fmt

    text = "dtp 1\n\nwhen config.kv < tp {\n    set a.groups = config.heads / tp\n} else {\n    a.k: colwise\n}\n"
    plan = parse(text)
    when = plan.body[0]
    assert when.condition == ir.Condition(ir.ConfigRef("kv"), "<", ir.Var("tp"))
    assert when.body[0].expr == ir.BinOp("/", ir.Var("config.heads"), ir.Var("tp"))
    assert fmt.format_plan(plan, text) == text and parse(fmt.format_plan(plan, text)) == plan
    config = SimpleNamespace(kv=2, heads=8)
    assert [conditions.holds(when.condition, config, tp) for tp in (1, 2, 4)] == [
        False,
        False,
        True,
    ]
    assert conditions.reads_tp(plan) and conditions.branches(plan, config, 4) == (True,)
    with pytest.raises(
        conditions.ConditionError, match=r"reads `tp`: give the tp the plan runs at \(--tp N\)"
    ):
        conditions.holds(when.condition, config)
    with pytest.raises(conditions.ConditionError, match=r"`config.kv < tp` orders None and 2"):
        conditions.holds(when.condition, SimpleNamespace(kv=None), 2)
