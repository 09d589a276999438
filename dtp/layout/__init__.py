"""Facts about a plan on a model: which module each rule claims, where each parameter lives, what
each module does with its activations. No rules (those are `dtp.checks`), no process group.

Input: an `ir.Plan` and a model (meta device is enough). Output: a `Resolution` (claims, `set`s,
placements) and, lowered at a tp, every module's input/output layouts. Imports `lang`, `models`,
`errors`. Modules, bottom up: experts, modules, norms, attention (heads), parts, placement, styles
(one StyleSpec per plan style), resolve, lower.
"""

from dtp.layout.placement import REPLICATE, ParamPlacement
from dtp.layout.resolve import Resolution
from dtp.layout.styles import SPECS, Style, StyleSpec, param_placements

__all__ = [
    "REPLICATE",
    "ParamPlacement",
    "param_placements",
    "Resolution",
    "SPECS",
    "Style",
    "StyleSpec",
]
