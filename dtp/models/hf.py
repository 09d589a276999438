"""Tiny Hugging Face models of any family, as `dtp apply plans/hf/gpt2.tp dtp.models.hf:gpt2`.

`dtp.models.hf:MODEL_TYPE` builds `AutoModelForCausalLM` from a tiny random config of that
`config.model_type` (transformers' own classes, no download): 2 layers, width 64, 4 heads,
vocabulary 128, so that tp 2 and 4 divide. A variant name adds config overrides for a layout the
family's default config does not exercise (`falcon_40b`: grouped key/value heads, new decoder
architecture; `gpt_bigcode_mha`: multi-head instead of multi-query; `falcon_rw`: ALiBi;
`gemma_tied`…).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

# Sizes every family gets (keys a config does not have are ignored).
COMMON: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    n_embd=64,
    n_layer=2,
    n_head=4,
    n_positions=64,
    max_position_embeddings=64,
    use_cache=False,
    ffn_dim=128,
    word_embed_proj_dim=64,
    n_inner=128,
    rotary_dim=8,
    head_dim=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# model_type (or variant) → (model_type, overrides)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("gpt2", {}),
    "llama": ("llama", dict(num_key_value_heads=2)),
    # one key/value head (as Gemma-2B, Falcon-7B)
    "llama_mqa": ("llama", dict(num_key_value_heads=1)),
    "mistral": ("mistral", dict(num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("qwen2", dict(num_key_value_heads=2)),
    "qwen3": ("qwen3", dict(num_key_value_heads=2)),
    "gemma": ("gemma", dict(num_key_value_heads=1)),
    "gemma2": ("gemma2", dict(num_key_value_heads=2)),
    "gpt_neox": ("gpt_neox", {}),
    "gptj": ("gptj", {}),
    "gpt_bigcode": ("gpt_bigcode", dict(multi_query=True)),
    "gpt_bigcode_mha": ("gpt_bigcode", dict(multi_query=False)),
    "falcon": (
        "falcon",
        dict(multi_query=True, new_decoder_architecture=False, alibi=False, ffn_hidden_size=128),
    ),
    "falcon_40b": (
        "falcon",
        dict(new_decoder_architecture=True, num_kv_heads=2, alibi=False, ffn_hidden_size=128),
    ),
    # ALiBi (falcon-rw-1b): per-head interleaved query_key_value, sequential attention and MLP,
    # biases
    "falcon_rw": (
        "falcon",
        dict(
            alibi=True,
            multi_query=False,
            new_decoder_architecture=False,
            parallel_attn=False,
            bias=True,
            num_kv_heads=4,
            ffn_hidden_size=128,
        ),
    ),
    "falcon_rw_sdpa": (
        "falcon",
        dict(
            alibi=True,
            multi_query=False,
            new_decoder_architecture=False,
            parallel_attn=False,
            bias=True,
            num_kv_heads=4,
            ffn_hidden_size=128,
            # transformers' default for Falcon
            _attn_implementation="sdpa",
        ),
    ),
    "falcon_rw_mqa": (
        "falcon",
        dict(
            alibi=True,
            multi_query=True,
            new_decoder_architecture=False,
            bias=True,
            # ALiBi with Falcon-7B's multi-query layout
            ffn_hidden_size=128,
        ),
    ),
    "phi": ("phi", dict(num_key_value_heads=4)),
    "phi3": ("phi3", dict(num_key_value_heads=2)),
    # Phi-3-mini's shape: no grouped-query attention; plus partial rotary, a sliding window, tied
    # embeddings
    "phi3_mha": (
        "phi3",
        dict(
            num_key_value_heads=4,
            partial_rotary_factor=0.5,
            sliding_window=4,
            tie_word_embeddings=True,
        ),
    ),
    "opt": ("opt", {}),
    "bloom": ("bloom", {}),
    "olmo2": ("olmo2", dict(num_key_value_heads=2)),
    "olmo2_mha": (
        "olmo2",
        dict(num_key_value_heads=4, attention_bias=True, tie_word_embeddings=True),
    ),
    # StableLM 2 1.6B/3B: partial rotary, LayerNorm
    "stablelm": ("stablelm", dict(num_key_value_heads=2)),
    # StableLM 2 12B: one LayerNorm per head (a ModuleList), parallel residual, qkv biases
    "stablelm_qk": (
        "stablelm",
        dict(
            num_key_value_heads=2, qk_layernorm=True, use_parallel_residual=True, use_qkv_bias=True
        ),
    ),
    "gpt_neo": ("gpt_neo", dict(attention_types=[[["global", "local"], 1]], window_size=8)),
    "apertus": ("apertus", dict(num_key_value_heads=2)),  # xIELU activation with learnt scalars
    # per-head query/key norms
    "hunyuan_v1_dense": ("hunyuan_v1_dense", dict(num_key_value_heads=2)),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[],
        ),
    ),
    "mixtral": ("mixtral", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    # transposed experts, gate/up interleaved, with biases; attention sinks; sliding and full layers
    "gpt_oss": ("gpt_oss", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
    ),
}


def config(name: str, **overrides: Any):
    """The tiny config of family or variant `name`, with `overrides` on top."""
    from transformers import AutoConfig

    model_type, extra = FAMILIES.get(name, (name, {}))
    overrides, extra = dict(overrides), dict(extra)
    # eager unless a variant asks for another path (`falcon_rw_sdpa`: sdpa, transformers' default
    # for Falcon)
    attn = overrides.pop(
        "attn_implementation",
        overrides.pop("_attn_implementation", extra.pop("_attn_implementation", "eager")),
    )
    default = AutoConfig.for_model(model_type)
    # n_embd → hidden_size: a later layer's alias wins
    aliases = getattr(default, "attribute_map", {})
    values: dict[str, Any] = {}
    for layer in (COMMON, extra, overrides):
        for key, value in layer.items():
            if hasattr(default, key) or layer is not COMMON:
                values[aliases.get(key, key)] = value
    # Passed to the constructor, as a checkpoint's config.json is, so that fields derived from
    # others (layer_types from sliding_window / max_window_layers, rope_parameters from rotary_pct…)
    # follow them; a derived property (Falcon's head_dim) cannot be given.
    cfg = AutoConfig.for_model(
        model_type,
        **{
            key: value
            for key, value in values.items()
            if not isinstance(getattr(type(default), key, None), property)
        },
    )
    for key, value in list(vars(cfg).items()):  # parity runs need dropout 0 (masks are random)
        if (
            ("dropout" in key or "pdrop" in key)
            and isinstance(value, float)
            and key not in overrides
        ):
            setattr(cfg, key, 0.0)
    cfg._attn_implementation = attn
    return cfg


def build(name: str, **overrides: Any) -> nn.Module:
    """`AutoModelForCausalLM` of family `name` from its tiny config."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config(name, **overrides))


def __getattr__(name: str):
    # `dtp.models.hf:gpt2` names a factory for any family in FAMILIES (or any model_type
    # transformers knows).
    if name.startswith("__"):
        raise AttributeError(name)

    def factory() -> nn.Module:
        return build(name)

    factory.__name__ = name
    factory.__doc__ = f"A tiny Hugging Face {name} (dtp.models.hf)."
    return factory
