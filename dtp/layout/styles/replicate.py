"""`replicate`: the module stays whole on every rank; with `reduce_grad=true` its parameters'
gradients are added over ranks (a module that sees only this rank's part of the work)."""

from __future__ import annotations

import torch.nn as nn

from dtp.lang import ir
from dtp.layout.styles.spec import LayoutContext, ModuleLayout, Region, Style, StyleSpec


def _layout(style: ir.Style, module: nn.Module, ctx: LayoutContext) -> ModuleLayout | None:
    if style.option("reduce_grad", False) is not True:
        return None  # nothing to do
    return ModuleLayout(Style.REPLICATE, False, None, None, True, reduce_grad=True)


def _collectives(r: Region) -> None:
    r.reduce_param_grads()


REPLICATE = StyleSpec(
    Style.REPLICATE,
    "the module whole on every rank (reduce_grad=true: gradients added over ranks)",
    layout=_layout,
    collectives=_collectives,
)
