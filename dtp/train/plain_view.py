"""A plain one-rank model seen by the checkpoint as its tp-1 DTensors, so checkpoints reshard across
tp.

At tp 1 dp 1 `dtp train` runs the model as plain PyTorch (dtp.runtime.shard.apply's `plain`).
Checkpoints store a `colwise(packed=K)` tensor in the canonical (K, out/K, …) form, which
dtp.checkpoint.canonical reads off a Shard(0) DTensor; every other tensor is stored whole at tp 1
either way. So for a save or a load the packed parameters (and their AdamW moments) are presented as
Shard(0) DTensors on the one-rank mesh that share the plain tensors' storage — what
parallelize_module would have made of them — and put back afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from dtp.checkpoint.canonical import packed_parts
from dtp.compiler.compiler import tp_mesh
from dtp.lang import ir
from dtp.layout.modules import is_conv1d


def _wrap(t: torch.Tensor, mesh: DeviceMesh, dim: int = 0) -> DTensor:
    # a view: same storage, no copy
    return DTensor.from_local(t, mesh, [Shard(dim)], run_check=False)


@contextlib.contextmanager
def as_dtensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, plan: ir.Plan
) -> Iterator[None]:
    """Within the block, `model`'s packed parameters and their optimizer state are one-rank Shard(0)
    DTensors."""
    names = packed_parts(plan, model)
    olds = {id(p): p for n, p in model.named_parameters() if n in names}
    if not olds:
        yield
        return
    mesh = tp_mesh(mesh)
    owners = [
        (m, k, id(p))
        for m in model.modules()
        for k, p in m._parameters.items()
        if p is not None and id(p) in olds
    ]
    # the packed dim, as colwise shards it: a Conv1D weight (in, out) packs its columns
    dims = {i: 1 if is_conv1d(m) and k == "weight" else 0 for m, k, i in owners}
    news = {
        i: nn.Parameter(_wrap(p.detach(), mesh, dims[i]), requires_grad=p.requires_grad)
        for i, p in olds.items()
    }
    for module, key, i in owners:  # every owner: a tied packed weight stays one parameter
        module._parameters[key] = news[i]
    for group in optimizer.param_groups:
        group["params"] = [news.get(id(p), p) for p in group["params"]]
    for i, p in olds.items():
        if p in optimizer.state:
            state = optimizer.state.pop(p)
            optimizer.state[news[i]] = {
                k: _wrap(v, mesh, dims[i])
                if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim()
                else v
                for k, v in state.items()
            }
    try:
        yield
    finally:
        back = {id(n): olds[i] for i, n in news.items()}
        for module, key, i in owners:
            module._parameters[key] = olds[i]
        for group in optimizer.param_groups:
            group["params"] = [back.get(id(p), p) for p in group["params"]]
        for i, new in news.items():
            # a load may have created the state: its DTensors' storage is kept
            if new in optimizer.state:
                state = optimizer.state.pop(new)
                optimizer.state[olds[i]] = {
                    k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()
                }
