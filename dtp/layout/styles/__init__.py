"""The plan styles, one StyleSpec each (spec.py says what a spec holds). Every stage dispatches
through SPECS; adding a style is one module here, its ParallelStyle in dtp/compiler and its tests."""

from __future__ import annotations

import torch.nn as nn

from dtp.layout.placement import ParamPlacement
from dtp.layout.styles.heads import SLICE_INPUT, SLICE_PARAMS
from dtp.layout.styles.linear import COLWISE, ROWWISE
from dtp.layout.styles.moe import EXPERTS
from dtp.layout.styles.norm import SEQUENCE_PARALLEL, SHARDED_NORM
from dtp.layout.styles.replicate import REPLICATE
from dtp.layout.styles.spec import Style, StyleSpec  # Style: the language's (lang/vocabulary)
from dtp.layout.styles.vocab import VOCAB_PARALLEL

SPECS: dict[Style, StyleSpec] = {
    s.style: s
    for s in (
        COLWISE,
        ROWWISE,
        VOCAB_PARALLEL,
        SEQUENCE_PARALLEL,
        REPLICATE,
        EXPERTS,
        SLICE_INPUT,
        SHARDED_NORM,
        SLICE_PARAMS,
    )
}


def param_placements(style: str | None, module: nn.Module, **kwargs) -> dict[str, ParamPlacement]:
    """ParamPlacement of each of `module`'s own parameters under `style` (None or a name no style
    has: all replicated); `kwargs` as StyleSpec.params takes them."""
    return SPECS.get(style, REPLICATE).placements(module, **kwargs)


__all__ = ["SPECS", "Style", "StyleSpec", "param_placements"]
