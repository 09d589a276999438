"""The index map both ways of filling a sharded model share: for each parameter, which rows of the
full tensor a rank holds (packed parts reordered as the DTensor stores them), so a full copy can be
scattered and the keyed generator can draw exactly the values an unsharded model would hold."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from dtp.compiler.placed import pack_parts
from dtp.layout.parts import equal_parts
from dtp.layout.placement import ParamPlacement
from dtp.runtime.shard import Applied


@dataclass(frozen=True)
class ParamLayout:
    """One parameter of a sharded model, seen from the model's own (unsharded) layout."""

    name: str  # first owner's name (a tied weight appears once)
    module: nn.Module
    pname: str
    param: nn.Parameter
    shape: tuple[int, ...]  # the model's own shape (a replicated packed part counted once)
    dim: int | None  # the tp-sharded dim, None when every tp rank holds it whole
    # model-layout row of each global row of `dim`, in the DTensor's order
    order: torch.Tensor | None
    tp: int

    def rows(self, tp_rank: int) -> torch.Tensor | None:
        """The model-layout rows of `dim` that `tp_rank` holds (torch.chunk's layout, as DTensor's
        Shard)."""
        return None if self.order is None else self.order.chunk(self.tp)[tp_rank]

    @property
    def local(self) -> torch.Tensor:
        """This rank's storage of the parameter."""
        return self.param.to_local() if isinstance(self.param, DTensor) else self.param


def row_order(entry: ParamPlacement | None, n: int, tp: int) -> tuple[int, torch.Tensor]:
    """(model size of the sharded dim, model row of each global row) for a `Compiled.packed` entry
    and a global dim of `n` rows: packed parts are interleaved per rank
    (dtp.compiler.placed.pack_parts), a replicated part is held by every rank."""
    if entry is None or not (entry.parts or entry.packed > 1):
        return n, torch.arange(n)
    parts = entry.parts or equal_parts(n, entry.packed)
    size = sum(s for s, _ in parts)
    return size, pack_parts(torch.arange(size), parts, tp)


def param_layouts(applied: Applied) -> Iterator[ParamLayout]:
    """Every parameter of `applied.model` once, with its index map."""
    seen: set[nn.Parameter] = set()  # tied owners: the first one only (named_parameters' own memo)
    for path, module in applied.model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if p in seen:
                continue
            seen.add(p)
            name = f"{path}.{pname}" if path else pname
            shape, dim, order, tp = tuple(p.shape), None, None, 1
            # the tp mesh: before FSDP2
            placement = p.placements[0] if isinstance(p, DTensor) else None
            if placement is not None and placement.is_shard():
                tp = p.device_mesh.size()
                dim = placement.dim % p.dim()
                packed = applied.compiled.packed
                size, order = row_order(packed.get(name), shape[dim], tp)
                shape = shape[:dim] + (size,) + shape[dim + 1 :]
            layout = ParamLayout(name, module, pname, p, shape, dim, order, tp)
            if dim is not None:
                held = len(layout.rows(p.device_mesh.get_local_rank()))
                if held != layout.local.shape[dim]:
                    raise AssertionError(
                        f"{name}: this rank holds {layout.local.shape[dim]} rows of dim {dim}, "
                        f"the chunk layout says {held}"
                    )
            yield layout


def shared_rows(applied: Applied) -> dict[str, tuple[int, torch.Tensor]]:
    """Parameter name → (sharded dim, weight of each global row: 1 / the copies of its model row)
    for the parameters some of whose rows several tp ranks hold (replicated parts, repeated k/v
    heads): a global gradient norm counts each model row once with these weights."""
    out = {}
    for name, entry in applied.compiled.packed.items():
        if any(kind is not True for _, kind in entry.parts):
            _, order = row_order(entry, 0, applied.tp)
            copies = torch.bincount(order)
            out[name] = (entry.shard_dim, 1.0 / copies[order].double())
    return out
