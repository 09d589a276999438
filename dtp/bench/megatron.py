"""The comparison point: the same GPT written the Megatron-LM way, from plain tensors and
hand-written tensor-parallel operators (Shoeybi et al., 2019, section 3; Korthikanti et al., 2022
for sequence parallelism; megatron/core/tensor_parallel).

- f / g: the conjugate operators — f is identity forward and all-reduce backward, g the reverse.
  Under sequence parallelism f becomes an all-gather of the sequence (reduce-scatter backward) and g
  a reduce-scatter (all-gather backward).
- ColumnParallelLinear holds `out_features / tp` rows; RowParallelLinear `in_features / tp` columns
  and reduces its output before adding the bias.
- VocabParallelEmbedding looks up only its vocabulary range and all-reduces; learned positions are
  added to the full sum, which sequence parallelism then splits (Megatron's
  `scatter_to_sequence_parallel_region`).
- The vocabulary-parallel cross-entropy all-reduces the max, the sum of exponentials and the target
  logit.
- The fused QKV projection is head-aligned: each rank holds [q_r; k_r; v_r].
- Under sequence parallelism the parameters that see only a sequence shard (norms, row-parallel
  biases) have their gradients all-reduced after backward (Megatron's `_allreduce_layernorm_grads`,
  one call per tensor here where Megatron coalesces them).

Every collective goes through `DistCalls`, which counts it: the benchmark compares dtp's
communication with these counts — an independent reference, not dtp's own schedule. BASELINE_VERSION
names this implementation in every result it produces.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtp.compiler.placed import pack_parts
from dtp.layout.parts import equal_parts
from dtp.models.gpt import GPT, GPTConfig

BASELINE_VERSION = "megatron-style-2"


class DistCalls:
    """The baseline's only way to communicate: each call counted by op (and its buffer bytes), then
    made."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def _note(self, op: str, t: torch.Tensor) -> bool:
        """Count the call; False on a world of one, where Megatron communicates nothing."""
        if dist.get_world_size() == 1:
            return False
        self.counts[op] += 1
        self.bytes[op] += t.numel() * t.element_size()
        return True

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place."""
        if self._note("all_reduce", t):
            dist.all_reduce(t, op=op)
        return t

    def all_gather(self, part: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `part` along `dim`."""
        part = part.movedim(dim, 0).contiguous()
        out = part.new_empty((part.shape[0] * dist.get_world_size(), *part.shape[1:]))
        if not self._note("all_gather", out):
            return part.movedim(0, dim)
        dist.all_gather_into_tensor(out, part)
        return out.movedim(0, dim)

    def reduce_scatter(self, full: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over ranks, this rank's chunk of `dim`."""
        full = full.movedim(dim, 0).contiguous()
        out = full.new_empty((full.shape[0] // dist.get_world_size(), *full.shape[1:]))
        if not self._note("reduce_scatter", full):
            return full.movedim(0, dim)
        dist.reduce_scatter_tensor(out, full)
        return out.movedim(0, dim)


# Activations are (B, T, C): the sequence-parallel helpers split and gather dim 1 (Megatron's dim 0
# of its (T, B, C) layout).
class _F(torch.autograd.Function):
    """f: identity forward, all-reduce backward; sequence-parallel: all-gather forward,
    reduce-scatter back."""

    @staticmethod
    def forward(ctx, x, calls: DistCalls, sp: bool):
        ctx.calls, ctx.sp = calls, sp
        return calls.all_gather(x, 1) if sp else x

    @staticmethod
    def backward(ctx, grad):
        grad = (
            ctx.calls.reduce_scatter(grad, 1) if ctx.sp else ctx.calls.all_reduce(grad.contiguous())
        )
        return grad, None, None


class _G(torch.autograd.Function):
    """g: all-reduce forward, identity backward; sequence-parallel: reduce-scatter forward,
    all-gather back."""

    @staticmethod
    def forward(ctx, x, calls: DistCalls, sp: bool):
        ctx.calls, ctx.sp = calls, sp
        return calls.reduce_scatter(x, 1) if sp else calls.all_reduce(x.contiguous())

    @staticmethod
    def backward(ctx, grad):
        return (ctx.calls.all_gather(grad, 1) if ctx.sp else grad), None, None


class _Scatter(torch.autograd.Function):
    """Split the (replicated) sequence into this rank's chunk; all-gather the gradient back."""

    @staticmethod
    def forward(ctx, x, calls: DistCalls):
        ctx.calls = calls
        return x.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return ctx.calls.all_gather(grad, 1), None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits sharded on the vocabulary (N, V/tp); returns the mean loss."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, calls: DistCalls):
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        calls.all_reduce(local_max, op=dist.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        calls.all_reduce(sum_exp)
        local_target = target - vocab_start
        inside = (local_target >= 0) & (local_target < logits.shape[-1])
        picked = shifted.gather(
            -1, local_target.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
        ).squeeze(-1)
        picked = torch.where(inside, picked, torch.zeros_like(picked))
        calls.all_reduce(picked)
        loss = (sum_exp.log() - picked).mean()
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_target, inside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, inside = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)[inside]
        g[rows, local_target[inside]] -= 1.0
        return g * (grad / g.shape[0]), None, None, None


class MegatronGPT(nn.Module):
    """This rank's part of a GPT-2 under Megatron tensor parallelism (dropout 0), optionally with
    sequence parallelism; every collective is counted in `self.calls`."""

    def __init__(self, cfg: GPTConfig, rank: int, tp: int, sequence_parallel: bool = False):
        super().__init__()
        if cfg.n_head % tp or cfg.vocab_size % tp:
            raise ValueError("the Megatron baseline needs heads and vocabulary divisible by tp")
        self.cfg, self.rank, self.tp, self.sp = cfg, rank, tp, sequence_parallel
        self.calls = DistCalls()
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
        """Copy this rank's slices of an unsharded dtp GPT (the same weights the dtp run starts
        from)."""
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
            b.qkv.weight.copy_(
                rows(pack_parts(h.attn.c_attn.weight, equal_parts(3 * self.cfg.n_embd, 3), tp))
            )
            if self.cfg.bias:
                b.qkv.bias.copy_(
                    rows(pack_parts(h.attn.c_attn.bias, equal_parts(3 * self.cfg.n_embd, 3), tp))
                )
                b.proj_bias.copy_(h.attn.c_proj.bias)
                b.fc.bias.copy_(rows(h.mlp.c_fc.bias))
                b.fc2_bias.copy_(h.mlp.c_proj.bias)
            b.proj.weight.copy_(cols(h.attn.c_proj.weight))
            b.fc.weight.copy_(rows(h.mlp.c_fc.weight))
            b.fc2.weight.copy_(cols(h.mlp.c_proj.weight))
        self.ln_f.load_state_dict(t.ln_f.state_dict())

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return _F.apply(x, self.calls, self.sp)

    def _g(self, x: torch.Tensor) -> torch.Tensor:
        return _G.apply(x, self.calls, self.sp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Local logits (B, T, V/tp)."""
        B, T = ids.shape
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.wte.shape[0])
        x = F.embedding(local.clamp(0, self.wte.shape[0] - 1), self.wte) * inside.unsqueeze(-1)
        x = _G.apply(x, self.calls, False) + self.wpe[:T]
        if self.sp:
            x = _Scatter.apply(x, self.calls)  # (B, T/tp, C)
        for b in self.blocks:
            q, k, v = b.qkv(self._f(b.ln_1(x))).chunk(3, dim=-1)  # each (B, T, local width)
            # (B, nh, T, hs)
            q, k, v = (z.view(B, T, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
            y = (
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
                .transpose(1, 2)
                .reshape(B, T, -1)
            )
            y = self._g(b.proj(y))
            x = x + (y + b.proj_bias if b.proj_bias is not None else y)
            h = self._g(b.fc2(F.gelu(b.fc(self._f(b.ln_2(x))), approximate="tanh")))
            x = x + (h + b.fc2_bias if b.fc2_bias is not None else h)
        # the head shares the embedding's vocabulary slice
        return F.linear(self._f(self.ln_f(x)), self.wte)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel cross-entropy."""
        return _VocabParallelCrossEntropy.apply(
            logits.flatten(0, 1), targets.flatten(), self.vocab_start, self.calls
        )

    def sequence_parallel_params(self) -> list[nn.Parameter]:
        """Parameters that see only a sequence shard under SP: norms and row-parallel biases."""
        norms = [m for b in self.blocks for m in (b.ln_1, b.ln_2)] + [self.ln_f]
        out = [p for m in norms for p in m.parameters()]
        return out + [p for b in self.blocks for p in (b.proj_bias, b.fc2_bias) if p is not None]

    def finish_grads(self) -> None:
        """After backward: all-reduce the gradients of sequence-sharded parameters (nothing without
        SP)."""
        if self.sp:
            for p in self.sequence_parallel_params():
                self.calls.all_reduce(p.grad)


def flops_per_token(cfg: GPTConfig, seq: int) -> float:
    """Training FLOPs per token: 6 × parameters + attention (PaLM appendix B)."""
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    params = L * 12 * C * C + V * C
    return 6 * params + 12 * L * C * seq


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b|; infinite when either holds a non-finite value."""
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0
