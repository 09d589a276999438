"""The one build path (meta → shard → materialise) on a model with buffers: Hugging Face Llama's
rotary frequencies (non-persistent, computed in __init__) stay real while parameters are drawn by
the keyed init, and the sharded model computes what an ordinary unsharded model with the same full
weights computes; rank 0's model scattered (`dtp apply`, `dtp train --init model`) is the seeded
model's own init on every rank."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

pytest.importorskip("transformers")

from dtp import models
from dtp.checks.checker import check
from dtp.cost.param_bytes import local_param_bytes, param_bytes_per_rank
from dtp.lang.parse import load
from dtp.runtime.build import build_on_meta, build_sharded
from dtp.runtime.launcher import launch_local

SPEC, PLAN = "dtp.models.hf:llama", "plans/hf/llama.tp"


def _sharded_llama(rank, world):
    source = models.resolve(SPEC)
    meta = models.build(source, device="meta")
    checked = check(load(PLAN), meta, world)
    applied = build_sharded(
        checked,
        source,
        init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)),
        seed=2,
        device=torch.device("cpu"),
    )
    full = {n: applied.full(n, p.detach()) for n, p in applied.model.named_parameters()}
    ids = torch.arange(24).reshape(2, 12) * 7 % models.vocab_size(meta)
    with torch.no_grad():
        logits = applied.model(ids).logits
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    buffers = {n: b.clone() for n, b in applied.model.named_buffers()}
    return (
        full,
        ids,
        logits,
        buffers,
        local_param_bytes(applied.model),
        param_bytes_per_rank(checked, meta, world),
    )


def test_hf_llama_with_rotary_buffers_builds_sharded_and_matches_an_unsharded_copy(repo):
    results = launch_local(_sharded_llama, 2, timeout=120)
    full, ids, logits, buffers, _, table = results[0]
    assert [r[4] for r in results] == table  # each rank holds exactly its placement-table bytes
    # buffers by __init__
    plain = models.build(models.resolve(SPEC), device="cpu", dtype=torch.float32)
    assert (
        set(buffers) == {n for n, _ in plain.named_buffers()}
        and "model.rotary_emb.inv_freq" in buffers
    )
    for name, b in plain.named_buffers():
        assert torch.equal(buffers[name], b), name
    assert not any(p.is_meta for p in build_on_meta(models.resolve(SPEC)).buffers())
    # the unsharded reference, same weights
    missing, unexpected = plain.load_state_dict(full, strict=False)
    assert unexpected == [] and all(k in buffers for k in missing)
    with torch.no_grad():
        expected = plain(ids).logits
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    # not a degenerate (zero) init
    assert logits.std() > 0.01 and full["lm_head.weight"].std() > 0.01


def test_allocating_storage_keeps_tied_weights_tied():
    # to_empty gives each owner of a plain (unsharded) tied parameter its own storage; the build
    # path ties them again, or an empty plan would train gpt2's lm_head apart from its embedding
    from dtp.runtime.build import allocate

    model = build_on_meta(models.resolve("gpt2-tiny"))
    assert model.lm_head.weight is model.transformer.wte.weight
    allocate(model, torch.device("cpu"))
    assert model.lm_head.weight is model.transformer.wte.weight and not model.lm_head.weight.is_meta


MID = "tests/fixtures/gpt-train-mid.yaml"  # 4 layers, n_embd 512, vocab 16384: 21 M parameters


def _resident() -> int:
    import ctypes

    # freed transients (the scatter's receive buffer) go back first
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _scattered_from_rank0(rank, world):
    import torch.distributed as dist

    def build(spec):
        source = models.resolve(spec)
        meta = models.build(source, device="meta")
        checked = check(load("plans/gpt2.tp"), meta, world)
        full = models.build(source, device="cpu") if rank == 0 else None
        applied = build_sharded(
            checked,
            source,
            init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)),
            seed=0,
            device=torch.device("cpu"),
            full=full,
            from_rank0=True,
        )
        return applied, full, param_bytes_per_rank(checked, meta, world)[rank]

    build("gpt2-tiny")  # loads code and caches; not counted
    dist.barrier()
    before = _resident()
    applied, full, table = build(MID)
    grown = _resident() - before
    gathered = {n: applied.full(n, p.detach()) for n, p in applied.model.named_parameters()}
    exact = rank != 0 or (
        set(gathered) == {n for n, _ in full.named_parameters()}
        and all(torch.equal(gathered[n], p) for n, p in full.named_parameters())
    )
    return grown, table, local_param_bytes(applied.model), exact


def test_apply_build_scatters_rank0_model_and_other_ranks_hold_only_their_shards(repo):
    (grown0, table0, local0, exact), (grown1, table1, local1, _) = launch_local(
        _scattered_from_rank0, 2, timeout=180
    )
    # every parameter gathered back equals rank 0's model, bit for bit (packed QKV, tied wte)
    assert exact
    assert (local0, local1) == (table0, table1)
    # rank 1 never held the 84 MB model
    assert abs(grown1 - table1) <= 0.1 * table1, (grown1, table1)
    assert grown0 > table0 + 0.9 * 4 * 21_000_000  # rank 0 holds the whole model besides its shards


def _from_model(rank, world):
    from dtp.runtime.build import build_from_model

    source = models.resolve("gpt2-tiny")
    checked = check(load("plans/gpt2.tp"), models.build(source, device="meta"), world)
    applied = build_from_model(
        checked,
        source,
        init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)),
        seed=4,
        device=torch.device("cpu"),
    )
    return {
        n: applied.full(n, p.detach()) for n, p in applied.model.named_parameters()
    }, torch.get_rng_state()


def test_build_from_model_is_the_seeded_models_own_init_and_every_rank_continues_rank0s_stream(
    repo,
):
    (full, state0), (_, state1) = launch_local(_from_model, 2, timeout=120)
    torch.manual_seed(4)
    plain = models.build(models.resolve("gpt2-tiny"), device="cpu", dtype=torch.float32)
    assert full.keys() == dict(plain.named_parameters()).keys()
    assert all(torch.equal(full[n], p) for n, p in plain.named_parameters())
    # where rank 0's generator stands after drawing the model: every rank shares it (replicated
    # dropout masks)
    assert torch.equal(state0, torch.get_rng_state()) and torch.equal(state1, state0)


def _leaves_after_a_step(rank, world, tp):
    from dtp.compiler.vocab_parallel import cross_entropy
    from dtp.runtime.mesh import make_mesh

    source = models.resolve("gpt2-tiny")
    checked = check(load("plans/gpt2.tp"), models.build(source, device="meta"), tp)
    applied = build_sharded(
        checked,
        source,
        make_mesh(tp, world // tp),
        seed=0,
        device=torch.device("cpu"),
        dp=world // tp,
    )
    ids = torch.arange(32).reshape(2, 16) % 64
    cross_entropy(applied.model(ids[:, :-1]), ids[:, 1:]).backward()
    layer = applied.model.get_submodule("transformer.h.0.mlp.c_fc")
    leaves = layer._tp.leaves
    return type(layer).__name__, leaves is not None, 0 if leaves is None else len(leaves._entries)


def test_megatron_layers_make_leaves_except_under_fsdp2(repo):
    """Without data parallelism the Megatron layers compute on parameter leaves; under FSDP2, which
    swaps its own parameters in around each forward, they make none and read DTensor's to_local()."""
    name, leaves, made = launch_local(_leaves_after_a_step, 2, 2, timeout=120)[0]
    assert name == "ColumnParallelLinear" and leaves
    assert made == 17  # gpt2-tiny: 2 blocks × 4 Linears × (weight, bias), and the tied wte/lm_head
    assert launch_local(_leaves_after_a_step, 4, 2, timeout=120)[0] == (
        "ColumnParallelLinear",
        False,
        0,
    )
