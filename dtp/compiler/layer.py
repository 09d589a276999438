"""How a dtp ParallelStyle makes a module its tensor-parallel layer: the module's class becomes a
subclass whose forward is the layer's, as FSDP2's `fully_shard` turns an nn.Linear into an
`FSDPLinear`.

The style's `_apply` is the one step: nothing torch installed is undone afterwards, and the forward
is the class's (`ColumnParallelLinear.forward`), so a deep copy of the model (an EMA copy) computes
with its own parameters. What the layer communicates over is one attribute, `_tp`, that copies
share.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import ProcessGroup

from dtp.compiler.local_params import LocalParams, local_tensors


@dataclass(frozen=True, eq=False)
class TensorParallelGroup:
    """A layer's tensor-parallel group, and the model's parameter leaves (None: DTensor's
    `to_local()`, for a model that FSDP2 shards next)."""

    mesh: DeviceMesh  # 1-D
    group: ProcessGroup
    rank: int
    size: int
    leaves: LocalParams | None

    @classmethod
    def of(cls, mesh: DeviceMesh, leaves: LocalParams | None) -> TensorParallelGroup:
        """The group of a 1-D `mesh` (looked up once: a mesh's groups are fixed when it is made)."""
        return cls(mesh, mesh.get_group(0), mesh.get_local_rank(), mesh.size(), leaves)

    def params(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """`module`'s own parameters as this rank's local tensors, their gradients reaching the
        DTensors."""
        if self.leaves is not None:
            return self.leaves.of(module)
        return local_tensors(module)

    def __deepcopy__(self, memo: dict) -> TensorParallelGroup:
        # a copy of the model communicates over the same group (process groups are not copied)
        return self


@functools.cache
def layer_class(layer: type, base: type) -> type:
    """The class `layer` + `base` (ColumnParallel + Linear → ColumnParallelLinear; a layer's
    `prefix` replaces its name there): `layer`'s forward, `base`'s everything else. One per pair, so
    modules of one kind share a class (and torch.compile's guards on it)."""
    name = getattr(layer, "prefix", layer.__name__) + base.__name__
    return type(name, (layer, base), {"__module__": layer.__module__})


def become(module: nn.Module, layer: type, tp: TensorParallelGroup) -> nn.Module:
    """Make `module` a `layer` over `tp` in place."""
    if not isinstance(module, layer):
        module.__class__ = layer_class(layer, type(module))
    module._tp = tp
    return module
