"""Facts about a plan on a model: which module each rule claims, where each parameter lives, what
each module does with its activations. No rules (those are `dtp.checks`), no process group.

Input: an `ir.Plan` and a model (meta device is enough). Output: a `Resolution` (claims, `set`s,
placements) and, lowered at a tp, every module's input/output layouts. Imports `lang`, `models`,
`errors`. Modules, bottom up: experts, modules, norms, attention (heads), parts, placement, resolve,
lower.
"""

from dtp.layout.placement import REPLICATE, ParamPlacement, param_placements
from dtp.layout.resolve import Resolution

__all__ = ["REPLICATE", "ParamPlacement", "param_placements", "Resolution"]
