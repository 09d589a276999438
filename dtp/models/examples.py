"""Factories for `dtp apply PLAN package.module:factory`: models that are not in the zoo.

`tiny_lm` is a small Transformer of our own in the style of PyTorch's test Transformer: its
attention reads the head count from an attribute (`n_heads`), so a plan must rewrite it per rank
with `set`. `tiny_llama` is a Hugging Face Llama built from a tiny config (needs `transformers`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    """Separate q/k/v projections; the head count is an attribute, as in torch's test Transformer."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads  # under tp the plan sets it to n_heads / tp
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Causal self-attention over (B, T, C), the local head count read from the tensor."""
        B, T, _ = x.shape
        q, k, v = (
            w(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, n_heads, T, head_dim)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """w2(relu(w1 x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The two-matrix MLP: (B, T, C) → (B, T, C)."""
        return self.w2(F.relu(self.w1(x)))


class Layer(nn.Module):
    """Pre-norm block."""

    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-norm residual block: attention, then the MLP."""
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLM(nn.Module):
    """tok_embeddings → layers → norm → output; untied, learned positions."""

    def __init__(
        self,
        vocab: int = 128,
        dim: int = 48,
        n_heads: int = 4,
        n_layers: int = 2,
        max_seq: int = 64,
    ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Embedding(max_seq, dim)
        self.layers = nn.ModuleList(Layer(dim, n_heads, 4 * dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) for token ids (B, T)."""
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.tok_embeddings(input_ids) + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def tiny_lm() -> nn.Module:
    """A 2-layer TinyLM: vocab 128, width 48, 4 heads."""
    return TinyLM()


def tiny_llama() -> nn.Module:
    """A Hugging Face LlamaForCausalLM from a tiny config: 2 layers, 4 heads, 2 key/value heads."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as err:
        raise RuntimeError(
            "tiny_llama needs Hugging Face transformers: pip install transformers"
        ) from err
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)
