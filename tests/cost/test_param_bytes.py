"""One per-rank bytes function (dtp.cost.param_bytes) for explain, apply, train and the fuzzer,
against the bytes ranks actually hold after the one build path (meta → shard → materialise), uneven
vocabulary included."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from dtp import models
from dtp.checks.checker import check
from dtp.cost.explain import explain
from dtp.cost.param_bytes import ideal_param_bytes, local_param_bytes, param_bytes_per_rank
from dtp.lang.parse import load
from dtp.runtime.build import build_sharded
from dtp.runtime.launcher import launch_local

ODD = "tests/fixtures/gpt-odd-vocab.yaml"  # 257 rows: rank 0 holds 129, rank 1 holds 128


def _held(rank, world, plan, spec, dp=1):
    source = models.resolve(spec)
    checked = check(load(plan), models.build(source, device="meta"), world // dp)
    mesh = (
        init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
        if dp > 1
        else init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    )
    applied = build_sharded(checked, source, mesh, seed=1, device=torch.device("cpu"), dp=dp)
    return local_param_bytes(applied.model)


def test_table_equals_what_ranks_hold_and_what_explain_prints(repo):
    meta = models.build(models.resolve(ODD), device="meta")
    checked = check(load("plans/gpt2.tp"), meta, 2)
    table = param_bytes_per_rank(checked, meta, 2)
    assert launch_local(_held, 2, "plans/gpt2.tp", ODD, timeout=120) == table
    assert table[0] - table[1] == 64 * 4  # one vocabulary row of n_embd floats more on rank 0
    unsharded = sum(p.numel() for p in meta.parameters()) * 4
    assert param_bytes_per_rank(checked, meta, 1) == [unsharded]
    ex = explain(checked, meta, ODD, 2)
    assert (ex.bytes_unsharded, ex.bytes_per_rank, ex.ideal_bytes_per_rank) == (
        unsharded,
        table[0],
        ideal_param_bytes(checked, meta, 2),
    )
    # ideal = replicated + sharded / 2, between the two
    assert table[1] < ex.ideal_bytes_per_rank < table[0]
    assert param_bytes_per_rank(checked, meta, 2, elem=2) == [b // 2 for b in table]


def test_fsdp2_shards_are_counted_padded(repo):
    # dp 2 × tp 2: tp rank 0's 129 vocabulary rows split 65 + 64 over dp; FSDP2 allocates both
    # padded to 65 rows (the table), while the second's local view holds 64 (measured): exactly one
    # row apart, there only.
    meta = models.build(models.resolve(ODD), device="meta")
    table = param_bytes_per_rank(check(load("plans/gpt2.tp"), meta, 2), meta, 2, dp=2)
    held = launch_local(_held, 4, "plans/gpt2.tp", ODD, 2, timeout=120)
    assert [t - h for t, h in zip(table, held)] == [0, 0, 64 * 4, 0]
