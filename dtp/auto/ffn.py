"""The rules `dtp plan --auto` writes for a feed-forward pair and for expert modules.

The layers reading the MLP's input are colwise (a fused gate|up, split by the forward, packed); the
one reading their product is rowwise. A learnt activation between them (Apertus's xIELU scalars)
reads this rank's features: its gradient is summed (`replicate(reduce_grad=true)`). Experts held as
3-D parameters split each expert's FFN dimension (`experts`).
"""

from __future__ import annotations

import torch.nn as nn

from dtp.auto.rules import Line, Unit
from dtp.auto.sizes import fused_layout
from dtp.auto.structure import NO_SOURCE, Pair, Reading, unreadable
from dtp.layout.experts import experts_layout
from dtp.layout.modules import features
from dtp.layout.norms import is_norm, norm_width


def mlp_unit(reading: Reading, module: nn.Module, pair: Pair, tp: int) -> Unit:
    """The rules for feed-forward `module` at `tp`, or why it stays whole."""
    unit = Unit(pair.owner, "mlp")
    rel = lambda c: f"{pair.owner}.{c}" if pair.owner else c
    inner = features(module.get_submodule(pair.second))[0]
    if inner % tp:
        return unit.refuse(f"its {inner} hidden features do not divide by tp={tp}")
    lines = []
    for name in pair.firsts:
        width = features(module.get_submodule(name))[1]
        if width == inner:
            lines.append(
                Line(rel(name), "colwise", f"{inner} hidden features: this rank's {inner // tp}")
            )
        elif width % inner == 0 and reading.source(fused_layout, module, name) == "concat":
            k = width // inner
            lines.append(
                Line(
                    rel(name),
                    f"colwise(packed={k})",
                    f"{k} parts of {inner} fused (the forward splits its output): this rank's share "
                    "of each",
                )
            )
        else:
            return unit.refuse(
                f"{name} makes {width} features for {pair.second}'s {inner}, laid out in a way the "
                "forward's source does not show"
            )
    lines.append(
        Line(rel(pair.second), "rowwise", "partial sums over this rank's features, all-reduced")
    )
    for name in pair.between:
        child = module.get_submodule(name)
        params = list(child.parameters())
        if not params:
            continue
        if is_norm(child) and norm_width(child) == inner:
            lines.append(
                Line(
                    rel(name),
                    "sharded_norm",
                    f"norm over the {inner} hidden features: sum of squares all-reduced",
                )
            )
        elif all(inner not in p.shape for p in params):
            lines.append(
                Line(
                    rel(name),
                    "replicate(reduce_grad=true)",
                    "learnt parameters applied to this rank's features: gradient summed",
                )
            )
        else:
            return unit.refuse(
                f"{name} ({type(child).__name__}) holds parameters on the hidden features"
            )
    return Unit(pair.owner, "mlp", tuple(lines))


def experts_unit(path: str, module: nn.Module, tp: int) -> Unit:
    """`experts` for a module holding every expert's FFN as 3-D parameters, or why it stays whole
    (also when its forward's source cannot be read: the parameters' names are no evidence of how it
    computes)."""
    unit = Unit(path, "experts")
    why = unreadable(module)
    if why:
        return unit.refuse(f"its forward's source cannot be read ({why}): {NO_SOURCE}")
    layout = experts_layout(module)
    if layout is None:
        return unit.refuse("its expert parameters have a layout dtp cannot split")
    if layout.inter % tp:
        return unit.refuse(f"each expert's {layout.inter} hidden features do not divide by tp={tp}")
    return Unit(
        path,
        "experts",
        (
            Line(
                path,
                "experts",
                f"{layout.experts} experts, {layout.describe()}: each rank "
                f"{layout.inter // tp} of every expert's {layout.inter} features",
            ),
        ),
    )
