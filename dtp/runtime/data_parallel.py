"""Model + data parallelism: FSDP2 (`fully_shard`) over the mesh's dp dimension, on top of the tp
plan.

The paper's largest runs were 8-way model × 64-way data parallel. Here each block of the model's
top-level ModuleLists is one FSDP unit and the model itself is the root unit.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from dtp.cost.fsdp import units


def data_parallel(model: nn.Module, dp_mesh) -> None:
    """Shard `model` (already tensor-parallel) with FSDP2 over `dp_mesh`."""
    for path in units(model):
        fully_shard(model.get_submodule(path), mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
