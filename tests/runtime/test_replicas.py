"""Replica consistency (dtp.runtime.replicas): a replicated tensor that differs on one rank is
named, with the size of the difference, on every rank; sharded parameters are not compared; equal
replicas give nothing."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from dtp.lang.parse import load
from dtp.models.gpt import GPT, GPTConfig
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
