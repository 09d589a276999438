"""`slice_params`: an attention module's own per-head parameters (GPT-OSS's learnt `sinks`) cut to
each rank's heads — check rules with their positions, the placement `explain` shows, no HF export.
Parity of plans/hf/gpt_oss.tp at tp 2 and 4 is in tests/hf/test_families.py."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from conftest import dtp_cli

from dtp.checks.checker import check
from dtp.cost.explain import explain
from dtp.errors import PlanError
from dtp.lang.parse import load, parse
from dtp.models import hf

ATTENTION = """dtp 1
model.layers.* {{
    {rule}
    self_attn.q_proj: colwise
    self_attn.k_proj: colwise
    self_attn.v_proj: colwise
    self_attn.o_proj: rowwise
}}
"""


def _errors(text: str, tp: int = 2, **config) -> list[str]:
    with pytest.raises(PlanError) as err:
        check(parse(text, "p.tp"), hf.build("gpt_oss", **config), tp)
    return [f"{d.pos.line}:{d.pos.column}: {d.message}" for d in err.value.diagnostics]


def test_sharded_attention_with_sinks_needs_slice_params():
    assert _errors(ATTENTION.format(rule="")) == [
        "4:23: model.layers.0.self_attn (and 1 more module): GptOssAttention holds per-head "
        "parameters (sinks (4,)) "
        "that no rule slices: each rank would apply every head's values to the heads it holds; add "
        "`model.layers.*.self_attn: slice_params(name=sinks)`, or keep this attention whole (no "
        "colwise or rowwise "
        "in it)"
    ]
    check(
        parse(ATTENTION.format(rule="self_attn: slice_params(name=sinks)"), "p.tp"),
        hf.build("gpt_oss"),
        2,
    )


@pytest.mark.parametrize(
    "rule,message",
    [
        (
            "self_attn: slice_params",
            "3:16: model.layers.0.self_attn (and 1 more module): slice_params needs the "
            "parameters to cut, e.g. slice_params(name=sinks)",
        ),
        (
            "self_attn: slice_params(name=sink)",
            "3:34: model.layers.0.self_attn (and 1 more module): GptOssAttention "
            "has no parameter 'sink' of its own; did you mean 'sinks'?",
        ),
        (
            "self_attn: slice_params(name=[sinks, sinks])",
            "3:34: model.layers.0.self_attn (and 1 more module): "
            "slice_params' name takes a parameter name or a list of distinct names, not '[sinks, "
            "sinks]'; e.g. "
            "slice_params(name=sinks)",
        ),
        (
            "self_attn: slice_params(name=sinks, dim=1)",
            "3:34: model.layers.0.self_attn (and 1 more module): sinks (4,) "
            "does not hold the 4 attention heads (config.num_attention_heads) at dimension 1",
        ),
    ],
)
def test_slice_params_rules_name_the_option(rule, message):
    assert _errors(ATTENTION.format(rule=rule)) == [message]


def test_slice_params_needs_an_attention_whose_heads_are_split():
    assert _errors("dtp 1\nmodel.layers.*.self_attn: slice_params(name=sinks)\n") == [
        "2:27: model.layers.0.self_attn (and 1 more module): slice_params cuts per-head parameters "
        "to this rank's "
        "heads, but no colwise layer in this module splits its heads: every rank computes all of "
        "them; drop the "
        "rule, or shard the attention's projections colwise"
    ]
    assert _errors("dtp 1\nmodel.layers.*.mlp.router: slice_params(name=bias)\n")[0] == (
        "2:28: model.layers.0.mlp.router (and 1 more module): slice_params cuts an attention "
        "module's per-head "
        "parameters, but GptOssTopKRouter is no attention module with a known head count"
    )
    six = _errors(
        ATTENTION.format(rule="self_attn: slice_params(name=sinks)"),
        4,
        num_attention_heads=6,
        hidden_size=96,
        num_key_value_heads=6,
    )
    assert six[0] == (
        "3:16: model.layers.0.self_attn (and 1 more module): slice_params cuts 6 attention heads "
        "(config.num_attention_heads) into whole heads per rank, which tp=4 does not divide; tp "
        "values "
        "that work: 1, 2, 3, 6"
    )


def test_explain_shows_each_rank_its_heads_sinks():
    model = hf.build("gpt_oss")
    ex = explain(check(load("plans/hf/gpt_oss.tp"), model, 2), model, "gpt_oss", 2, batch=2, seq=8)
    row = next(r for r in ex.rows if r.name == "model.layers.0.self_attn.sinks")
    assert (row.placement, row.shape, row.local_shape) == ("Shard(0)", (4,), (2,))


def test_slice_params_does_not_export_to_hf(repo):
    refused = dtp_cli("plan", "--to-hf", "plans/hf/gpt_oss.tp", "dtp.models.hf:gpt_oss")
    assert refused.returncode == 2 and refused.stdout == ""
    assert (
        "line 12 (model.layers.*.self_attn: slice_params): no HF style for slice_params; rule left "
        "out" in refused.stderr
    )


def test_train_refuses_a_parameter_its_keyed_init_cannot_draw_before_any_rank(
    repo, tmp_path, capsys
):
    from dtp.cli import main

    # GPT-OSS's sinks are neither matrix, bias nor norm: exit 2 from the parent, no rank started
    assert (
        main(
            [
                "train",
                "plans/hf/gpt_oss.tp",
                "dtp.models.hf:gpt_oss",
                "--steps",
                "1",
                "--init",
                "keyed",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith(
        "error: dtp train's keyed initialisation knows matrices, biases and norms; "
        "model.layers.0.self_attn.sinks is a 1-D parameter of a GptOssAttention"
    )
    assert "rank" not in err
