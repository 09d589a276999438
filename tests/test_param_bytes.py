"""One per-rank bytes function (dtp.param_bytes) for explain, apply, train and the fuzzer, against the bytes
ranks actually hold after the one build path (meta → shard → materialise), uneven vocabulary included."""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from dtp import models
from dtp.check import check
from dtp.explain import explain
from dtp.launcher import launch_local
from dtp.param_bytes import ideal_param_bytes, local_param_bytes, param_bytes_per_rank
from dtp.syntax import load
from dtp.train.init import build_sharded

ODD = "tests/fixtures/gpt-odd-vocab.yaml"  # 257 rows: rank 0 holds 129, rank 1 holds 128


def _held(rank, world, plan, spec):
    source = models.resolve(spec)
    checked = check(load(plan), models.build(source, device="meta"), world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    applied = build_sharded(checked, source, mesh, seed=1, device=torch.device("cpu"))
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
        unsharded, table[0], ideal_param_bytes(checked, meta, 2))
    assert table[1] < ex.ideal_bytes_per_rank < table[0]  # ideal = replicated + sharded / 2, between the two
    assert param_bytes_per_rank(checked, meta, 2, elem=2) == [b // 2 for b in table]
