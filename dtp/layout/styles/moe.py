"""`experts`: each expert's FFN dimension split (dtp/layout/experts.py reads the layout of a
model's fused expert weights), f before and g after, as a colwise → rowwise pair inside every
expert; the biases of down_proj are added once."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Replicate

from dtp.lang import ir
from dtp.layout.experts import experts_layout
from dtp.layout.placement import REPLICATE, ParamPlacement
from dtp.layout.styles.spec import LayoutContext, ModuleLayout, NotModeled, Region, Style, StyleSpec


def _params(module: nn.Module, **_) -> dict[str, ParamPlacement]:
    layout = experts_layout(module)
    if layout is None:  # a module the style does not fit (check reports it)
        return {}
    halves = 2 if layout.concatenated else 1  # [gate; up]: two packed parts
    return {
        "gate_up_proj": ParamPlacement(2 if layout.transposed else 1, halves),
        "down_proj": ParamPlacement(1 if layout.transposed else 2),
        "gate_up_proj_bias": ParamPlacement(1, halves),
        "down_proj_bias": REPLICATE,
    }


def _sizes(module: nn.Module, packed: int) -> list[tuple[str, int]]:
    layout = experts_layout(module)
    if layout is None:
        return []
    dims = "dim 2, down_proj dim 1" if layout.transposed else "dim 1, down_proj dim 2"
    per = " per part" if layout.concatenated else " in gate/up pairs"
    return [
        (f"the expert FFN dimension of {layout.inter} (gate_up_proj {dims}{per})", layout.inter)
    ]


def _layout(style: ir.Style, module: nn.Module, ctx: LayoutContext) -> ModuleLayout:
    return ModuleLayout(Style.EXPERTS, False, Replicate(), Replicate(), True)


def _collectives(r: Region) -> None:
    hidden = experts_layout(r.module).hidden
    top_k = getattr(getattr(r.model, "config", None), "num_experts_per_tok", None)
    if not isinstance(top_k, int):
        raise NotModeled(f"{r.path}: experts without config.num_experts_per_tok")
    r.add("all_reduce", "backward", hidden, "input: gradient (f)")
    routing = r.tokens * top_k * max(r.elem, 4)
    r.add(
        "all_reduce",
        "backward",
        top_k,
        "routing weights: gradient (f), in at least float32",
        routing,
    )
    r.add("all_reduce", "forward", hidden, "partial sums (g)")


EXPERTS = StyleSpec(
    Style.EXPERTS,
    "each expert's FFN dimension split, f before and g after",
    params=_params,
    sizes=_sizes,
    layout=_layout,
    collectives=_collectives,
)
