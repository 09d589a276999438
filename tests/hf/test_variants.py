"""Config variants of the Hugging Face families (dtp/hf/variant_list.py) that real checkpoints use,
against the shipped plans/hf/*.tp: the ones that found bugs, and the knobs that change attention
maths or module structure most, with parity and exact collective counts; clean refusals where the
layout cannot serve the config. The full sweep (`python -m dtp.hf.variants`,
bench/results/hf_variants.md) runs outside pytest."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from dtp.checks.checker import Checked, check
from dtp.errors import PlanError
from dtp.hf.variant_list import BY_NAME
from dtp.hf.variants import Outcome, judge, precheck, verify_variants_on_rank
from dtp.hf.verify import PLANS
from dtp.lang.parse import load
from dtp.models import hf
from dtp.runtime.ranks import on_ranks


def _counts(forward: int, backward: int) -> dict:
    return {"forward": {"all_reduce": forward}, "backward": {"all_reduce": backward}}


# variant → collectives per step at tp 2 (2 layers; 3 of the forward all-reduces are the
# vocab-parallel loss's)
TP2 = {
    # bug: per-head q/k LayerNorm gradients were not summed (parity failed)
    "phi/qk_layernorm": _counts(8, 13),
    # bug: one key/value head was refused; now repeat(kv), + k/v weight and bias
    "phi/mqa": _counts(8, 13),
    # bug: the float64 truth crashed in HF's float32-only path
    "gpt2/reorder_upcast": _counts(8, 5),
    "bloom/slow_but_exact": {
        "forward": {"all_gather": 4, "all_reduce": 4},
        "backward": {"all_reduce": 5},
    },  # bug:
    # HF reads dense weight slices directly: crashed on sharded weights; now those stay whole,
    # inputs gathered bug: local expert slices of 50 broke grouped_mm's stride alignment
    "mixtral/ffn100": _counts(8, 7),
    # bug: its local activations of 50 (not a weight) broke the same alignment
    "gpt_oss/ffn100": _counts(8, 7),
    # bug in the tiny configs: layer_types did not follow use_sliding_window
    "qwen2/sliding": _counts(8, 5),
    # bytes in bfloat16
    "qwen2_moe/bf16": {"forward": {"all_reduce": 10}, "backward": {"all_reduce": 9}},
    # routing weights' gradient summed in float32, as the schedule says
    "mixtral/bf16": _counts(8, 7),
    # attention and final-logit soft-capping on vocab-sharded logits
    "gemma2/softcap": _counts(8, 5),
    "gemma/2b": _counts(8, 9),  # head_dim ≠ hidden/heads with one key/value head
    "qwen3/mqa_head_dim32": _counts(8, 13),  # q/k norms + repeated k/v: 4 + 4 gradient all-reduces
    "opt/350m": _counts(8, 5),  # post-LN, project_in / project_out stay replicated
    "gpt_neox/rotary_pct": _counts(8, 5),
    "llama/odd_vocab_tied": _counts(8, 5),  # a prime vocabulary, uneven shards
    "llama/sdpa": _counts(8, 5),
}
TP4 = {
    # bug: 6 a rank
    "qwen2_moe/moe_ffn24": {"forward": {"all_reduce": 10}, "backward": {"all_reduce": 17}},
    "phi/gqa": _counts(8, 13),  # bug: 2 key/value heads at tp 4 were refused
    "gemma/2b": _counts(8, 9),
}


def _assert_variants(results: list[list[dict]], expected: dict, tp: int) -> None:
    for rank_results in results:
        assert [r["variant"] for r in rank_results] == list(expected)
        for r in rank_results:
            outcome = judge(r["variant"], tp, r)
            assert outcome.kind == "ok", outcome
            counts = {k: v for k, v in r["measured"].items() if k != "bytes"}
            assert counts == expected[r["variant"]], r["variant"]


def _items(names, tp: int) -> list[tuple[str, str, dict, Checked]]:
    """Each variant prechecked here (no outcome decided before the ranks), for the ranks."""
    items = []
    for n in names:
        checked = precheck(BY_NAME[n], tp)
        assert isinstance(checked, Checked), checked
        items.append((n, BY_NAME[n].family, BY_NAME[n].overrides, checked))
    return items


def test_variants_at_tp2():
    _assert_variants(on_ranks(verify_variants_on_rank, 2, _items(TP2, 2), timeout=600), TP2, 2)


def test_variants_at_tp4():
    _assert_variants(on_ranks(verify_variants_on_rank, 4, _items(TP4, 4), timeout=600), TP4, 4)


def test_refusals_name_the_heads_and_the_working_tp():
    # 6 query heads over 3 key/value heads: tp 2 cannot split either way
    out = precheck(BY_NAME["llama/kv3"], 2)
    assert out.kind == "refused"
    assert (
        "llama.tp:15:27: model.layers.0.self_attn.k_proj (and 1 more module): 3 key/value heads "
        "(head size 16, "
        "config.num_key_value_heads) do not divide by tp=2; each rank must hold whole heads; tp "
        "values that "
        "work: 1, 3" in out.detail
    )
    out = precheck(BY_NAME["qwen2/heads14"], 4)  # Qwen2-0.5B's 14 heads
    assert (
        out.kind == "refused"
        and "14 attention heads (head size 16, config.num_attention_heads) do not divide "
        "by tp=4; each rank must hold whole heads; tp values that work: 1, 2, 7, 14"
        in out.detail
    )
    # q, k, v fused per head: whole heads must divide, not 18 blocks
    out = precheck(BY_NAME["gpt_neox/heads6"], 4)
    assert (
        "query_key_value (and 1 more module): 6 attention heads (3 fused blocks each) (head size "
        "16, "
        "config.num_attention_heads) do not divide by tp=4; each rank must hold whole heads; tp "
        "values that "
        "work: 1, 2, 3, 6;"
    ) in out.detail


def test_phi_plan_admits_tp_by_key_value_heads():
    plan = load(str(PLANS / "phi.tp"))
    assert check(plan, hf.build("phi", num_key_value_heads=1, qk_layernorm=True)).admissible_tp == (
        1,
        2,
        4,
    )
    with pytest.raises(PlanError, match="3 key/value heads"):
        check(
            plan, hf.build("phi", hidden_size=96, num_attention_heads=6, num_key_value_heads=3), 2
        )


def test_tiny_configs_derive_fields_as_a_checkpoint_does():
    cfg = hf.config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    # not the 24-layer default list
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    assert hf.config("gpt_neox", rotary_pct=0.5).rope_parameters["partial_rotary_factor"] == 0.5
    assert (
        hf.config("gpt2", n_embd=96, n_head=6).hidden_size,
        hf.config("bloom", n_head=8).num_attention_heads,
    ) == (96, 8)
    assert hf.config("llama", attn_implementation="sdpa")._attn_implementation == "sdpa"
    assert hf.config("llama")._attn_implementation == "eager"


def test_a_variant_whose_knob_does_not_land_is_not_run():
    from dtp.hf.variant_list import Variant

    out = precheck(Variant("x", "gpt2", dict(rotary_pct=0.5)), 2)  # GPT-2 has no rotary embedding
    assert out == Outcome("x", 2, "build", "config ignored ['rotary_pct']")
