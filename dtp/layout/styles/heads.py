"""Per-head cuts that leave activations alone: `slice_input` cuts inputs holding every head at a
dimension to this rank's heads (an attention kernel's mask or sinks), `slice_params` an attention's
own per-head parameters. Neither communicates."""

from __future__ import annotations

import torch.nn as nn

from dtp.lang import ir
from dtp.lang.vocabulary import slice_names
from dtp.layout.placement import ParamPlacement
from dtp.layout.styles.spec import LayoutContext, ModuleLayout, Style, StyleSpec


def _sliced(kind: Style):
    def layout(style: ir.Style, module: nn.Module, ctx: LayoutContext) -> ModuleLayout:
        return ModuleLayout(
            kind,
            False,
            None,
            None,
            True,
            slice_names=slice_names(style),
            heads=ctx.heads,
            slice_dim=int(style.option("dim", 0)),
        )

    return layout


def _params(module: nn.Module, *, sliced=(), dim=0, **_) -> dict[str, ParamPlacement]:
    return dict.fromkeys(sliced, ParamPlacement(dim))


# inputs (one name or a list) holding every head at `dim` (0: (batch · heads, …))
SLICE_INPUT = StyleSpec(
    Style.SLICE_INPUT,
    "inputs holding every head at a dimension cut to this rank's heads",
    layout=_sliced(Style.SLICE_INPUT),
)

SLICE_PARAMS = StyleSpec(
    Style.SLICE_PARAMS,
    "an attention's own per-head parameters cut to this rank's heads",
    params=_params,
    layout=_sliced(Style.SLICE_PARAMS),
)
