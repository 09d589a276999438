"""Every rule a plan must pass before any process starts; all problems of a file become one
PlanError.

Input: a plan, optionally a model and tp/dp. Output: `Checked` (the resolution, the admissible tp
values, warnings). Imports `layout`, `lang`, `models`, `errors`. The driver is `checker`
(torch-free: `dtp check PLAN`), which runs options (no model needed) and, against a model,
`model_rules`: modules, heads, slices, parts, norms, partial_grads, flow, advice; `messages` is how
they report.
"""

from dtp.checks.checker import Checked, check, checked_for, render_warnings, sequence_shape_problem

__all__ = ["Checked", "check", "checked_for", "render_warnings", "sequence_shape_problem"]
