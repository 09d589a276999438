"""The Python API: parse, load, check, compile, apply importable from `dtp`."""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

import dtp
from dtp.compiler.placed import (
    PlacedColwise,
    PlacedRowwise,  # RowwiseParallel whose local output may be updated in place
    VocabParallelEmbedding,  # RowwiseParallel on an embedding, the same
)
from dtp.compiler.styles import SharedInput
from dtp.models.gpt import GPT, GPTConfig
from dtp.runtime.ranks import on_ranks


def _compile_and_apply(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32, vocab_size=64, block_size=16))
    plan = dtp.load("plans/gpt2.tp")
    styles = dtp.compile(plan, model, mesh)
    applied = dtp.apply(plan, model, mesh)
    wte = model.transformer.wte.weight
    return {"styles": {k: type(v).__name__ for k, v in styles.items()},
            "tied": model.lm_head.weight is wte, "wte": (isinstance(wte, DTensor), wte.placements == (Shard(0),)),
            "local_c_attn": tuple(model.transformer.h[0].attn.c_attn.weight.to_local().shape),
            "full_c_attn": tuple(applied.full("transformer.h.0.attn.c_attn.weight",
                                              model.transformer.h[0].attn.c_attn.weight).shape)}


def test_compile_uses_torch_styles_and_apply_shards_in_place(repo):
    r0, r1 = on_ranks(_compile_and_apply, 2)
    assert r0 == r1
    assert r0["styles"] == {
        "transformer.wte": VocabParallelEmbedding.__name__, "transformer.h.0.attn.c_attn": PlacedColwise.__name__,
        "transformer.h.0.attn.c_proj": PlacedRowwise.__name__, "transformer.h.0.mlp.c_fc": ColwiseParallel.__name__,
        "transformer.h.0.mlp.c_proj": PlacedRowwise.__name__, "lm_head": ColwiseParallel.__name__}
    assert SharedInput.__name__ not in r0["styles"].values()  # c_attn is alone under attn: nothing to share
    assert r0["tied"] and r0["wte"] == (True, True)
    assert r0["local_c_attn"] == (48, 32) and r0["full_c_attn"] == (96, 32)
