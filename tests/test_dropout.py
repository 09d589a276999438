"""Dropout under tensor parallelism: identical masks where activations are replicated, different masks
where they are sharded (Megatron's RNG tracker). Parity runs keep dropout at 0: masks are random."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from dtp.shard import apply
from dtp.models.gpt import GPT, GPTConfig
from dtp.syntax import load
from dtp.ranks import on_ranks


def _masks(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=4, n_embd=64, vocab_size=256, block_size=64, dropout=0.5)
    model = GPT(cfg)
    # a probe in the sharded region: dropout on c_fc's column-sharded output, before GELU
    mlp = model.transformer.h[0].mlp
    mlp.gelu = nn.Sequential(nn.Dropout(0.5), mlp.gelu)
    seen: dict[str, torch.Tensor] = {}
    for name, module in [("sharded", mlp.gelu[0]), ("replicated", mlp.dropout),
                         ("replicated_attn", model.transformer.h[0].attn.resid_dropout)]:
        module.register_forward_hook(lambda m, a, o, n=name: seen.__setitem__(n, (o == 0).clone()))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    apply(load("plans/gpt2.tp"), model, mesh, seed=0)
    model.train()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids)
    model(ids)  # the second step too: both generators advance
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in seen.items()}


def test_replicated_masks_agree_sharded_masks_differ(repo):
    r0, r1 = on_ranks(_masks, 2)
    assert torch.equal(r0["replicated"], r1["replicated"])
    assert torch.equal(r0["replicated_attn"], r1["replicated_attn"])
    assert r0["sharded"].shape == r1["sharded"].shape == (2, 16, 128)  # each rank's half of the 256 features
    assert not torch.equal(r0["sharded"], r1["sharded"])
    for masks in (r0, r1):  # and they are real dropout masks at p=0.5
        frac = masks["sharded"].float().mean().item()
        assert 0.4 < frac < 0.6, frac
