"""The checker: everything that can be known about a plan before any process starts.

Runs the rules of this package in order (options, then each claimed module, norms and heads, partial
gradients, the activations' flow, `set` values, tied parameters) and raises all problems of a file together as
one PlanError. The rules that need a model import torch; `dtp check PLAN` runs only the first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtp.checks.advice import check_mesh, replication_warning
from dtp.checks.messages import MAX_TP_SHOWN, Reporter
from dtp.checks.options import check_syntax_level
from dtp.errors import NOWHERE, Diagnostic, PlanError, did_you_mean
from dtp.lang import conditions, ir
from dtp.lang.expr import ExprError, evaluate
from dtp.lang.vocabulary import STYLES
from dtp.layout.placement import ParamPlacement
from dtp.layout.resolve import Resolution, int_attributes, resolve, set_target, written_length

if TYPE_CHECKING:  # torch only where a model is checked: `dtp check PLAN` stays instant
    import torch.nn as nn


@dataclass(frozen=True)
class Checked:
    """A plan that passed `check` against a model: the resolution plus the tp it was checked for."""

    plan: ir.Plan
    resolution: Resolution | None
    tp: int | None
    admissible_tp: tuple[int, ...]  # every tp ≤ MAX_TP_SHOWN that satisfies all divisibility rules
    warnings: tuple[Diagnostic, ...] = ()  # problems that do not stop the plan (printed as `warning:`)


# ---- model-independent checks ----------------------------------------------------------------------


# ---- model checks --------------------------------------------------------------------------------


def _check_ties(res: Resolution, model: nn.Module, diags: list[Diagnostic]) -> None:
    owners: dict[int, list[tuple[str, str, ParamPlacement, ir.FlatRule | None]]] = {}
    for path, module in res.modules.items():
        rule = res.claims.get(path)
        placements = res.placements(path)
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((path, name, placements[name], rule))
    for group in owners.values():
        if len({str(p) for _, _, p, _ in group}) <= 1 or any(r and r.style.name not in STYLES for *_, r in group):
            continue  # an unknown style is reported already
        (path_a, name_a, pl_a, rule_a), (path_b, name_b, pl_b, rule_b) = group[0], group[1]
        where = rule_b or rule_a
        def why(rule):
            return f"{rule.style.name}, line {rule.pos.line}" if rule else "no rule"
        fix = "give both the same style (e.g. vocab_parallel on both) or untie them in the model"
        diags.append(Diagnostic(where.pos if where else NOWHERE,
                                f"{path_a}.{name_a} and {path_b}.{name_b} are one tied parameter but get different "
                                f"placements: {pl_a} ({why(rule_a)}) vs {pl_b} ({why(rule_b)}); {fix}",
                                len(str(where.pattern)) if where else 1))


def _check_sets(res: Resolution, tp: int | None, rep: Reporter, plan: ir.Plan) -> None:
    for (path, target), stmt in res.sets.items():
        module, attr = set_target(res.modules[path], target)
        attrs = int_attributes(module)
        shown = path or "the model"
        if attr not in attrs:
            rep.add(stmt.pattern.pos, written_length(plan, stmt.pattern), shown,
                    f"{type(module).__name__} has no integer attribute '{attr}'{did_you_mean(attr, list(attrs))}")
            continue

        def lookup(var: ir.Var) -> int | None:
            if var.name == "tp":
                return tp
            if var.name.startswith("config."):
                try:
                    return conditions.config_int(res.modules[""], var)
                except conditions.ConditionError as err:
                    raise ExprError(var.pos, err.diagnostic.message, len(var.name)) from None
            if var.name not in attrs:
                raise ExprError(var.pos, f"unknown name '{var.name}': {type(module).__name__} has no integer attribute "
                                 f"of that name{did_you_mean(var.name, list(attrs) + ['tp'])}", len(var.name))
            return attrs[var.name]

        try:
            value = evaluate(stmt.expr, lookup)
        except ExprError as err:
            extra = f" at tp={tp}" if tp and err.message.endswith(("exactly", "zero")) else ""
            rep.add(err.pos, err.length, shown, err.message + extra)
            continue
        if value is not None and value < 1:
            rep.add(stmt.pos, 3, shown, f"set {attr} evaluates to {value}; it must be a positive integer")


def _check_flow(res: Resolution, model: nn.Module, rep: Reporter) -> None:
    """Follow the activations' layouts through the model (dtp/checks/flow.py)."""
    from dtp.checks import flow
    from dtp.layout.lower import module_layout
    from dtp.layout.trace import model_trace
    from dtp.models import vocab_size

    sp = any(rule.style.name == "sequence_parallel" for rule in res.claims.values())
    layouts = {path: m for path, rule in res.claims.items()
               if (m := module_layout(rule.style, res.modules[path], sp)) is not None}
    flow.analyse(res, sp, layouts, vocab_size(model), rep.add, model_trace(model))


