"""A GPT-2 written for one device, with GPT-2's module names, that stays correct when sharded.

The only concession to tensor parallelism: attention takes its local head count from the tensor it
receives (`view(B, T, -1, head_dim)`), so a column-sharded `c_attn` simply yields fewer heads per
rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2 hyper-parameters; defaults are GPT-2 small's."""

    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block
    n_embd: int = 768  # hidden size; n_embd / n_head is the head size
    vocab_size: int = 50257  # GPT-2's BPE vocabulary
    block_size: int = 1024  # longest sequence (rows of the position embedding)
    dropout: float = 0.0  # parity runs keep it at 0: masks are random
    bias: bool = True  # biases in Linears and LayerNorms, as GPT-2
    tie_embeddings: bool = True  # lm_head.weight is wte.weight, as GPT-2

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection (`c_attn`)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.head_dim = cfg.n_embd // cfg.n_head  # global; the head *count* comes from the tensor
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Causal self-attention over (B, T, C); heads per rank from the tensor, not the config."""
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # each (B, T, local width)
        # (B, nh, T, hs)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, local width)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The 4× feed-forward block: c_fc (colwise under Megatron), GELU, c_proj (rowwise)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """c_fc, GELU, c_proj (and dropout): (B, T, C) → (B, T, C)."""
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + attn(ln_1(x)), then x + mlp(ln_2(x))."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2: `input_ids` (B, T) → logits (B, T, vocab_size)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) for token ids (B, T)."""
        B, T = input_ids.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=input_ids.device)
        x = self.transformer.drop(self.transformer.wte(input_ids) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))
