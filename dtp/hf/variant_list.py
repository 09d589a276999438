"""Config variants of the Hugging Face families, as real checkpoints of each family set them: the
knobs that change module structure or attention maths (tied embeddings, biases, a head size set
apart from the width, key/value head counts against tp, sliding windows, soft-capping, partial
rotary, OPT-350m's projections, expert counts, odd vocabularies…). Each is the family's tiny config
(`dtp.models.hf`) with overrides on top; `dtp.hf.variants` runs them against the shipped
`plans/hf/<model_type>.tp`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Variant:
    """One config variant: a name, the family it starts from, its overrides and what real model it
    mimics."""

    name: str
    family: str
    overrides: dict[str, Any] = field(default_factory=dict)
    like: str = ""


def _rope(kind: str, **extra: Any) -> dict[str, Any]:
    return {"rope_type": kind, "rope_theta": 10000.0, **extra}


LLAMA3_ROPE = _rope(
    "llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
# Six query heads of 16 (width 96): tp 2 divides them, tp 4 does not.
SIX_HEADS = dict(hidden_size=96, num_attention_heads=6, intermediate_size=192)
ODD_VOCAB = dict(vocab_size=131)  # a prime, like GPT-2's 50257 = 29 · 1733: no tp > 1 divides it

_GQA = [  # the key/value head layouts every Llama-style family meets
    (
        "mha",
        dict(num_key_value_heads=4),
        "Llama-2-7B, Gemma-7B: as many key/value heads as query heads",
    ),
    ("mqa", dict(num_key_value_heads=1), "Gemma-2B, Falcon-7B: one key/value head"),
    (
        "kv3",
        dict(SIX_HEADS, num_key_value_heads=3),
        "3 key/value heads: tp 2 neither divides nor repeats them",
    ),
    (
        "heads8_kv2",
        dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2),
        "Llama-3-8B: 32/8",
    ),
]
_COMMON = [
    (
        "tied",
        dict(tie_word_embeddings=True),
        "Llama-3.2-1B, Qwen2-0.5B: lm_head tied to the embedding",
    ),
    ("untied", dict(tie_word_embeddings=False), "the 7B-class models"),
    ("odd_vocab", ODD_VOCAB, "a vocabulary no tp divides"),
    ("odd_vocab_tied", dict(ODD_VOCAB, tie_word_embeddings=True), "same, tied"),
]


def _llama_like(family: str) -> list[Variant]:
    """The key/value-head and embedding variants of a Llama-style family."""
    return [Variant(f"{family}/{n}", family, o, like) for n, o, like in _GQA + _COMMON]


VARIANTS: list[Variant] = [
    # GPT-2
    Variant(
        "gpt2/untied", "gpt2", dict(tie_word_embeddings=False), "GPT-2 fine-tunes saved untied"
    ),
    Variant("gpt2/n_inner_none", "gpt2", dict(n_inner=None), "gpt2: n_inner null → 4·n_embd"),
    Variant(
        "gpt2/inverse_layer_idx",
        "gpt2",
        dict(scale_attn_by_inverse_layer_idx=True),
        "Mistral-GPT2, Stanford CRFM",
    ),
    Variant(
        "gpt2/reorder_upcast", "gpt2", dict(reorder_and_upcast_attn=True), "Stanford CRFM GPT-2"
    ),
    Variant(
        "gpt2/no_scale_attn", "gpt2", dict(scale_attn_weights=False), "scale_attn_weights false"
    ),
    Variant(
        "gpt2/cross_attention",
        "gpt2",
        dict(add_cross_attention=True),
        "GPT-2 decoders of encoder-decoders",
    ),
    Variant("gpt2/odd_vocab", "gpt2", ODD_VOCAB, "gpt2: 50257"),
    Variant(
        "gpt2/heads6",
        "gpt2",
        dict(n_embd=96, n_head=6, n_inner=192),
        "6 heads: tp 4 cannot split them",
    ),
    # Llama
    *_llama_like("llama"),
    Variant(
        "llama/bias",
        "llama",
        dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True),
        "InternLM-style",
    ),
    Variant(
        "llama/head_dim32",
        "llama",
        dict(num_key_value_heads=2, head_dim=32),
        "head_dim ≠ hidden/heads",
    ),
    Variant(
        "llama/rope_llama3",
        "llama",
        dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE),
        "Llama-3.1",
    ),
    Variant(
        "llama/rope_linear",
        "llama",
        dict(num_key_value_heads=2, rope_parameters=_rope("linear", factor=2.0)),
        "linear RoPE scaling",
    ),
    Variant(
        "llama/rope_dynamic",
        "llama",
        dict(num_key_value_heads=2, rope_parameters=_rope("dynamic", factor=2.0)),
        "dynamic NTK RoPE",
    ),
    Variant(
        "llama/ffn130",
        "llama",
        dict(num_key_value_heads=2, intermediate_size=130),
        "an FFN width tp 4 does not divide",
    ),
    Variant(
        "llama/pretraining_tp2",
        "llama",
        dict(num_key_value_heads=2, pretraining_tp=2),
        "Llama-2 configs",
    ),
    # Mistral
    *_llama_like("mistral"),
    Variant(
        "mistral/sliding4",
        "mistral",
        dict(num_key_value_heads=2, sliding_window=4),
        "Mistral-7B-v0.1: 4096",
    ),
    Variant(
        "mistral/mqa_sliding",
        "mistral",
        dict(num_key_value_heads=1, sliding_window=4),
        "one kv head, windowed",
    ),
    Variant(
        "mistral/nemo_head_dim",
        "mistral",
        dict(num_key_value_heads=2, head_dim=32, sliding_window=None),
        "Mistral-Nemo: head_dim 128 with 5120 = 32 × 160",
    ),
    # Qwen2
    *_llama_like("qwen2"),
    Variant(
        "qwen2/sliding",
        "qwen2",
        dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1),
        "use_sliding_window with max_window_layers",
    ),
    Variant(
        "qwen2/heads14",
        "qwen2",
        dict(
            hidden_size=224, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True
        ),
        "Qwen2-0.5B: 14 heads, 2 kv, tied",
    ),
    # Qwen3
    *_llama_like("qwen3"),
    Variant(
        "qwen3/head_dim32",
        "qwen3",
        dict(num_key_value_heads=2, head_dim=32),
        "Qwen3: head_dim 128, 1024 wide",
    ),
    Variant(
        "qwen3/mqa_head_dim32",
        "qwen3",
        dict(num_key_value_heads=1, head_dim=32),
        "q/k norms + one kv head",
    ),
    Variant(
        "qwen3/bias",
        "qwen3",
        dict(num_key_value_heads=2, attention_bias=True),
        "attention_bias true",
    ),
    Variant(
        "qwen3/sliding",
        "qwen3",
        dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1),
        "sliding window layers",
    ),
    # Gemma
    *_llama_like("gemma"),
    Variant(
        "gemma/7b",
        "gemma",
        dict(num_key_value_heads=4, head_dim=32),
        "Gemma-7B: 16 heads × 256 > 3072",
    ),
    Variant(
        "gemma/2b",
        "gemma",
        dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=1, head_dim=32),
        "Gemma-2B: 8 heads × 256, one key/value head",
    ),
    # Gemma2
    *_llama_like("gemma2"),
    Variant(
        "gemma2/softcap",
        "gemma2",
        dict(num_key_value_heads=2, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        "Gemma-2: soft-capping",
    ),
    Variant(
        "gemma2/no_softcap",
        "gemma2",
        dict(num_key_value_heads=2, attn_logit_softcapping=None, final_logit_softcapping=None),
        "soft-capping off",
    ),
    Variant(
        "gemma2/query_scalar",
        "gemma2",
        dict(num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24),
        "Gemma-2-27B: query_pre_attn_scalar ≠ head_dim",
    ),
    Variant(
        "gemma2/sliding",
        "gemma2",
        dict(
            num_key_value_heads=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "Gemma-2: alternating sliding/full layers",
    ),
    Variant(
        "gemma2/2b",
        "gemma2",
        dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=32),
        "Gemma-2-2B: 8 heads × 256 > 2304",
    ),
    # GPT-NeoX
    Variant(
        "gpt_neox/rotary_pct",
        "gpt_neox",
        dict(rotary_pct=0.5),
        "Pythia: rotary_pct 0.25 (the tiny default); 0.5 here",
    ),
    Variant(
        "gpt_neox/sequential",
        "gpt_neox",
        dict(use_parallel_residual=False),
        "use_parallel_residual false",
    ),
    Variant("gpt_neox/no_bias", "gpt_neox", dict(attention_bias=False), "attention_bias false"),
    Variant("gpt_neox/tied", "gpt_neox", dict(tie_word_embeddings=True), "tied embeddings"),
    Variant(
        "gpt_neox/odd_vocab", "gpt_neox", ODD_VOCAB, "Pythia: 50304 (padded), GPT-NeoX-20B: 50432"
    ),
    Variant("gpt_neox/heads6", "gpt_neox", SIX_HEADS, "6 heads"),
    # GPT-J
    Variant("gptj/rotary_full", "gptj", dict(rotary_dim=16), "rotary over the whole head"),
    Variant("gptj/rotary4", "gptj", dict(rotary_dim=4), "GPT-J-6B: rotary_dim 64 of 256"),
    Variant("gptj/n_inner_none", "gptj", dict(n_inner=None), "n_inner null"),
    Variant("gptj/tied", "gptj", dict(tie_word_embeddings=True), "tied (lm_head keeps its bias)"),
    Variant("gptj/odd_vocab", "gptj", ODD_VOCAB, "GPT-J-6B: 50400"),
    # GPT-BigCode
    Variant("gpt_bigcode/n_inner_none", "gpt_bigcode", dict(n_inner=None), "n_inner null"),
    Variant(
        "gpt_bigcode/mha_tied",
        "gpt_bigcode",
        dict(multi_query=False, tie_word_embeddings=True),
        "SantaCoder-MHA",
    ),
    Variant("gpt_bigcode/untied", "gpt_bigcode", dict(tie_word_embeddings=False), "untied"),
    Variant(
        "gpt_bigcode/no_scale",
        "gpt_bigcode",
        dict(scale_attn_weights=False),
        "scale_attn_weights false",
    ),
    Variant(
        "gpt_bigcode/fp32_softmax",
        "gpt_bigcode",
        dict(attention_softmax_in_fp32=True, scale_attention_softmax_in_fp32=True),
        "StarCoder",
    ),
    Variant("gpt_bigcode/odd_vocab", "gpt_bigcode", ODD_VOCAB, "StarCoder: 49152"),
    Variant(
        "gpt_bigcode/heads6",
        "gpt_bigcode",
        dict(n_embd=96, n_head=6, n_inner=192),
        "6 heads, multi-query",
    ),
    # Phi
    Variant(
        "phi/rotary_quarter",
        "phi",
        dict(partial_rotary_factor=0.25),
        "Phi-2: partial_rotary_factor 0.4 (0.5 the tiny default)",
    ),
    Variant("phi/qk_layernorm", "phi", dict(qk_layernorm=True), "qk_layernorm true"),
    Variant("phi/gqa", "phi", dict(num_key_value_heads=2), "grouped-query Phi"),
    Variant("phi/mqa", "phi", dict(num_key_value_heads=1), "one key/value head"),
    Variant("phi/tied", "phi", dict(tie_word_embeddings=True), "tied (lm_head keeps its bias)"),
    Variant("phi/odd_vocab", "phi", ODD_VOCAB, "Phi-2: 51200"),
    # OPT
    Variant(
        "opt/350m",
        "opt",
        dict(do_layer_norm_before=False, word_embed_proj_dim=32),
        "OPT-350m: post-LN, project_in/project_out",
    ),
    Variant("opt/post_ln", "opt", dict(do_layer_norm_before=False), "post-LayerNorm"),
    Variant(
        "opt/proj_dim", "opt", dict(word_embed_proj_dim=32), "word_embed_proj_dim ≠ hidden_size"
    ),
    Variant("opt/no_bias", "opt", dict(enable_bias=False), "enable_bias false"),
    Variant(
        "opt/no_ln_affine", "opt", dict(layer_norm_elementwise_affine=False), "OPT-IML / Galactica"
    ),
    Variant("opt/untied", "opt", dict(tie_word_embeddings=False), "untied"),
    Variant("opt/odd_vocab", "opt", ODD_VOCAB, "OPT: 50272"),
    # Bloom
    Variant(
        "bloom/post_ln_residual",
        "bloom",
        dict(apply_residual_connection_post_layernorm=True),
        "apply_residual_connection_post_layernorm",
    ),
    Variant(
        "bloom/slow_but_exact",
        "bloom",
        dict(pretraining_tp=2, slow_but_exact=True),
        "slow_but_exact: dense weights read in pretraining_tp slices",
    ),
    Variant(
        "bloom/pretraining_tp",
        "bloom",
        dict(pretraining_tp=4),
        "bigscience/bloom: pretraining_tp 4",
    ),
    Variant("bloom/heads8", "bloom", dict(n_head=8, hidden_size=128), "8 heads"),
    Variant(
        "bloom/heads6",
        "bloom",
        dict(n_head=6, hidden_size=96),
        "6 heads (ALiBi slopes off a power of 2)",
    ),
    Variant("bloom/untied", "bloom", dict(tie_word_embeddings=False), "untied"),
    Variant("bloom/odd_vocab", "bloom", ODD_VOCAB, "Bloom: 250880"),
    # Mixtral
    *_llama_like("mixtral"),
    Variant(
        "mixtral/top1",
        "mixtral",
        dict(num_key_value_heads=2, num_experts_per_tok=1),
        "top-1 routing",
    ),
    Variant(
        "mixtral/8experts",
        "mixtral",
        dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
        "Mixtral-8x7B",
    ),
    Variant(
        "mixtral/head_dim32",
        "mixtral",
        dict(num_key_value_heads=2, head_dim=32),
        "head_dim ≠ hidden/heads",
    ),
    Variant(
        "mixtral/sliding",
        "mixtral",
        dict(num_key_value_heads=2, sliding_window=4),
        "sliding window",
    ),
    Variant(
        "mixtral/ffn100",
        "mixtral",
        dict(num_key_value_heads=2, intermediate_size=100),
        "expert FFN 100: local slices of 50, 25 break grouped_mm alignment",
    ),
    Variant(
        "mixtral/ffn96",
        "mixtral",
        dict(num_key_value_heads=2, intermediate_size=96),
        "FFN 96: 48 a rank at tp 2",
    ),
    # Qwen2-MoE
    *_llama_like("qwen2_moe"),
    Variant(
        "qwen2_moe/sparse_step2",
        "qwen2_moe",
        dict(num_key_value_heads=2, decoder_sparse_step=2),
        "decoder_sparse_step 2: dense MLP on odd layers",
    ),
    Variant(
        "qwen2_moe/mlp_only0",
        "qwen2_moe",
        dict(num_key_value_heads=2, mlp_only_layers=[0]),
        "mlp_only_layers",
    ),
    Variant(
        "qwen2_moe/norm_topk",
        "qwen2_moe",
        dict(num_key_value_heads=2, norm_topk_prob=True),
        "norm_topk_prob",
    ),
    Variant(
        "qwen2_moe/top1", "qwen2_moe", dict(num_key_value_heads=2, num_experts_per_tok=1), "top-1"
    ),
    Variant(
        "qwen2_moe/shared32",
        "qwen2_moe",
        dict(num_key_value_heads=2, shared_expert_intermediate_size=32),
        "smaller shared expert",
    ),
    Variant(
        "qwen2_moe/moe_ffn24",
        "qwen2_moe",
        dict(num_key_value_heads=2, moe_intermediate_size=24),
        "expert FFN 24: 6 a rank at tp 4",
    ),
    Variant(
        "qwen2_moe/sliding",
        "qwen2_moe",
        dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1),
        "sliding window",
    ),
    # GPT-OSS: sinks sliced per head; transposed experts, gate/up interleaved, with biases
    *_llama_like("gpt_oss"),
    Variant(
        "gpt_oss/top4_8experts",
        "gpt_oss",
        dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=4),
        "gpt-oss-20b: 32 experts, top-4",
    ),
    Variant(
        "gpt_oss/ffn100",
        "gpt_oss",
        dict(num_key_value_heads=2, intermediate_size=100),
        "expert FFN 100: local gate_up of 100, 50 columns break grouped_mm alignment",
    ),
    Variant(
        "gpt_oss/ffn12",
        "gpt_oss",
        dict(num_key_value_heads=2, intermediate_size=12),
        "expert FFN 12: 6 and 3 a rank, misaligned for grouped_mm",
    ),
    Variant(
        "gpt_oss/window4",
        "gpt_oss",
        dict(num_key_value_heads=2, sliding_window=4),
        "sliding window 4",
    ),
]

# How a checkpoint is loaded rather than what it is: bfloat16 weights (config.json's dtype), a KV
# cache built in the forward (use_cache true), torch's SDPA kernels instead of the eager attention.
_RUNTIME = [
    ("bf16", dict(dtype="bfloat16")),
    ("cache", dict(use_cache=True)),
    ("sdpa", dict(attn_implementation="sdpa")),
]
_RUNTIME_FAMILIES = {
    "gpt2": {},
    "llama": dict(num_key_value_heads=2),
    "mistral": dict(num_key_value_heads=1, sliding_window=4),
    "qwen2": dict(num_key_value_heads=2),
    "qwen3": dict(num_key_value_heads=1),
    "gemma": dict(num_key_value_heads=1),
    "gemma2": dict(num_key_value_heads=2, sliding_window=4),
    "gpt_neox": {},
    "gptj": {},
    "gpt_bigcode": {},
    "gpt_bigcode_mha": {},
    "phi": dict(qk_layernorm=True),
    "opt": {},
    "bloom": {},
    "mixtral": {},
    "qwen2_moe": {},
    "gpt_oss": dict(num_key_value_heads=2),
}
VARIANTS += [
    Variant(f"{family}/{kind}", family, {**base, **extra}, kind)
    for family, base in _RUNTIME_FAMILIES.items()
    for kind, extra in _RUNTIME
    # transformers refuses SDPA for these
    if not (kind == "sdpa" and family in ("gemma2", "bloom", "gpt_oss"))
]

BY_NAME: dict[str, Variant] = {v.name: v for v in VARIANTS}
