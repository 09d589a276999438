"""A Llama written for one device, with Hugging Face's module names, that stays correct when
sharded.

As in gpt.py, attention takes its local head counts from the tensors it receives (`view(B, T, -1,
head_dim)` for q, k and v), so column-sharded projections simply yield fewer heads per rank.
Grouped-query attention repeats each key/value head n_head // n_kv_head times; sharding shrinks q
and kv heads together, so that group size, and which q heads share which kv head, is the same on
every rank. RoPE is computed in forward from positions (Hugging Face's rotate_half convention): no
buffers, so meta builds stay cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtp.models.gpt import GPT


@dataclass(frozen=True)
class LlamaConfig:
    """Llama hyper-parameters; defaults are Llama 2 7B's."""

    n_layer: int = 32  # decoder layers
    n_head: int = 32  # query heads per layer
    n_kv_head: int = 32  # key/value heads (grouped-query attention when fewer than n_head)
    n_embd: int = 4096  # hidden size; n_embd / n_head is the head size
    intermediate_size: int = 11008  # SwiGLU width of gate_proj and up_proj
    vocab_size: int = 32000  # SentencePiece vocabulary of Llama 2
    block_size: int = 4096  # longest sequence (RoPE needs no table, so only a limit)
    rope_theta: float = 10000.0  # RoPE base; Llama 3 uses 500000
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # lm_head.weight is embed_tokens.weight (Llama does not tie)
    # one mlp.gate_up_proj instead of gate_proj and up_proj (plans use packed=2)
    packed_gate_up: bool = False
    dropout: float = 0.0  # for symmetry with GPTConfig; Llama has no dropout, so it must stay 0

    def __post_init__(self) -> None:
        for name in (
            "n_layer",
            "n_head",
            "n_kv_head",
            "n_embd",
            "intermediate_size",
            "vocab_size",
            "block_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                hint = " (YAML reads 1e-5 as text: write 1.0e-5)" if isinstance(value, str) else ""
                raise ValueError(f"{name} must be a positive number, got {value!r}{hint}")
        for name in ("tie_embeddings", "packed_gate_up"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}"
            )
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"head size n_embd / n_head = {self.n_embd // self.n_head} must be even for RoPE"
            )
        if self.dropout != 0:
            raise ValueError(f"dropout must be 0 (Llama has no dropout), got {self.dropout!r}")


class RotaryEmbedding(nn.Module):
    """cos and sin of RoPE for positions, computed on the fly as Hugging Face's
    LlamaRotaryEmbedding."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the rotary angles at positions `pos`, in `x`'s dtype."""
        exponents = (
            torch.arange(0, self.head_dim, 2, dtype=torch.float, device=pos.device) / self.head_dim
        )
        inv_freq = 1.0 / (self.theta**exponents)  # (head_dim / 2,)
        freqs = pos[..., None].float() * inv_freq  # (T, head_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) → (-x2, x1) over the last dimension's halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE; separate q/k/v projections, no biases."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head  # global; the head *counts* come from the tensors
        self.n_rep = cfg.n_head // cfg.n_kv_head  # q heads per kv head; unchanged by sharding
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Grouped-query causal attention with rotary embeddings; local heads from the tensor."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, local nh, T, hs)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, local n_kv, T, hs)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, local n_kv, T, hs)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin  # cos, sin: (T, hs)
        k, v = (t.repeat_interleave(self.n_rep, dim=1) for t in (k, v))  # (B, local nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, local nh * hs)
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)); gate and up optionally packed in one
    Linear."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.packed = cfg.packed_gate_up
        if self.packed:
            self.gate_up_proj = nn.Linear(cfg.n_embd, 2 * cfg.intermediate_size, bias=False)
        else:
            self.gate_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
            self.up_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU: down(silu(gate(x)) · up(x)), gate and up packed or apart."""
        if self.packed:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each (B, T, local intermediate)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer (RMSNorm), registered in Hugging Face's order."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x + attention(norm(x)), then x + mlp(norm(x))."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Llama (LlamaForCausalLM's layout): `input_ids` (B, T) → logits (B, T, vocab_size)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                layers=nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layer)),
                norm=nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps),
                rotary_emb=RotaryEmbedding(cfg.n_embd // cfg.n_head, cfg.rope_theta),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(GPT._init_weights)  # normal(0, 0.02) weights, as GPT-2 (Llama has no biases)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) for token ids (B, T)."""
        B, T = input_ids.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        x = self.model.embed_tokens(input_ids)  # (B, T, n_embd)
        cos, sin = self.model.rotary_emb(x, torch.arange(T, device=input_ids.device))
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))
