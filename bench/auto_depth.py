"""`python bench/auto_depth.py [--layer-idx] [BLOCKS ...]` (a lab script, not part of the
package): how long `dtp plan --auto` takes, and how much memory, on a model of many tiny Llama-style blocks (q, k, v,
o and a SwiGLU MLP, width 32, built on the meta device), the whole command's work: reading the
modules, tracing the forward, and `dtp check` at tp 1, 2 and 4. Each depth runs in a fresh process
(its peak resident memory is its own), with the 1-minute load average before it. `--layer-idx` gives
each block the index transformers and torchtitan keep on it (no forward here reads it). Its report:
bench/results/plan-auto-depth_cpu-2core_2026-12-07_dtp.md."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, HEADS, HIDDEN, VOCAB = 32, 4, 64, 128


class Attention(nn.Module):
    """q, k, v read through a generator (no pair in the source: the forward is traced)."""

    def __init__(self):
        super().__init__()
        self.n_head, self.head_dim = HEADS, WIDTH // HEADS
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Causal attention over 4 heads."""
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU."""

    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.up_proj = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x))."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """A pre-norm block."""

    def __init__(self):
        super().__init__()
        self.input_norm, self.post_norm = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + attn(norm(x)), then + mlp(norm(x))."""
        x = x + self.attn(self.input_norm(x))
        return x + self.mlp(self.post_norm(x))


class Deep(nn.Module):
    """An embedding, `n_blocks` blocks, a norm and a head."""

    def __init__(self, n_blocks: int):
        super().__init__()
        self.config = {"vocab_size": VOCAB, "num_attention_heads": HEADS, "hidden_size": WIDTH}
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Every position's logits."""
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def one(n_blocks: int, layer_idx: bool) -> None:
    """Plan one depth in this process; print seconds, peak RSS and the plan's summary."""
    from dtp.auto.planner import auto_plan

    with torch.device("meta"):
        model = Deep(n_blocks)
    for i, block in enumerate(model.layers if layer_idx else ()):
        block.layer_idx = i  # as transformers and torchtitan keep one (no forward here reads it)
    start = time.perf_counter()
    found = auto_plan(model, f"deep-{n_blocks}", 2)
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"| {n_blocks:,} | {seconds:.1f} | {1000 * seconds / n_blocks:.1f} | {rss:.2f} | "
        f"{found.summary.split(';')[0]} |",
        flush=True,
    )


def main(depths: list[int], layer_idx: bool = False) -> None:
    """Print the report's table: one row per depth, each planned in a fresh process."""
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    print("| blocks | seconds | ms per block | peak RSS GiB | plan | load before |")
    print("|---:|---:|---:|---:|---|---:|")
    for n in depths:
        load = os.getloadavg()[0]
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(n), *(["--layer-idx"] if layer_idx else [])],
            capture_output=True,
            text=True,
            check=True,
        )
        print(out.stdout.strip() + f" {load:.2f} |", flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--layer-idx"]
    stamped = "--layer-idx" in sys.argv[1:]
    if args[:1] == ["--one"]:
        one(int(args[1]), stamped)
    else:
        main([int(a) for a in args] or [200, 2000, 20000], stamped)
