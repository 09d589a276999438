"""The rules that need a model, in order: the plan resolved against it, each claimed module, norms
and heads, attention shapes, partial gradients, the activations' flow, `set` values, one rank's
shapes, tied parameters.

Imports torch (through layout and models): dtp.checks.checker imports this module only once a model
is checked, so `dtp check PLAN` stays torch-free.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.nn as nn

from dtp.checks import flow
from dtp.checks.advice import replication_warning
from dtp.checks.attention_shapes import check_attention_shapes
from dtp.checks.heads import check_per_head_lists
from dtp.checks.messages import Reporter
from dtp.checks.modules import check_modules
from dtp.checks.norms import check_unsharded_norms
from dtp.checks.partial_grads import check_partial_grads
from dtp.checks.rank_shapes import check_rank_shapes
from dtp.errors import NOWHERE, Diagnostic, did_you_mean
from dtp.lang import conditions, ir
from dtp.lang.expr import ExprError, evaluate
from dtp.layout.lower import module_layout
from dtp.layout.placement import ParamPlacement
from dtp.layout.resolve import Resolution, int_attributes, resolve, set_target, written_length
from dtp.layout.styles import SPECS
from dtp.layout.styles.spec import LayoutContext
from dtp.layout.trace import model_trace
from dtp.models import vocab_size


class ModelCheck(NamedTuple):
    """What checking a plan against a model found."""

    resolution: Resolution
    diagnostics: list[Diagnostic]
    sizes: list[int]  # the sizes the plan shards: every admissible tp divides them all
    warnings: list[Diagnostic]  # problems that do not stop the plan


def check_model(
    plan: ir.Plan, model: nn.Module, tp: int | None, cond_tp: int | None, structural: bool
) -> ModelCheck:
    """Every model rule over `plan` resolved against `model` (`when` branches chosen at `cond_tp`);
    `structural`: the plan alone already failed, so rules whose errors would only echo that are
    skipped."""
    res = resolve(plan, model, cond_tp)
    structural = structural or bool(res.diagnostics)
    diags = list(res.diagnostics)
    sizes: list[int] = []
    rep = Reporter()
    fits = check_modules(res, model, tp, rep, sizes)
    if fits:  # a norm left whole over a sharded output: the flow walk would only echo it
        before = len(rep.groups)
        check_unsharded_norms(res, rep)
        check_per_head_lists(res, model, tp, rep)
        # after any other error a shape error would only echo it
        if not rep.groups and not structural:
            # `when tp` branches
            check_attention_shapes(res, model, tp if tp is not None else cond_tp, rep)
        if len(rep.groups) == before:  # a per-head list's norms would only echo it
            check_partial_grads(res, model, tp, rep)
        fits = len(rep.groups) == before
    if fits and not structural:  # layouts of styles that do not apply would only echo those errors
        _check_flow(res, model, rep)
    _check_sets(res, tp, rep, plan)
    at = tp if tp is not None else cond_tp
    # a run on one rank's shapes
    if not rep.groups and not structural and at is not None and at > 1:
        check_rank_shapes(res, model, at, rep)
    diags += rep.diagnostics()
    _check_ties(res, model, diags)
    return ModelCheck(res, diags, sizes, replication_warning(plan, res))


def _check_ties(res: Resolution, model: nn.Module, diags: list[Diagnostic]) -> None:
    owners: dict[int, list[tuple[str, str, ParamPlacement, ir.FlatRule | None]]] = {}
    for path, module in res.modules.items():
        rule = res.claims.get(path)
        placements = res.placements(path)
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((path, name, placements[name], rule))
    for group in owners.values():
        if len({str(p) for _, _, p, _ in group}) <= 1 or any(
            r and r.style.name not in SPECS for *_, r in group
        ):
            continue  # an unknown style is reported already
        (path_a, name_a, pl_a, rule_a), (path_b, name_b, pl_b, rule_b) = group[0], group[1]
        where = rule_b or rule_a

        def why(rule):
            return f"{rule.style.name}, line {rule.pos.line}" if rule else "no rule"

        fix = "give both the same style (e.g. vocab_parallel on both) or untie them in the model"
        diags.append(
            Diagnostic(
                where.pos if where else NOWHERE,
                f"{path_a}.{name_a} and {path_b}.{name_b} are one tied parameter but get different "
                f"placements: {pl_a} ({why(rule_a)}) vs {pl_b} ({why(rule_b)}); {fix}",
                len(str(where.pattern)) if where else 1,
            )
        )


def _check_sets(res: Resolution, tp: int | None, rep: Reporter, plan: ir.Plan) -> None:
    for (path, target), stmt in res.sets.items():
        module, attr = set_target(res.modules[path], target)
        attrs = int_attributes(module)
        shown = path or "the model"
        if attr not in attrs:
            rep.add(
                stmt.pattern.pos,
                written_length(plan, stmt.pattern),
                shown,
                f"{type(module).__name__} has no integer attribute "
                f"'{attr}'{did_you_mean(attr, list(attrs))}",
            )
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
                raise ExprError(
                    var.pos,
                    f"unknown name '{var.name}': {type(module).__name__} has no integer attribute "
                    f"of that name{did_you_mean(var.name, list(attrs) + ['tp'])}",
                    len(var.name),
                )
            return attrs[var.name]

        try:
            value = evaluate(stmt.expr, lookup)
        except ExprError as err:
            extra = f" at tp={tp}" if tp and err.message.endswith(("exactly", "zero")) else ""
            rep.add(err.pos, err.length, shown, err.message + extra)
            continue
        if value is not None and value < 1:
            rep.add(
                stmt.pos,
                3,
                shown,
                f"set {attr} evaluates to {value}; it must be a positive integer",
            )


def _check_flow(res: Resolution, model: nn.Module, rep: Reporter) -> None:
    """Follow the activations' layouts through the model (dtp/checks/flow.py)."""
    sp = res.sequence_parallel
    layouts = {
        path: m
        for path, rule in res.claims.items()
        # the activations' layouts only: no parameter placements, no heads
        if (m := module_layout(rule.style, res.modules[path], LayoutContext(sp, {}))) is not None
    }
    flow.analyse(res, sp, layouts, vocab_size(model), rep.add, model_trace(model))
