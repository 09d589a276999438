"""The zoo's GPT and Llama as Hugging Face classes, for `dtp export --hf-dir`: a model trained from
a zoo config loads with `from_pretrained` and computes what it computed in dtp.

GPT → `GPT2LMHeadModel`: the same module names (nanoGPT took them from GPT-2), but GPT-2's Conv1D
keeps its weight as (in, out), so every Linear weight inside the blocks is transposed; a GPT built
without biases gets zero ones (GPT-2 always has them: adding 0 changes nothing); GELU is GPT-2's
`gelu_new` (tanh), as dtp's. Llama → `LlamaForCausalLM`: the same names and rotate_half RoPE; a
packed gate_up_proj is cut back into gate_proj and up_proj (gate first, as dtp's MLP chunks it).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dtp.models.gpt import GPT
from dtp.models.llama import Llama

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def zoo_hf_config(model: nn.Module) -> dict | None:
    """The Hugging Face config a zoo GPT or Llama exports as (`architectures` names the class), else
    None."""
    if isinstance(model, GPT):
        c = model.config
        return {
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "n_layer": c.n_layer,
            "n_head": c.n_head,
            "n_embd": c.n_embd,
            "vocab_size": c.vocab_size,
            "n_positions": c.block_size,
            "n_ctx": c.block_size,
            "n_inner": None,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "resid_pdrop": c.dropout,
            "embd_pdrop": c.dropout,
            "attn_pdrop": c.dropout,
            "tie_word_embeddings": c.tie_embeddings,
        }
    if isinstance(model, Llama):
        c = model.config
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": c.n_embd,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head,
            "num_key_value_heads": c.n_kv_head,
            "vocab_size": c.vocab_size,
            "max_position_embeddings": c.block_size,
            "rms_norm_eps": c.norm_eps,
            "rope_theta": c.rope_theta,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": c.dropout,
            "tie_word_embeddings": c.tie_embeddings,
        }
    return None


def to_hf_state(
    model_class: str, config: dict, state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A zoo model's unsharded state dict in its Hugging Face class's layout (other classes:
    unchanged)."""
    if model_class == "GPT":
        return _gpt2(config, state)
    if model_class == "Llama":
        return _llama(state)
    return state


def _gpt2(config: dict, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: (v.t().contiguous() if k.endswith(_CONV1D) else v) for k, v in state.items()}
    width, dtype = config["n_embd"], state["transformer.wte.weight"].dtype
    for i in range(config["n_layer"]):  # a GPT without biases: GPT-2's are zero
        for name, size in (
            ("ln_1", width),
            ("attn.c_attn", 3 * width),
            ("attn.c_proj", width),
            ("ln_2", width),
            ("mlp.c_fc", 4 * width),
            ("mlp.c_proj", width),
        ):
            out.setdefault(f"transformer.h.{i}.{name}.bias", torch.zeros(size, dtype=dtype))
    out.setdefault("transformer.ln_f.bias", torch.zeros(width, dtype=dtype))
    return out


def _llama(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if k.endswith("mlp.gate_up_proj.weight"):
            gate, up = v.chunk(2, dim=0)
            out[k.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[k.replace("gate_up_proj", "up_proj")] = up.contiguous()
        else:
            out[k] = v
    return out
