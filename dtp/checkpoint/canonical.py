"""The tp-independent form in which checkpoints store sharded tensors.

DCP reshards by matching chunks at global offsets, which is right only if the global tensor means
the same thing at every tp. Three things in a dtp model are not: a `colwise(packed=K)` weight holds
its rows in a tp-dependent order (dtp.compiler.placed.pack_parts), FSDP2 shards the tp-local tensor
again over dp, and plain replicated tensors live on every rank. `view` turns each parameter or
optimizer-state tensor into a DTensor on the tp mesh holding the model's own element order:

- packed K: rank r's local rows are [part_0 chunk r; …; part_K-1 chunk r], so they are exactly chunk
  r of the canonical (K, out/K, …) tensor sharded on dim 1 — a view, no copy, no `_StridedShard` (a
  Conv1D weight, (in, out), packs its columns: (in, K, out/K) sharded on dim 2);
- FSDP2 (a mesh with a dp dimension): the dp shards are gathered into the tp-local tensor first and
  cut back (torch.chunk over dp, as FSDP2 cuts them) after a load;
- vocabularies that do not divide tp keep torch.chunk's uneven layout, which DCP describes exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

try:  # FSDP2's placement over dp for a tp-sharded dim; not a Shard subclass in torch 2.13
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = Shard

from dtp.lang import ir
from dtp.lang.vocabulary import packed
from dtp.layout.modules import is_conv1d
from dtp.layout.resolve import resolve
from dtp.layout.styles import Style


def packed_parts(plan: ir.Plan, model: nn.Module) -> dict[str, int]:
    """Parameter name → K for every parameter of a `colwise(packed=K)` module (K > 1) under this
    plan."""
    res = resolve(plan, model)
    out: dict[str, int] = {}
    for path, rule in res.claims.items():
        parts = packed(rule.style)
        if rule.style.name == Style.COLWISE and parts > 1:
            for name, _ in res.modules[path].named_parameters(recurse=False):
                out[f"{path}.{name}"] = parts
    return out


def packed_dims(plan: ir.Plan, model: nn.Module) -> dict[str, int]:
    """Parameter name → the dim its parts are packed along, where that is not 0: a packed Conv1D's
    weight (in, out) packs its columns, dim 1 (GPT-2's c_attn)."""
    res = resolve(plan, model)
    return {
        f"{path}.weight": 1
        for path, rule in res.claims.items()
        if rule.style.name == Style.COLWISE
        and packed(rule.style) > 1
        and is_conv1d(res.modules[path])
    }


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of chunk `index` of `size` elements cut into `parts` as torch.chunk cuts
    (DTensor's Shard)."""
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(size, start + step) - start


def canonical_shape(shape: tuple[int, ...], parts: int, dim: int = 0) -> tuple[int, ...]:
    """The stored shape of a tensor of the model's `shape` packed in `parts` parts along `dim`: (K,
    out/K, …), or (in, K, out/K) for a Conv1D weight, whose outputs are its dim 1."""
    if parts <= 1:
        return tuple(shape)
    return (*shape[:dim], parts, shape[dim] // parts, *shape[dim + 1 :])


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


@dataclass(frozen=True)
class View:
    """One parameter or optimizer-state tensor as DCP sees it, and how to put a loaded value back."""

    # what DCP saves or loads in place: a DTensor on the tp mesh, or a plain tensor
    stored: torch.Tensor
    # the tensor in the model or optimizer (its local shard when it is a DTensor)
    target: torch.Tensor
    # this rank's tp shard in the model's layout (before FSDP2 cuts it)
    tp_local_shape: tuple[int, ...]
    dp_dim: int | None  # FSDP2's sharded dim of the tp-local tensor, or None without FSDP2
    dp: tuple[int, int]  # (dp rank, dp size)
    lead: bool  # this rank's chunk counts for the fingerprint (the lowest rank holding that chunk)

    @property
    def local(self) -> torch.Tensor:
        """This rank's part of the stored tensor."""
        return self.stored.to_local() if isinstance(self.stored, DTensor) else self.stored

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where `local` starts in the stored (global) tensor."""
        if not isinstance(self.stored, DTensor):
            return (0,) * self.stored.dim()
        offsets = [0] * self.stored.dim()
        (placement,), mesh = self.stored.placements, self.stored.device_mesh
        if isinstance(placement, Shard):
            offsets[placement.dim] = chunk_range(
                self.stored.shape[placement.dim], mesh.size(), mesh.get_local_rank()
            )[0]
        return tuple(offsets)

    def write_back(self) -> None:
        """Copy a loaded value into the model or optimizer where the stored tensor is not already
        its storage."""
        if self.dp_dim is None:
            if self.target.data_ptr() != self.local.data_ptr():
                self.target.copy_(self.local.reshape(self.target.shape))
            return
        rank, size = self.dp
        tp_local = self.local.reshape(self.tp_local_shape)
        self.target.copy_(torch.chunk(tp_local, size, dim=self.dp_dim)[rank])


def _mesh_info(t: DTensor) -> tuple[dict[str, int], list]:
    names = t.device_mesh.mesh_dim_names or ("tp",) * t.device_mesh.ndim
    return {n: i for i, n in enumerate(names)}, list(t.placements)


@torch.no_grad()
def view(t: torch.Tensor, parts: int, tp_mesh: DeviceMesh, dp_mesh: DeviceMesh | None) -> View:
    """`t` (a parameter or a state tensor shaped like one) in the canonical, tp-independent form."""
    tp_rank = tp_mesh.get_local_rank()
    dp = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)
    if not isinstance(t, DTensor):
        return View(t.detach(), t.detach(), tuple(t.shape), None, dp, tp_rank == 0 and dp[0] == 0)
    t = t.detach()
    dims, placements = _mesh_info(t)
    dp_dim = None
    if "dp" in dims:  # FSDP2: gather the dp shards into the tp-local tensor
        if dp_mesh is None:
            raise ValueError(
                "the model is sharded over dp (FSDP2): pass the (dp, tp) mesh, not its tp part"
            )
        fsdp = placements[dims["dp"]]
        dp_dim = fsdp.dim if isinstance(fsdp, (Shard, _StridedShard)) else None
        gathered = t.redistribute(
            t.device_mesh, [Replicate() if i == dims["dp"] else p for i, p in enumerate(placements)]
        )
        tp_local = gathered.to_local()
    else:
        tp_local = t.to_local()
    tp_placement = placements[dims["tp"]] if "tp" in dims else Replicate()
    shape = tuple(t.shape)
    # the packed dim: 0 for a Linear's rows, 1 for a transposed Conv1D weight (GPT-2's c_attn)
    if parts > 1:
        if not isinstance(tp_placement, Shard) or isinstance(tp_placement, _StridedShard):
            raise ValueError(
                f"a packed tensor must be sharded on its output dim, found {tp_placement}"
            )
        d = tp_placement.dim
        local = tp_local.view(canonical_shape(tuple(tp_local.shape), parts, d))
        placement, shape = Shard(d + 1), canonical_shape(shape, parts, d)
    else:
        local, placement = tp_local, tp_placement
    stored = DTensor.from_local(
        local,
        tp_mesh,
        [placement],
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(shape),
    )
    lead = dp[0] == 0 and (isinstance(placement, Shard) or tp_rank == 0)
    return View(stored, t.to_local(), tuple(tp_local.shape), dp_dim, dp, lead)
