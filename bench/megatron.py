"""The comparison point: the same GPT written the Megatron-LM way, from plain tensors and hand-written
tensor-parallel operators (Shoeybi et al., 2019, section 3; megatron/core/tensor_parallel).

- f / g: the conjugate operators — f is identity forward and all-reduce backward, g the reverse.
- ColumnParallelLinear holds `out_features / tp` rows; RowParallelLinear `in_features / tp` columns and
  all-reduces its output before adding the bias.
- VocabParallelEmbedding looks up only its vocabulary range and all-reduces.
- The vocabulary-parallel cross-entropy all-reduces the max, the sum of exponentials and the target
  logit, and never gathers the logits.
- The fused QKV projection is head-aligned: each rank holds [q_r; k_r; v_r].

BASELINE_VERSION names this implementation in every result it produces.
"""
from __future__ import annotations



import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtp.models.gpt import GPT, GPTConfig
from dtp.styles import pack_rows

BASELINE_VERSION = "megatron-style-1"


class _F(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class _G(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits sharded on the vocabulary (B·T, V/tp); returns the mean loss."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start):
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp)
        local_target = target - vocab_start
        inside = (local_target >= 0) & (local_target < logits.shape[-1])
        picked = shifted.gather(-1, local_target.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        picked = torch.where(inside, picked, torch.zeros_like(picked))
        dist.all_reduce(picked)
        loss = (sum_exp.log() - picked).mean()
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_target, inside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, inside = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0])[inside]
        g[rows, local_target[inside]] -= 1.0
        return g * (grad / g.shape[0]), None, None


class MegatronGPT(nn.Module):
    """This rank's part of a GPT-2 under Megatron tensor parallelism (dropout 0)."""

    def __init__(self, cfg: GPTConfig, rank: int, tp: int):
        super().__init__()
        if cfg.n_head % tp or cfg.vocab_size % tp:
            raise ValueError("the Megatron baseline needs heads and vocabulary divisible by tp")
        self.cfg, self.rank, self.tp = cfg, rank, tp
        C, V, L = cfg.n_embd, cfg.vocab_size, cfg.n_layer
        self.vocab_start = rank * V // tp
        self.wte = nn.Parameter(torch.empty(V // tp, C))  # VocabParallelEmbedding; tied to the head
        self.wpe = nn.Parameter(torch.empty(cfg.block_size, C))
        self.blocks = nn.ModuleList()
        for _ in range(L):
            b = nn.Module()
            b.ln_1, b.ln_2 = nn.LayerNorm(C, bias=cfg.bias), nn.LayerNorm(C, bias=cfg.bias)
            b.qkv = nn.Linear(C, 3 * C // tp, bias=cfg.bias)  # column-parallel, head-aligned
            b.proj = nn.Linear(C // tp, C, bias=False)  # row-parallel; bias added after the reduce
            b.proj_bias = nn.Parameter(torch.zeros(C)) if cfg.bias else None
            b.fc = nn.Linear(C, 4 * C // tp, bias=cfg.bias)
            b.fc2 = nn.Linear(4 * C // tp, C, bias=False)
            b.fc2_bias = nn.Parameter(torch.zeros(C)) if cfg.bias else None
            self.blocks.append(b)
        self.ln_f = nn.LayerNorm(C, bias=cfg.bias)
        self.head_dim = C // cfg.n_head

    @torch.no_grad()
    def load_from(self, full: GPT) -> None:
        """Copy this rank's slices of an unsharded dtp GPT (the same weights the dtp run starts from)."""
        tp, r = self.tp, self.rank

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.chunk(tp, dim=0)[r]

        def cols(t: torch.Tensor) -> torch.Tensor:
            return t.chunk(tp, dim=-1)[r]

        t = full.transformer
        self.wte.copy_(rows(t.wte.weight))
        self.wpe.copy_(t.wpe.weight)
        for b, h in zip(self.blocks, t.h):
            b.ln_1.load_state_dict(h.ln_1.state_dict())
            b.ln_2.load_state_dict(h.ln_2.state_dict())
            b.qkv.weight.copy_(rows(pack_rows(h.attn.c_attn.weight, 3, tp)))
            if self.cfg.bias:
                b.qkv.bias.copy_(rows(pack_rows(h.attn.c_attn.bias, 3, tp)))
                b.proj_bias.copy_(h.attn.c_proj.bias)
                b.fc.bias.copy_(rows(h.mlp.c_fc.bias))
                b.fc2_bias.copy_(h.mlp.c_proj.bias)
            b.proj.weight.copy_(cols(h.attn.c_proj.weight))
            b.fc.weight.copy_(rows(h.mlp.c_fc.weight))
            b.fc2.weight.copy_(cols(h.mlp.c_proj.weight))
        self.ln_f.load_state_dict(t.ln_f.state_dict())

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.wte.shape[0])
        x = F.embedding(local.clamp(0, self.wte.shape[0] - 1), self.wte) * inside.unsqueeze(-1)
        return _G.apply(x)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Local logits (B, T, V/tp)."""
        B, T = ids.shape
        x = self._embed(ids) + self.wpe[:T]
        for b in self.blocks:
            q, k, v = b.qkv(_F.apply(b.ln_1(x))).chunk(3, dim=-1)
            q, k, v = (z.view(B, T, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
            y = _G.apply(b.proj(y))
            x = x + (y + b.proj_bias if b.proj_bias is not None else y)
            h = b.fc2(F.gelu(b.fc(_F.apply(b.ln_2(x))), approximate="tanh"))
            h = _G.apply(h)
            x = x + (h + b.fc2_bias if b.fc2_bias is not None else h)
        return F.linear(_F.apply(self.ln_f(x)), self.wte)  # the head shares the embedding's vocabulary slice

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel cross-entropy."""
        return _VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), self.vocab_start)


def flops_per_token(cfg: GPTConfig, seq: int) -> float:
    """Training FLOPs per token: 6 × parameters + attention (PaLM appendix B)."""
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    params = L * 12 * C * C + V * C
    return 6 * params + 12 * L * C * seq


def allclose_report(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a − b| / max |b|."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0