def check(plan: ir.Plan, model: nn.Module | None = None, tp: int | None = None, dp: int | None = None) -> Checked:
    """Check `plan` alone, or against `model` (build it on the meta device) for a given tp (and dp, when the
    plan's `mesh` header must agree with it)."""
    if tp is not None and tp < 1:
        raise ValueError("tp must be positive")
    if tp is None and model is not None and conditions.reads_tp(plan):
        return _check_every_branch(plan, model, dp)
    return _check(plan, model, tp, dp, tp)


def _check_every_branch(plan: ir.Plan, model: nn.Module, dp: int | None) -> Checked:
    """No tp given, but `when` conditions read it: check once per distinct choice of branches over the tp
    values listed, and admit each tp its own branches admit (errors: those of tp=1's branches)."""
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


def _check(plan: ir.Plan, model: nn.Module | None, tp: int | None, dp: int | None, cond_tp: int | None) -> Checked:
    diags = check_syntax_level(plan) + check_mesh(plan, dp)
    res = None
    sizes: list[int] = []
    warnings: list[Diagnostic] = []
    if model is not None:
        from dtp.checks.attention_shapes import check_attention_shapes  # torch: only once a model is checked
        from dtp.checks.heads import check_per_head_lists
        from dtp.checks.modules import check_modules
        from dtp.checks.norms import check_unsharded_norms
        from dtp.checks.partial_grads import check_partial_grads

        res = resolve(plan, model, cond_tp)
        structural = bool(diags or res.diagnostics)
        diags += res.diagnostics
        rep = Reporter()
        fits = check_modules(res, model, tp, rep, sizes)
        if fits:  # a norm left whole over a sharded output: the flow walk would only echo it
            before = len(rep.groups)
            check_unsharded_norms(res, rep)
            check_per_head_lists(res, model, tp, rep)
            if not rep.groups and not structural:  # after any other error a shape error would only echo it
                check_attention_shapes(res, model, tp if tp is not None else cond_tp, rep)  # `when tp` branches
            if len(rep.groups) == before:  # a per-head list's norms would only echo it
                check_partial_grads(res, model, tp, rep)
            fits = len(rep.groups) == before
        if fits and not structural:  # layouts of styles that do not apply would only echo those errors
            _check_flow(res, model, rep)
        _check_sets(res, tp, rep, plan)
        at = tp if tp is not None else cond_tp
        if not rep.groups and not structural and at is not None and at > 1:  # a run on one rank's shapes
            from dtp.checks.rank_shapes import check_rank_shapes
            check_rank_shapes(res, model, at, rep)
        diags += rep.diagnostics()
        _check_ties(res, model, diags)
        warnings = replication_warning(plan, res)
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
    from dtp.layout.lower import lower

    if seq < tp and lower(checked.resolution, tp).sequence_parallel:
        return (f"--seq {seq} is shorter than tp={tp}: sequence parallelism gives every rank a part of the "
                f"sequence, so use --seq {tp} or more")
    return None
