"""Norms under tensor parallelism: `sequence_parallel` runs a norm on this rank's sequence shard
(Megatron-SP: the stream between blocks is then split on the sequence), `sharded_norm` an RMS norm
over a colwise layer's split features, its sum of squares added over ranks."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Shard

from dtp.lang import ir
from dtp.layout.placement import ParamPlacement
from dtp.layout.styles.spec import SEQUENCE, LayoutContext, ModuleLayout, Region, Style, StyleSpec


def _sequence_layout(style: ir.Style, module: nn.Module, ctx: LayoutContext) -> ModuleLayout:
    return ModuleLayout(Style.SEQUENCE_PARALLEL, False, SEQUENCE, SEQUENCE, False)


def _sequence_collectives(r: Region) -> None:
    r.reduce_param_grads()  # each rank saw its own tokens


def _sharded_params(module: nn.Module, *, packed=1, parts=(), **_) -> dict[str, ParamPlacement]:
    # laid out as the colwise output it normalises
    return {"weight": ParamPlacement(0, packed, parts)}


def _sharded_sizes(module: nn.Module, packed: int) -> list[tuple[str, int]]:
    width = module.weight.shape[0]
    shown = f" per packed part ({packed} parts)" if packed > 1 else ""
    return [(f"its {width} features (weight dim 0){shown}", width // packed)]


def _sharded_layout(style: ir.Style, module: nn.Module, ctx: LayoutContext) -> ModuleLayout:
    # between a colwise layer and its consumer: local feature slices in and out
    return ModuleLayout(
        Style.SHARDED_NORM,
        False,
        Shard(-1),
        Shard(-1),
        True,
        placements=tuple(ctx.placements.items()),
    )


def _sharded_collectives(r: Region) -> None:
    stats = r.tokens * max(r.elem, 4)  # statistics in at least float32 (compiler/sharded_norm.py)
    r.add("all_reduce", "forward", 0, "sum of squares over the sharded features", stats)
    r.add("all_reduce", "backward", 0, "gradient of the sum of squares", stats)


SEQUENCE_PARALLEL = StyleSpec(
    Style.SEQUENCE_PARALLEL,
    "a norm on this rank's sequence shard; the stream between blocks split on the sequence",
    layout=_sequence_layout,
    collectives=_sequence_collectives,
)

SHARDED_NORM = StyleSpec(
    Style.SHARDED_NORM,
    "an RMS norm over a colwise layer's split features, its sum of squares added over ranks",
    params=_sharded_params,
    sizes=_sharded_sizes,
    layout=_sharded_layout,
    collectives=_sharded_collectives,
)
