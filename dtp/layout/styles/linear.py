"""Megatron's pair: `colwise` splits a Linear's output features (weight dim 0; Conv1D's dim 1) and
hands on this rank's features; `rowwise` splits its input features (weight dim 1, bias replicated)
and hands on the sum over ranks."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from dtp.lang import ir
from dtp.layout.modules import features, is_conv1d, is_linear
from dtp.layout.placement import ParamPlacement
from dtp.layout.styles.spec import (
    LayoutContext,
    ModuleLayout,
    NotModeled,
    Region,
    Style,
    StyleSpec,
    written,
)


def _colwise_params(module: nn.Module, *, packed=1, parts=(), **_) -> dict[str, ParamPlacement]:
    conv = is_conv1d(module)  # weight (in, out): the output features are dim 1
    return {
        "weight": ParamPlacement(1 if conv else 0, packed, parts),
        "bias": ParamPlacement(0, packed, parts),
    }


def _colwise_sizes(module: nn.Module, packed: int) -> list[tuple[str, int]]:
    fan_out = features(module)[1] if is_linear(module) else 0
    part = fan_out // packed
    what = f"out_features={fan_out}" + (
        f" per packed part ({packed} parts of {part})" if packed > 1 else ""
    )
    return [(f"{what} (weight dim {1 if is_conv1d(module) else 0})", part)]


def _colwise_layout(style: ir.Style, module: nn.Module, ctx: LayoutContext) -> ModuleLayout:
    # packed parts (equal or not) and Conv1D need dtp's own placements
    special = is_conv1d(module) or any(p.parts or p.packed > 1 for p in ctx.placements.values())
    return ModuleLayout(
        Style.COLWISE,
        False,
        written(style, "input", ctx.between),
        written(style, "output", Shard(-1)),
        style.option("local", True),
        placements=tuple(ctx.placements.items()) if special else (),
    )


def _colwise_collectives(r: Region) -> None:
    fan_in, fan_out = features(r.module)
    r.enter(fan_in)
    output = r.layout.output
    if output == Shard(-1):
        return
    if output != Replicate():
        raise NotModeled(f"{r.path}: colwise output {output}")
    if any(p.parts for _, p in r.layout.placements):
        raise NotModeled(f"{r.path}: gathered output of packed parts")
    r.add("all_gather", "forward", fan_out, "gathered output")


def _rowwise_params(module: nn.Module, **_) -> dict[str, ParamPlacement]:
    return {"weight": ParamPlacement(0 if is_conv1d(module) else 1)}


def _rowwise_sizes(module: nn.Module, packed: int) -> list[tuple[str, int]]:
    fan_in = features(module)[0] if is_linear(module) else 0
    return [(f"in_features={fan_in} (weight dim {0 if is_conv1d(module) else 1})", fan_in)]


def _rowwise_layout(style: ir.Style, module: nn.Module, ctx: LayoutContext) -> ModuleLayout:
    return ModuleLayout(
        Style.ROWWISE,
        False,
        written(style, "input", Shard(-1)),
        written(style, "output", ctx.between),
        style.option("local", not ctx.sp),
    )


def _rowwise_collectives(r: Region) -> None:
    fan_in, fan_out = features(r.module)
    if r.layout.input == Replicate():  # split locally; its gradient gathered
        r.add("all_gather", "backward", fan_in, "gradient of the split input")
    elif r.layout.input != Shard(-1):
        raise NotModeled(f"{r.path}: rowwise input {r.layout.input}")
    r.leave(r.layout.output, fan_out)


COLWISE = StyleSpec(
    Style.COLWISE,
    "a Linear's output features split: each rank computes its own (Megatron's A in Y = XA)",
    params=_colwise_params,
    sizes=_colwise_sizes,
    layout=_colwise_layout,
    collectives=_colwise_collectives,
)

ROWWISE = StyleSpec(
    Style.ROWWISE,
    "a Linear's input features split: partial sums added over ranks (Megatron's B in Z = YB)",
    params=_rowwise_params,
    sizes=_rowwise_sizes,
    layout=_rowwise_layout,
    collectives=_rowwise_collectives,
)
