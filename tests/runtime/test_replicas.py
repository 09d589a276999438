"""Replica consistency (dtp.runtime.replicas): a replicated tensor that differs on one rank is
named, with the size of the difference, on every rank; sharded parameters are not compared; equal
replicas give nothing."""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from dtp.checks.checker import check
from dtp.lang.parse import load
from dtp.models.gpt import GPT, GPTConfig
from dtp.runtime.build import build_on_meta, build_sharded
from dtp.runtime.ranks import on_ranks
from dtp.runtime.replicas import check_replicas, fingerprint, replicated_tensors
from dtp.runtime.shard import apply


def _diverge(rank: int, world: int, nudge: dict) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=16, vocab_size=32, block_size=8))
    model.register_buffer("running", torch.ones(3))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    apply(load("plans/gpt2.tp"), model, mesh, seed=0)
    names = [n for _, n, _ in replicated_tensors(model)]
    with torch.no_grad():
        for name, (on_rank, by) in nudge.items():
            if rank == on_rank:
                t = dict(model.named_parameters()).get(name, dict(model.named_buffers()).get(name))
                (t.to_local() if hasattr(t, "to_local") else t).view(-1)[1] += by
    found = check_replicas(model, mesh.get_group())
    return {"names": names, "found": [(d.kind, d.name, d.max_abs, d.ranks) for d in found]}


def test_equal_replicas_pass_and_only_replicated_tensors_are_compared():
    r0, r1 = on_ranks(_diverge, 2, {})
    assert r0 == r1
    assert r0["found"] == []
    assert "transformer.h.0.ln_1.weight" in r0["names"] and "running" in r0["names"]
    assert "transformer.h.0.attn.c_attn.weight" not in r0["names"]  # colwise: one owner per element


def test_a_drifted_parameter_and_buffer_are_named_on_every_rank():
    nudge = {"transformer.h.0.ln_1.weight": (1, 0.25), "running": (0, 1e-6)}
    r0, r1 = on_ranks(_diverge, 2, nudge)
    assert r0["found"] == r1["found"]
    found = {name: (kind, max_abs, ranks) for kind, name, max_abs, ranks in r0["found"]}
    assert set(found) == {"transformer.h.0.ln_1.weight", "running"}
    assert found["transformer.h.0.ln_1.weight"][0] == "parameter"
    assert abs(found["transformer.h.0.ln_1.weight"][1] - 0.25) < 1e-6
    assert found["transformer.h.0.ln_1.weight"][2] == (1,)
    # rank 0's copy is the yardstick: rank 1 is the one that differs
    assert found["running"][2] == (1,)


def test_fingerprint_sees_one_bit_and_a_swap():
    a = torch.randn(100)
    b, c = a.clone(), a.clone()
    b.view(torch.int32)[7] ^= 1
    c[[3, 4]] = c[[4, 3]]
    assert not torch.equal(fingerprint(a), fingerprint(b))
    assert not torch.equal(fingerprint(a), fingerprint(c))
    assert torch.equal(fingerprint(a), fingerprint(a.clone()))


def _names_under_fsdp(rank: int, world: int) -> list[str]:
    from dtp import models
    from dtp.checks.checker import checked_for
    from dtp.runtime.build import build_sharded
    from dtp.runtime.mesh import make_mesh

    source = models.resolve("gpt2-tiny")
    checked = checked_for(load("plans/gpt2.tp"), models.build(source, device="meta"), 2)
    applied = build_sharded(
        checked, source, make_mesh(2, 2), seed=0, device=torch.device("cpu"), dp=2
    )
    return [n for _, n, _ in replicated_tensors(applied.model)]


def test_fsdp_over_dp_keeps_tp_replicas_in_the_check():
    # FSDP2 puts a parameter tp left whole on the dp mesh alone: every tp rank still holds the same
    # dp shard
    names = on_ranks(_names_under_fsdp, 4)[0]
    assert "transformer.wpe.weight" in names and "transformer.h.1.ln_2.bias" in names
    assert "transformer.h.0.attn.c_attn.weight" not in names
    assert len(names) == 15  # wpe, 10 norm weights and biases, 4 rowwise biases: as at dp 1


def _with_rank_buffers() -> GPT:
    """A GPT that draws an integer permutation and a boolean mask in __init__ from its own rank's
    stream, as a model seeded per process would: every rank's draw differs."""
    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=16, vocab_size=32, block_size=8))
    draw = torch.Generator().manual_seed(100 + int(os.environ.get("RANK", "0")))
    model.register_buffer("perm", torch.randperm(16, generator=draw))
    model.register_buffer("mask", torch.rand(16, generator=draw) > 0.5)
    return model


def _built_buffers(rank: int, world: int, from_rank0: bool, nudge: bool) -> dict:
    checked = check(load("plans/gpt2.tp"), build_on_meta(_with_rank_buffers, None), world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    full = _with_rank_buffers() if from_rank0 and rank == 0 else None
    kw = dict(seed=0, device=torch.device("cpu"), full=full, from_rank0=from_rank0)
    model = build_sharded(checked, _with_rank_buffers, mesh, **kw).model
    names = [n for _, n, _ in replicated_tensors(model)]
    if nudge and rank == 1:
        model.perm[0] += 1
        model.mask[0] = ~model.mask[0]
    found = check_replicas(model, mesh.get_group())
    return {
        "perm": model.perm.tolist(),
        "mask": model.mask.tolist(),
        "names": names,
        "found": sorted((d.kind, d.name, d.ranks) for d in found),
    }


@pytest.mark.parametrize("from_rank0", [True, False])
def test_integer_and_boolean_buffers_are_rank0s_after_the_build(from_rank0):
    r0, r1 = on_ranks(_built_buffers, 2, from_rank0, False)
    assert (r1["perm"], r1["mask"]) == (r0["perm"], r0["mask"])
    os.environ["RANK"] = "0"  # rank 0's own draw is what every rank holds
    try:
        rank0 = _with_rank_buffers()
    finally:
        del os.environ["RANK"]
    assert r0["perm"] == rank0.perm.tolist() and r0["mask"] == rank0.mask.tolist()
    assert {"perm", "mask"} <= set(r0["names"]) and r0["found"] == []


def test_a_drifted_integer_or_boolean_buffer_is_named():
    r0, r1 = on_ranks(_built_buffers, 2, True, True)
    assert r0["found"] == r1["found"] == [("buffer", "mask", (1,)), ("buffer", "perm", (1,))]
