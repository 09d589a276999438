"""A tiny language model whose own initialisation is everything GPT-2's keyed init is not (`dtp
train --init`): Gemma's norm x · (1 + w) with w = 0, per-head attention sinks drawn in __init__, a
zero-initialised residual gate and a learnt residual scale (1-D; 0-D in `scalar()`). `PLAN` shards
it Megatron's way; MODEL is `tests.train.planted_init:model`. `drifting()` under `DRIFT_PLAN` is a
plan `dtp check` accepts whose replicas drift apart in training.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, LAYERS = 256, 32, 4, 2

PLAN = """dtp 1
embed: vocab_parallel
blocks.* {
    attn: slice_params(name=sinks)
    attn.q_proj: colwise
    attn.k_proj: colwise
    attn.v_proj: colwise
    attn.o_proj: rowwise
    mlp.up: colwise
    mlp.down: rowwise
}
head: vocab_parallel
"""
# `drifting()` under this plan: plain `replicate` says q_gain reads full activations, but it scales
# this rank's heads
DRIFT_PLAN = PLAN.replace("attn: slice_params(name=sinks)", "attn: replicate")


class OnePlusNorm(nn.Module):
    """Gemma's RMSNorm: x · (1 + w), w zero at init (unit scale)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)


class Attention(nn.Module):
    """Causal attention with a learnt sink logit per head (GPT-OSS), or (`gain`) a learnt
    per-channel gain on every query head instead; the local head count from the tensor."""

    def __init__(self, gain: bool = False):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(DIM, DIM, bias=False) for _ in range(4)
        )
        self.num_heads, self.head_dim = HEADS, DIM // HEADS
        if gain:
            self.q_gain = nn.Parameter(torch.ones(self.head_dim))
        else:
            self.sinks = nn.Parameter(torch.randn(HEADS) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, -1, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        # on this rank's heads only: under plain `replicate`, a partial gradient
        if hasattr(self, "q_gain"):
            q = q * self.q_gain
            out = F.scaled_dot_product_attention(
                *(a.transpose(1, 2) for a in (q, k, v)), is_causal=True
            )
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        q, k, v = (a.transpose(1, 2) for a in (q, k, v))  # (B, h, T, hd)
        scores = q @ k.transpose(-1, -2) / self.head_dim**0.5
        scores = scores.masked_fill(
            torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf")
        )
        sink = self.sinks.view(1, -1, 1, 1).expand(b, -1, t, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        return self.o_proj((probs @ v).transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, gain: bool = False, scalar: bool = False):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = (
            OnePlusNorm(DIM),
            Attention(gain),
            OnePlusNorm(DIM),
            MLP(),
        )
        # the MLP branch starts switched off (ReZero-style)
        self.gate = nn.Parameter(torch.zeros(1))
        # on the attention branch
        self.scale = nn.Parameter(torch.tensor(0.5) if scalar else torch.full((1,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.scale * self.attn(self.norm1(x))
        return x + self.gate * self.mlp(self.norm2(x))


class PlantedLM(nn.Module):
    def __init__(self, gain: bool = False, scalar: bool = False):
        super().__init__()
        self.config = SimpleNamespace(
            vocab_size=VOCAB, hidden_size=DIM, num_attention_heads=HEADS, num_hidden_layers=LAYERS
        )
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(gain, scalar) for _ in range(LAYERS))
        self.norm = OnePlusNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def model() -> nn.Module:
    """The planted model (its own init: torch's default generator)."""
    return PlantedLM()


def drifting() -> nn.Module:
    """The planted model with a per-channel query gain in place of the sinks (train it under
    DRIFT_PLAN)."""
    return PlantedLM(gain=True)


def scalar() -> nn.Module:
    """The planted model with a 0-D residual scale (FSDP2, --dp > 1, cannot shard it)."""
    return PlantedLM(scalar=True)
