"""Hugging Face families: every shipped plans/hf/<model_type>.tp reaches parity on the real transformers
class at tp 2 (tp 4 where the tiny config divides) with measured == analytic collectives, several
families per rank launch; tp_plan import/export round trips; check rules and explain rows of the new
layouts (Conv1D, packed part lists, replicate(reduce_grad), experts)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from dtp import models  # noqa: E402
from dtp.check import check  # noqa: E402
from dtp.errors import PlanError  # noqa: E402
from dtp.explain import explain  # noqa: E402
from dtp.hf_plan import export_plan, hf_plan_of, import_plan  # noqa: E402
from dtp.hf_verify import PLANS, verify_on_rank  # noqa: E402
from dtp.models import hf  # noqa: E402
from dtp.ranks import on_ranks  # noqa: E402
from dtp.syntax import parse  # noqa: E402

# Variants run the shipped plan of their model type, whose `when config.…` blocks pick their layout.
TP2 = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt_neox", "gptj", "gpt_bigcode", "falcon",
       "phi", "opt", "olmo2", "mixtral", "qwen2_moe", "bloom", "phi3",
       "gemma",  # one key/value head (Gemma-2B): repeat(kv) keeps it whole on both ranks
       "llama_mqa",  # the same branch of llama.tp
       "falcon_40b",  # new_decoder_architecture: grouped query_key_value, in-place residual
       "gpt_bigcode_mha",  # multi_query false: per-head interleaved c_attn
       "phi3_mha",  # no grouped-query attention, partial rotary, sliding window, tied embeddings
       "olmo2_mha"]  # no grouped-query attention, biases, tied embeddings
TP4 = ["gpt2", "gpt_bigcode", "falcon", "bloom",  # 4 heads (and one replicated k/v head) divide by 4
       "gemma", "llama", "qwen2",  # 1 and 2 key/value heads < tp: repeat(kv), each rank the head it reads
       "phi3", "olmo2"]  # the same inside Phi-3's fused qkv_proj, and for OLMo2's k_norm
# At tp 4 the repeated k/v rows add one gradient all-reduce per projection (and per bias: qwen2).
EXPECTED_TP4 = {"gemma": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 9}},
                "llama": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 9}},
                "qwen2": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 13}},
                "phi3": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 7}},  # one qkv_proj weight
                # + k_proj, v_proj, k_norm repeated rows and 2 × (q_norm, k_norm) sums of squares, per layer
                "olmo2": {"forward": {"all_reduce": 12}, "backward": {"all_reduce": 15}}}

# Collectives per step of the 2-layer tiny models, forward and backward (3 of the forward all-reduces
# are the vocabulary-parallel loss's). Written out so a change in either measurement or schedule shows.
EXPECTED = {
    "qwen3": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 9}},  # + 2 × (q_norm, k_norm) gradients
    "gpt_bigcode": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 9}},  # + 2 × (weight, bias) k/v rows
    "falcon": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 7}},  # + 2 × weight k/v rows
    # + q_norm, k_norm: the sum of squares all-reduced forward, its gradient backward, per layer
    "olmo2": {"forward": {"all_reduce": 12}, "backward": {"all_reduce": 9}},
    "olmo2_mha": {"forward": {"all_reduce": 12}, "backward": {"all_reduce": 9}},
    "mixtral": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 7}},  # + 2 × routing weights (f)
    "qwen2_moe": {"forward": {"all_reduce": 10}, "backward": {"all_reduce": 9}},  # + shared expert
    "llama_mqa": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 9}},  # + 2 × k, v weight gradients
    "gemma": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 9}},  # + 2 × k, v weight gradients
}
MEGATRON = {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 5}}  # 4 × 2 layers + 1 + 1 + 3


def _assert_families(results: list[list[dict]], families: list[str]) -> None:
    for rank_results in results:
        assert [r["family"] for r in rank_results] == [f[0] if isinstance(f, tuple) else f for f in families]
        for r in rank_results:
            assert "error" not in r, f"{r['family']}: {r.get('error')}"
            assert r["ok"], f"{r['family']}: parity failed, worst {r['worst']} {r['errors']} {r['problems']}"
            assert r["errors"]["logits"] < 1e-5 and r["errors"]["loss"] < 1e-5, r
            assert r["measured"] == r["analytic"], f"{r['family']}: measured {r['measured']} != {r['analytic']}"


def test_every_family_at_tp2():
    results = on_ranks(verify_on_rank, 2, TP2, timeout=600)
    _assert_families(results, TP2)
    for r in results[0]:
        counts = {k: v for k, v in r["measured"].items() if k != "bytes"}
        assert counts == EXPECTED.get(r["family"], MEGATRON), r["family"]


def test_families_at_tp4():
    results = on_ranks(verify_on_rank, 4, TP4, timeout=600)
    _assert_families(results, TP4)
    counts = {r["family"]: {k: v for k, v in r["measured"].items() if k != "bytes"} for r in results[0]}
    assert {f: counts[f] for f in EXPECTED_TP4} == EXPECTED_TP4


def test_a_plan_exists_for_every_listed_model_type():
    listed = {"gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gpt_neox", "gptj", "gpt_bigcode",
              "falcon", "phi", "opt", "olmo2", "mixtral", "qwen2_moe", "bloom", "phi3"}
    assert listed <= {p.stem for p in PLANS.glob("*.tp")}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma", "mixtral", "qwen2_moe"])
def test_hf_tp_plan_round_trip(family):
    model = hf.build(family)
    original = hf_plan_of(model)
    text, warnings = import_plan(original)
    assert warnings == []
    plan = parse(text, "<imported>")
    if family != "qwen2_moe":  # its plan also names dense-MLP layers (mlp_only_layers) this model lacks
        check(plan, model)  # the tiny Gemma has one key/value head: HF's plan, like dtp's, needs tp=1 there
    exported, _ = export_plan(plan, model)
    assert exported == original


def test_import_names_what_is_lossy():
    text, warnings = import_plan({"model.layers.*.mlp.gate_proj": "local_colwise", "model.layers.*.x": "gather",
                                  "model.layers.*.y": "no_such_style"})
    assert "model.layers.*.mlp.gate_proj: colwise" in text
    assert text.count("# lossy:") == 3 and len(warnings) == 3
    assert "'gather' has no dtp equivalent" in warnings[1] and "unknown Hugging Face style" in warnings[2]


def test_export_names_what_hf_cannot_express():
    plan = parse("dtp 1\nh.[0..1].attn.c_attn: colwise(packed=3)\nh.*.mlp.c_fc: colwise\nset h.*.attn.n = n / tp\n",
                 "<p>")
    out, warnings = export_plan(plan)
    assert out == {"h.*.mlp.c_fc": "colwise"}
    assert len(warnings) == 2 and "`set h.*.attn.n`" in warnings[0] and "whole segments" in warnings[1]


def _errors(text: str, family: str, tp: int) -> list[str]:
    with pytest.raises(PlanError) as err:
        check(parse(text, "p.tp"), models.build(f"dtp.models.hf:{family}"), tp)
    return [f"{d.pos.line}:{d.pos.column}: {d.message}" for d in err.value.diagnostics]


def test_part_list_checks():
    rule = "dtp 1\ntransformer.h.*.attn.c_attn: colwise(packed={})\ntransformer.h.*.attn.c_proj: rowwise\n"
    assert _errors(rule.format("[q, q, q]"), "gpt_bigcode", 2) == [
        "2:45: transformer.h.0.attn.c_attn (and 1 more module): packed parts [q, q, q] add up to 64 + 64 + 64 "
        "= 192, not the 96 output features"]
    assert _errors(rule.format("[q, head, head]"), "gpt_bigcode", 2)[0].endswith(
        "packed part 2 (head, 16 features) holds 1 heads (head size 16), which do not divide by tp=2; each rank "
        "must hold whole heads; tp values that work: 1; keep it whole with replicate(head)")
    assert _errors(rule.format("[q, replicate(hed), 16]"), "gpt_bigcode", 2)[0].endswith(
        "unknown part 'hed'; a part is q, kv, head, an integer, or replicate(PART)")
    assert _errors(rule.format("true"), "gpt_bigcode", 2) == [
        "2:45: option 'packed' takes a positive integer or a part list such as [q, kv, kv], not 'true'"]


def test_style_module_checks():
    assert _errors("dtp 1\nmodel.layers.*.mlp.gate: experts\n", "mixtral", 2) == [
        "2:26: model.layers.0.mlp.gate (and 1 more module): experts applies to a module with 3-D expert parameters "
        "gate_up_proj (E, 2·I, H) and down_proj (E, H, I); this module is MixtralTopKRouter"]
    assert _errors("dtp 1\ntransformer.h.*.attn.c_attn: colwise(packed=5)\n", "gpt2", 2)[0].endswith(
        "out_features=192 holds 3 equal parts (q, k and v of 64), not 5; use packed=3")  # read from the attention


def test_slice_input_checks():
    assert _errors("dtp 1\ntransformer.h.*.self_attention: slice_input\n", "bloom", 2) == [
        "2:33: transformer.h.0.self_attention (and 1 more module): slice_input needs the keyword input to cut, "
        "e.g. slice_input(name=alibi)"]
    assert _errors("dtp 1\ntransformer.h.*.self_attention: slice_input(name=alibi)\n", "bloom", 3) == [
        "2:33: transformer.h.0.self_attention (and 1 more module): slice_input cuts 4 attention heads "
        "(config.n_head) into whole heads per rank, which tp=3 does not divide; tp values that work: 1, 2, 4"]


def test_explain_rows_of_the_new_layouts():
    cases = {
        "gpt2": ("transformer.h.0.attn.c_attn.weight", "Shard(1) packed×3", (64, 192), (64, 96)),
        "gpt_bigcode": ("transformer.h.0.attn.c_attn.weight", "Shard(0) parts[64,16r,16r]", (96, 64), (64, 64)),
        "mixtral": ("model.layers.0.mlp.experts.down_proj", "Shard(2)", (4, 64, 128), (4, 64, 64)),
        "qwen3": ("model.layers.0.self_attn.q_norm.weight", "Replicate()", (16,), (16,)),
    }
    for family, (name, placement, shape, local) in cases.items():
        model = models.build(f"dtp.models.hf:{family}")
        plan = parse((PLANS / f"{family}.tp").read_text(), f"{family}.tp")
        ex = explain(check(plan, model, 2), model, family, 2, batch=2, seq=8)
        row = next(r for r in ex.rows if r.name == name)
        assert (row.placement, row.shape, row.local_shape) == (placement, shape, local), family
        assert ex.bytes_per_rank == sum(r.bytes_per_rank for r in ex.rows)


def test_unequal_parts_on_phi3_qkv():
    model = models.build("dtp.models.hf:phi3")  # qkv_proj: 4 query heads, 2 key/value heads of 16: 64/32/32
    plan = parse((PLANS / "phi3.tp").read_text(), "phi3.tp")
    rows = {tp: next(r for r in explain(check(plan, model, tp), model, "phi3", tp, batch=2, seq=8).rows
                     if r.name == "model.layers.0.self_attn.qkv_proj.weight") for tp in (2, 4)}
    assert (rows[2].placement, rows[2].shape, rows[2].local_shape) == ("Shard(0) parts[64,32,32]", (128, 64), (64, 64))
    # tp 4 > 2 key/value heads: each rank its query heads' k and v head (repeat(kv))
    assert (rows[4].placement, rows[4].local_shape) == ("Shard(0) parts[64,32h2,32h2]", (48, 64))


def test_pack_parts_round_trip_and_layout():
    import torch

    from dtp.layouts import pack_parts, unpack_parts

    t = torch.arange(8.0 + 4 + 2).reshape(-1, 1)  # parts of 8 (sharded), 4 (sharded), 2 (replicated)
    parts = ((8, True), (4, True), (2, False))
    packed = pack_parts(t, parts, 2)
    assert packed.flatten().tolist() == [0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 12, 13]
    assert torch.equal(unpack_parts(packed, parts, 2), t)


def test_repeat_parts_give_each_rank_its_query_heads_kv_head():
    import torch

    from dtp.layouts import pack_parts, unpack_parts
    from dtp.placement import Placement

    t = torch.arange(8.0 + 4).reshape(-1, 1)  # q of 8 rows (sharded), 2 key/value heads of 2 rows (repeat)
    parts = ((8, True), (4, 2))
    packed = pack_parts(t, parts, 4)  # ranks 0, 1 read head 0 (rows 8, 9); ranks 2, 3 head 1 (rows 10, 11)
    assert packed.flatten().tolist() == [0, 1, 8, 9, 2, 3, 8, 9, 4, 5, 10, 11, 6, 7, 10, 11]
    assert torch.equal(unpack_parts(packed, parts, 4), t)
    assert pack_parts(t, parts, 2).flatten().tolist() == [0, 1, 2, 3, 8, 9, 4, 5, 6, 7, 10, 11]  # tp divides: shard
    placement = Placement(0, 1, parts)
    assert (placement.local_shape((12, 1), 4), placement.replicated_rows(4), placement.replicated_rows(2)) == \
        ((4, 1), 4, 0)
    assert _errors("dtp 1\nmodel.layers.*.self_attn.k_proj: colwise(packed=[repeat(kv)])\n"
                   "model.layers.*.self_attn.v_proj: colwise(packed=[repeat(kv)])\n", "llama", 3)[0].endswith(
        "packed part 1 (repeat(kv), 32 features) holds 2 key/value heads: tp=3 neither divides them nor is a "
        "multiple of them, so ranks cannot share whole heads")
