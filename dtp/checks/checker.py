"""The checker: everything that can be known about a plan before any process starts.

Runs the rules of this package in order (options and the mesh header; then, against a model, the
rules of dtp.checks.model_rules) and raises all problems of a file together as one PlanError. The
rules that need a model import torch; `dtp check PLAN` runs only the first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtp.checks.advice import check_mesh
from dtp.checks.messages import MAX_TP_SHOWN
from dtp.checks.options import check_syntax_level
from dtp.errors import Diagnostic, PlanError
from dtp.lang import conditions, ir

if TYPE_CHECKING:  # torch only where a model is checked: `dtp check PLAN` stays instant
    import torch.nn as nn

    from dtp.layout.resolve import Resolution


@dataclass(frozen=True)
class Checked:
    """A plan that passed `check` against a model: the resolution plus the tp it was checked for."""

    plan: ir.Plan
    resolution: Resolution | None
    tp: int | None
    admissible_tp: tuple[int, ...]  # every tp ≤ MAX_TP_SHOWN that satisfies all divisibility rules
    # problems that do not stop the plan (printed as `warning:`)
    warnings: tuple[Diagnostic, ...] = ()


def check(
    plan: ir.Plan, model: nn.Module | None = None, tp: int | None = None, dp: int | None = None
) -> Checked:
    """Check `plan` alone, or against `model` (build it on the meta device) for a given tp (and dp,
    when the plan's `mesh` header must agree with it)."""
    if tp is not None and tp < 1:
        raise ValueError("tp must be positive")
    if tp is None and model is not None and conditions.reads_tp(plan):
        return _check_every_branch(plan, model, dp)
    return _check(plan, model, tp, dp, tp)


def _check_every_branch(plan: ir.Plan, model: nn.Module, dp: int | None) -> Checked:
    """No tp given, but `when` conditions read it: check once per distinct choice of branches over
    the tp values listed, and admit each tp its own branches admit (errors: those of tp=1's
    branches)."""
    config = conditions.model_config(model)
    by_choice: dict[tuple, list[int]] = {}
    for d in range(1, MAX_TP_SHOWN + 1):
        by_choice.setdefault(conditions.branches(plan, config, d), []).append(d)
    first: Checked | None = None
    admissible: list[int] = []
    for values in by_choice.values():
        try:
            checked = _check(plan, model, None, dp, values[0])
        except PlanError:
            if 1 in values:
                raise
            continue
        first = first or checked
        admissible += [d for d in values if d in checked.admissible_tp]
    assert first is not None  # tp=1's choice raised otherwise
    return Checked(first.plan, first.resolution, None, tuple(sorted(admissible)), first.warnings)


def _check(
    plan: ir.Plan, model: nn.Module | None, tp: int | None, dp: int | None, cond_tp: int | None
) -> Checked:
    diags = check_syntax_level(plan) + check_mesh(plan, dp)
    res: Resolution | None = None
    sizes: list[int] = []
    warnings: list[Diagnostic] = []
    if model is not None:
        from dtp.checks.model_rules import check_model  # torch: only once a model is checked

        res, found, sizes, warnings = check_model(plan, model, tp, cond_tp, structural=bool(diags))
        diags += found
    if diags:
        raise PlanError(diags, plan.source)
    g = math.gcd(*sizes) if sizes else 0
    admissible = tuple(d for d in range(1, MAX_TP_SHOWN + 1) if g % d == 0)
    return Checked(plan, res, tp, admissible, tuple(warnings))


def render_warnings(checked: Checked) -> str:
    """The warnings of a plan that passed, each with its position and source line ("" when none)."""
    return "".join(w.render(checked.plan.source) + "\n" for w in checked.warnings)


def checked_for(plan: ir.Plan | Checked, model: nn.Module, tp: int) -> Checked:
    """`plan` checked against `model` at `tp`, reusing an earlier check made for the same tp."""
    if isinstance(plan, Checked):
        return plan if plan.tp == tp else check(plan.plan, model, tp)
    return check(plan, model, tp)


def sequence_shape_problem(checked: Checked, tp: int, seq: int) -> str | None:
    """Why a sequence-parallel plan cannot run on `seq` tokens at `tp`, if it cannot."""
    if seq < tp and checked.resolution.sequence_parallel:
        return (
            f"--seq {seq} is shorter than tp={tp}: sequence parallelism gives every rank a part of "
            "the "
            f"sequence, so use --seq {tp} or more"
        )
    return None
