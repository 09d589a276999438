"""One object per style: every Style has its StyleSpec and its ParallelStyle factory, the stages
dispatch through them, and no module outside the plan language compares a style by its string."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from dtp import parse
from dtp.checks.options import check_style
from dtp.compiler.compiler import PARALLEL_STYLES
from dtp.lang import ir
from dtp.layout.placement import ParamPlacement
from dtp.layout.styles import SPECS, Style, param_placements
from dtp.layout.styles.spec import SEQUENCE, LayoutContext

ROOT = Path(__file__).resolve().parents[2]
NAMES = {s.value for s in Style}
# Modules that name a style's string for another reason: Hugging Face's own tp_plan vocabulary
# (hf/plan.py maps it onto dtp's), and the plan language below the specs, where `replicate` is
# also a LAYOUT (lang/).
OTHER_VOCABULARIES = ("dtp/hf/plan.py", "dtp/lang/")


def _styles(text: str) -> list:
    return [rule.style for rule in ir.flatten(parse(text, "p.tp"))[0]]


def test_every_style_has_one_spec_and_one_factory():
    assert list(SPECS) == list(Style)
    assert all(spec.style is style for style, spec in SPECS.items())
    assert set(PARALLEL_STYLES) == set(Style)


def test_the_checker_reads_options_from_the_spec():
    [style] = _styles("dtp 1\na: colwise(stride=2)\n")
    diags = []
    check_style(style, diags)
    expected = ", ".join(SPECS[Style.COLWISE].options)
    assert [(d.pos.line, d.pos.column, d.message) for d in diags] == [
        (2, 12, f"unknown option 'stride' for colwise; colwise takes {expected}")
    ]


def test_colwise_and_rowwise_parameters_follow_conv1d_orientation():
    linear = nn.Linear(8, 12)
    assert param_placements(Style.COLWISE, linear, packed=3) == {
        "weight": ParamPlacement(0, 3),
        "bias": ParamPlacement(0, 3),
    }
    assert param_placements(Style.ROWWISE, linear) == {
        "weight": ParamPlacement(1),
        "bias": ParamPlacement(),
    }
    assert param_placements("no_such_style", linear) == {
        "weight": ParamPlacement(),
        "bias": ParamPlacement(),
    }
    assert SPECS[Style.COLWISE].sizes(linear, 3) == [
        ("out_features=12 per packed part (3 parts of 4) (weight dim 0)", 4)
    ]


@pytest.mark.parametrize("sp", [False, True])
def test_megatron_pair_layouts_between_blocks(sp):
    ctx = LayoutContext(sp, {})
    col, row, vocab = _styles("dtp 1\na: colwise\nb: rowwise\nc: vocab_parallel\n")
    between = SEQUENCE if sp else Replicate()
    colwise = SPECS[Style.COLWISE].layout(col, nn.Linear(4, 8), ctx)
    rowwise = SPECS[Style.ROWWISE].layout(row, nn.Linear(8, 4), ctx)
    embedding = SPECS[Style.VOCAB_PARALLEL].layout(vocab, nn.Embedding(16, 4), ctx)
    assert (colwise.input, colwise.output, colwise.local) == (between, Shard(-1), True)
    assert (rowwise.input, rowwise.output, rowwise.local) == (Shard(-1), between, not sp)
    assert (embedding.embedding, embedding.input, embedding.output) == (True, Replicate(), between)


def test_replicate_has_a_layout_only_when_it_reduces_gradients():
    plain, reduced = _styles("dtp 1\na: replicate\nb: replicate(reduce_grad=true)\n")
    spec = SPECS[Style.REPLICATE]
    assert spec.layout(plain, nn.Linear(2, 2), LayoutContext(False, {})) is None
    assert spec.layout(reduced, nn.Linear(2, 2), LayoutContext(False, {})).reduce_grad


def _string_comparisons(path: Path) -> list[str]:
    """`x == "colwise"`, `x != "rowwise"`, `x in ("colwise", …)` with a style's string."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for left, op, right in zip([node.left, *node.comparators], node.ops, node.comparators):
            sides = [left, right] if isinstance(op, (ast.Eq, ast.NotEq)) else []
            if isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.Set)):
                sides = list(right.elts)
            if any(isinstance(s, ast.Constant) and s.value in NAMES for s in sides):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_stage_compares_a_style_by_its_string():
    found = [
        line
        for path in sorted((ROOT / "dtp").rglob("*.py"))
        if not path.relative_to(ROOT).as_posix().startswith(OTHER_VOCABULARIES)
        for line in _string_comparisons(path)
    ]
    assert found == []


def test_the_scan_sees_string_comparisons_and_not_the_enum(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        'a = m.style == "colwise"\n'
        'b = kind not in ("x", "rowwise")\n'
        "c = m.style == Style.COLWISE\n"
        'd = "sequence_parallel" in text\n'
        'e = (layout, dtensor) == ("replicate", False)\n'
    )
    assert [line.split(":")[1] for line in _string_comparisons(probe)] == ["1", "2"]
