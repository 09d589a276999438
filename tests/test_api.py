"""The Python API: parse, load, check, compile, apply importable from `dtp`."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import dtp
from dtp.compiler.megatron import MegatronColwise, MegatronRowwise
from dtp.compiler.styles import SharedInput
from dtp.compiler.vocab_parallel import VocabParallelEmbedding, VocabParallelHead
from dtp.models.gpt import GPT, GPTConfig
from dtp.runtime.ranks import on_ranks


def _compile_and_apply(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32, vocab_size=64, block_size=16))
    plan = dtp.load("plans/gpt2.tp")
    styles = dtp.compile(plan, model, mesh).styles
    applied = dtp.apply(plan, model, mesh)
    wte = model.transformer.wte.weight
    return {
        "styles": {k: type(v).__name__ for k, v in styles.items()},
        "layers": {k: type(model.get_submodule(k)).__name__ for k in styles},
        "tied": model.lm_head.weight is wte,
        "wte": (isinstance(wte, DTensor), wte.placements == (Shard(0),)),
        "local_c_attn": tuple(model.transformer.h[0].attn.c_attn.weight.to_local().shape),
        "full_c_attn": tuple(
            applied.full(
                "transformer.h.0.attn.c_attn.weight", model.transformer.h[0].attn.c_attn.weight
            ).shape
        ),
    }


def test_compile_picks_megatron_styles_and_apply_makes_the_layers_in_place(repo):
    """The compiled styles are what runs: each Megatron layout is a dtp ParallelStyle whose `_apply`
    made the module its layer (ColumnParallelLinear, ...), the class named in the table of
    dtp.compiler.compiler."""
    r0, r1 = on_ranks(_compile_and_apply, 2)
    assert r0 == r1
    assert r0["styles"] == {
        "transformer.wte": VocabParallelEmbedding.__name__,
        "transformer.h.0.attn.c_attn": MegatronColwise.__name__,
        "transformer.h.0.attn.c_proj": MegatronRowwise.__name__,
        "transformer.h.0.mlp.c_fc": MegatronColwise.__name__,
        "transformer.h.0.mlp.c_proj": MegatronRowwise.__name__,
        "lm_head": VocabParallelHead.__name__,
    }
    assert r0["layers"] == {
        "transformer.wte": "VocabParallelEmbedding",
        "transformer.h.0.attn.c_attn": "ColumnParallelLinear",
        "transformer.h.0.attn.c_proj": "RowParallelLinear",
        "transformer.h.0.mlp.c_fc": "ColumnParallelLinear",
        "transformer.h.0.mlp.c_proj": "RowParallelLinear",
        "lm_head": "VocabParallelLinear",
    }
    # c_attn is alone under attn: nothing to share
    assert SharedInput.__name__ not in r0["styles"].values()
    assert r0["tied"] and r0["wte"] == (True, True)
    assert r0["local_c_attn"] == (48, 32) and r0["full_c_attn"] == (96, 32)


def _user_training_loop(rank: int, world: int) -> dict:
    """A training loop as a user writes it around the library face: compile, apply, their own
    optimizer."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16)).double()
    reference = copy.deepcopy(model)
    applied = dtp.compile(dtp.load("plans/gpt2.tp"), model, mesh).apply(model, mesh)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    batches = torch.Generator().manual_seed(1)
    worst = {"loss": 0.0, "wte.grad": 0.0, "c_fc.weight": 0.0}
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 9), generator=batches)
        loss = applied.loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        ref_loss = F.cross_entropy(reference(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        ref_loss.backward()
        grad = applied.full("transformer.wte.weight", model.transformer.wte.weight.grad)
        worst["loss"] = max(worst["loss"], abs(loss.item() - ref_loss.item()))
        worst["wte.grad"] = max(
            worst["wte.grad"], (grad - reference.transformer.wte.weight.grad).abs().max().item()
        )
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    c_fc = applied.full("transformer.h.1.mlp.c_fc.weight", model.transformer.h[1].mlp.c_fc.weight)
    worst["c_fc.weight"] = (c_fc - reference.transformer.h[1].mlp.c_fc.weight).abs().max().item()
    return {"worst": worst, "tied": model.lm_head.weight is model.transformer.wte.weight}


def test_a_user_written_loop_through_compile_matches_the_unsharded_model(repo):
    """dtp.compile(...).apply(model, mesh) keeps GPT-2's embedding and head tied and its loss is the
    model's: float64 loss, the tied embedding's gradient and a trained weight within 1e-12 of the
    unsharded run's over 3 SGD steps (passing `.styles` to parallelize_module alone untied them: the
    embedding's gradient was off by 0.25)."""
    r0, r1 = on_ranks(_user_training_loop, 2)
    assert r0 == r1 and r0["tied"]
    assert all(v < 1e-12 for v in r0["worst"].values()), r0["worst"]
