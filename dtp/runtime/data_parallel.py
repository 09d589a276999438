"""Model + data parallelism over the mesh's dp dimension, on top of the tp plan: FSDP2
(`fully_shard`: parameters, gradients and optimizer state sharded over dp) or DDP (torch's
`replicate`, built on FSDP2's parameter groups: everything replicated, gradients all-reduced).

The paper's largest runs were 8-way model × 64-way data parallel, under DDP. Here each block of the
model's top-level ModuleLists is one unit (FSDP2's gathers, DDP's gradient bucket) and the model
itself is the root unit.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import fully_shard

try:  # DDP on FSDP2's parameter groups, which composes with tp DTensors as fully_shard does
    from torch.distributed._composable.replicate_with_fsdp import replicate
except ImportError:  # an older torch: `--dp-mode ddp` is refused before any rank starts
    replicate = None

from dtp.cost.fsdp import units


def ddp_available() -> bool:
    """Whether this torch has `replicate` (DDP over FSDP2's parameter groups)."""
    return replicate is not None


def data_parallel(model: nn.Module, dp_mesh, mode: str = "fsdp") -> None:
    """Make `model` (already tensor-parallel) data-parallel over `dp_mesh`: `fsdp` shards it with
    FSDP2, `ddp` replicates it."""
    wrap = fully_shard if mode == "fsdp" else replicate
    for path in units(model):
        wrap(model.get_submodule(path), mesh=dp_mesh)
    wrap(model, mesh=dp_mesh)
