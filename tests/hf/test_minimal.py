"""Megatron's minimal attention for Phi-3 and OLMo2 (parity and counts run in
tests/hf/test_families.py): `set` on an object a module holds, copy-on-write (Phi-3's shared
config); `sharded_norm` (OLMo2's q/k norms over the whole projection): check rules with positions,
explain rows and the analytic schedule."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch

from dtp import models
from dtp.checks.checker import check
from dtp.compiler.styles import SetAttributes
from dtp.cost.explain import explain
from dtp.errors import PlanError
from dtp.hf.verify import PLANS
from dtp.lang.parse import parse
from dtp.layout.lower import lower
from dtp.layout.norms import rms_norm


def _build(family: str):
    return models.build(f"dtp.models.hf:{family}")


def _errors(text: str, family: str, tp: int) -> list[str]:
    with pytest.raises(PlanError) as err:
        check(parse(text, "p.tp"), _build(family), tp)
    return [f"{d.pos.line}:{d.pos.column}: {d.message}" for d in err.value.diagnostics]


def _shipped(family: str, model_type: str, tp: int):
    model = _build(family)
    return model, check(
        parse((PLANS / f"{model_type}.tp").read_text(), f"{model_type}.tp"), model, tp
    )


@pytest.mark.parametrize("tp, kv, groups", [(2, 1, 2), (4, 1, 1)])
def test_set_on_the_shared_config_is_copy_on_write(tp, kv, groups):
    model, checked = _shipped("phi3", "phi3", tp)  # 4 query heads, 2 key/value heads
    rewrites = lower(checked.resolution, tp).rewrites
    attn = "model.layers.0.self_attn"
    assert rewrites[attn]["config.num_attention_heads"] == 4 // tp
    for path, values in rewrites.items():
        SetAttributes(values)._apply(model.get_submodule(path), None)
    first, second = (model.get_submodule(f"model.layers.{i}.self_attn") for i in (0, 1))
    assert first.config.num_attention_heads == second.config.num_attention_heads == 4 // tp
    assert (first.num_key_value_heads, first.num_key_value_groups) == (kv, groups)
    # a copy per module
    assert first.config is not second.config and first.config is not model.config
    # the model's untouched
    assert model.config.num_attention_heads == 4 and model.config.num_key_value_heads == 2
    assert (
        first.config.hidden_size == 64
        and first.config.rope_parameters is model.config.rope_parameters
    )


def test_set_errors_on_a_held_object():
    rule = "dtp 1\nset model.layers.*.self_attn.{} = {}\n"
    assert _errors(
        rule.format("config.num_attention_head", "num_attention_heads / tp"), "phi3", 2
    ) == [
        "2:5: model.layers.0.self_attn (and 1 more module): Phi3Config has no integer attribute "
        "'num_attention_head'; did you mean 'num_attention_heads'?"
    ]
    assert _errors(rule.format("confg.num_attention_heads", "2"), "phi3", 2) == [
        "2:5: 'confg' is neither a module under 'model.layers.*.self_attn' nor an object it holds "
        "(Phi3Attention "
        "holds config); `set` reaches MODULE.ATTR or MODULE.OBJECT.ATTR; did you mean 'config'?"
    ]
    assert _errors(
        rule.format("config.num_attention_heads", "num_attention_heads / tp"), "phi3", 3
    ) == [
        "2:79: model.layers.0.self_attn (and 1 more module): 4 / 3 does not divide exactly at tp=3"
    ]
    root = check(
        parse("dtp 1\nset config.vocab_size = vocab_size / tp\n", "p.tp"), _build("phi3"), 2
    )  # the model's
    assert list(root.resolution.sets) == [("", "config.vocab_size")]
    assert lower(root.resolution, 2).rewrites == {"": {"config.vocab_size": 64}}


def test_grouped_kv_parts_that_tp_does_not_divide_point_to_repeat():
    assert _errors(
        "dtp 1\nmodel.layers.*.self_attn.qkv_proj: colwise(packed=[q, kv, kv])\n", "phi3", 4
    )[0].endswith(
        "packed part 2 (kv, 32 features) holds 2 heads (head size 16), which do not divide by tp=4; "
        "each rank must "
        "hold whole heads; tp values that work: 1, 2; give each rank the key/value head its query "
        "heads read with "
        "repeat(kv)"
    )


OLMO2 = (
    "dtp 1\nmodel.layers.* {{\n    self_attn.q_proj: colwise\n    self_attn.k_proj: colwise{kv}\n"
    "    self_attn.v_proj: colwise{kv}\n    self_attn.o_proj: rowwise\n{norms}}}\n"
)


def test_sharded_norm_checks():
    left_whole = OLMO2.format(kv="", norms="    self_attn.k_norm: sharded_norm\n")
    assert _errors(left_whole, "olmo2", 2) == [
        "3:23: model.layers.0.self_attn.q_proj (and 1 more module): q_norm (Olmo2RMSNorm) "
        "normalises over 64 "
        "features, the whole output of this colwise layer, of which each rank holds a slice; shard "
        "it too with "
        "`model.layers.*.self_attn.q_norm: sharded_norm` (its sum of squares is all-reduced), or "
        "gather this output "
        "(output=replicate)"
    ]
    repeat = "(packed=[repeat(kv)])"
    unlike = OLMO2.format(
        kv=repeat, norms="    self_attn.q_norm: sharded_norm\n    self_attn.k_norm: sharded_norm\n"
    )
    assert _errors(unlike, "olmo2", 4) == [
        "8:23: model.layers.0.self_attn.k_norm (and 1 more module): its 32 features are laid out "
        "unlike those of "
        "k_proj, the colwise projection of that width beside it, so a rank's weight slice would not "
        "match its "
        "features; use sharded_norm(packed=[repeat(kv)])"
    ]
    whole = OLMO2.format(
        kv=repeat,
        norms="    self_attn.q_norm: sharded_norm\n"
        "    self_attn.k_norm: sharded_norm(packed=[replicate(kv)])\n",
    )
    assert _errors(whole, "olmo2", 4) == [
        "8:23: model.layers.0.self_attn.k_norm (and 1 more module): sharded_norm cannot keep a part "
        "whole "
        "(replicate(…)): the sum of squares would count it once per rank; list only sharded or "
        "repeat(kv) parts"
    ]
    # Gemma's norm multiplies by 1 + weight
    assert _errors("dtp 1\nmodel.norm: sharded_norm\n", "gemma", 2) == [
        "2:13: model.norm: its forward is not an RMS norm w · x / sqrt(mean(x²) + eps) (checked on "
        "a probe input), "
        "the one formula sharded_norm computes from a sum of squares; this module is GemmaRMSNorm"
    ]
    assert _errors("dtp 1\nmodel.layers.*.mlp.up_proj: sharded_norm\n", "olmo2", 2) == [
        "2:29: model.layers.0.mlp.up_proj (and 1 more module): sharded_norm applies to an RMS norm "
        "with a 1-D "
        "weight; this module is Linear"
    ]
    assert _errors("dtp 1\nmodel.layers.*.self_attn.q_norm: sharded_norm\n", "olmo2", 2)[0] == (
        "2:34: model.layers.0.self_attn.q_norm (and 1 more module): sharded_norm reads a local "
        "input as shard(-1), "
        "but receives the full activation (replicate, local) from the model's own computation"
    )


def test_sharded_norm_computes_the_models_own_norm_from_slices():
    from dtp.models import hf

    norm = hf.build("olmo2").model.layers[0].self_attn.q_norm
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 3, 64)
    halves = [
        rms_norm(
            part,
            w,
            norm.variance_epsilon,
            64,
            lambda t: sum(p.pow(2).sum(-1, keepdim=True) for p in x.chunk(2, -1)),
        )
        for part, w in zip(x.chunk(2, -1), norm.weight.chunk(2))
    ]
    torch.testing.assert_close(torch.cat(halves, -1), norm(x), rtol=1e-6, atol=1e-6)


def test_explain_rows_and_schedule_of_sharded_norms():
    model, checked = _shipped("olmo2", "olmo2", 4)
    ex = explain(checked, model, "olmo2", 4, batch=2, seq=8)
    rows = {r.name: (r.style, r.placement, r.shape, r.local_shape) for r in ex.rows}
    assert rows["model.layers.0.self_attn.q_norm.weight"] == (
        "sharded_norm",
        "Shard(0)",
        (64,),
        (16,),
    )
    assert rows["model.layers.0.self_attn.k_norm.weight"] == (
        "sharded_norm",
        "Shard(0) parts[32h2]",
        (32,),
        (16,),
    )
    norm = [
        (c.phase, c.op, c.buffer_bytes, c.reason)
        for c in ex.schedule
        if c.module == "model.layers.0.self_attn.k_norm"
    ]
    # repeat(kv) rows
    assert norm == [
        ("backward", "all_reduce", 32 * 4, "gradient of weight's replicated parts"),
        ("forward", "all_reduce", 2 * 8 * 4, "sum of squares over the sharded features"),
        ("backward", "all_reduce", 2 * 8 * 4, "gradient of the sum of squares"),
    ]
    bf16 = explain(checked, model, "olmo2", 4, dtype=torch.bfloat16, batch=2, seq=8).schedule
    assert {
        c.buffer_bytes for c in bf16 if c.reason == "sum of squares over the sharded features"
    } == {2 * 8 * 4}
