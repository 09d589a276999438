"""The two ParallelStyles torch does not have: packed colwise and per-rank attribute rewrites."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle


def pack_rows(t: torch.Tensor, parts: int, tp: int) -> torch.Tensor:
    """Reorder dim 0 so that Shard(0) chunk r is [part_0 chunk r; part_1 chunk r; …] (Megatron's QKV layout)."""
    rest = t.shape[1:]
    return t.reshape(parts, tp, t.shape[0] // (parts * tp), *rest).transpose(0, 1).reshape(t.shape)


def unpack_rows(t: torch.Tensor, parts: int, tp: int) -> torch.Tensor:
    """Inverse of `pack_rows`: the gathered packed tensor back in the model's own row order."""
    rest = t.shape[1:]
    return t.reshape(tp, parts, t.shape[0] // (parts * tp), *rest).transpose(0, 1).reshape(t.shape)


class PackedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a Linear whose output features are `parts` equal packed parts (fused q/k/v,
    gate/up): each part is sharded separately, so every rank holds whole heads of every part and the
    module's own `chunk(parts, -1)` on the local output yields that rank's slice of each part.

    The DTensor holds the rows in packed order; `unpack_rows` restores the model's order when gathering.
    """

    def __init__(self, parts: int, **kwargs):
        super().__init__(**kwargs)
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        tp = device_mesh.size()
        for pname, param in module.named_parameters(recurse=False):
            packed = pack_rows(param.detach(), self.parts, tp)
            dist = nn.Parameter(distribute_tensor(packed, device_mesh, [Shard(0)], src_data_rank=getattr(self, "src_data_rank", 0)),
                                requires_grad=param.requires_grad)
            module.register_parameter(pname, dist)

    def __repr__(self) -> str:
        return f"PackedColwiseParallel(parts={self.parts}, {super().__repr__()})"


class SetAttributes(ParallelStyle):
    """Rewrite integer attributes of a module on every rank (e.g. its head count to n_heads / tp)."""

    def __init__(self, values: dict[str, int]):
        super().__init__()
        self.values = dict(values)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for attr, value in self.values.items():
            setattr(module, attr, value)
        return module

    def __repr__(self) -> str:
        return f"SetAttributes({self.values})"
