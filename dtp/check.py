"""Static checks: everything that can be known about a plan before any process starts.

All problems of a file are collected and raised together as one PlanError.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtp import check_layouts, check_slices, conditions, ir
from dtp.advice import check_mesh, replicated_share, replication_warning  # noqa: F401 (re-exported)
from dtp.errors import Diagnostic, PlanError
from dtp.placement import OPTIONS, STYLES, Placement, features, is_linear, module_fits, sharded_sizes
from dtp.resolve import Resolution, resolve, written_length

if TYPE_CHECKING:  # torch only where a model is checked: `dtp check PLAN` stays instant
    import torch.nn as nn

MAX_TP_SHOWN = 64  # "tp values that work" lists divisors up to this


def working_tp(size: int) -> str:
    """The tp values up to MAX_TP_SHOWN that divide `size`, as text."""
    values = [str(d) for d in range(1, MAX_TP_SHOWN + 1) if size % d == 0]
    return ", ".join(values)


def did_you_mean(word: str, choices: list[str]) -> str:
    """`; did you mean 'x'?` for the nearest choice, or nothing."""
    best = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    return f"; did you mean '{best[0]}'?" if best else ""


@dataclass(frozen=True)
class Checked:
    """A plan that passed `check` against a model: the resolution plus the tp it was checked for."""

    plan: ir.Plan
    resolution: Resolution | None
    tp: int | None
    admissible_tp: tuple[int, ...]  # every tp ≤ MAX_TP_SHOWN that satisfies all divisibility rules
    warnings: tuple[Diagnostic, ...] = ()  # problems that do not stop the plan (printed as `warning:`)


# ---- model-independent checks ----------------------------------------------------------------------

def _check_style(style: ir.Style, diags: list[Diagnostic]) -> None:
    if style.name not in STYLES:
        diags.append(Diagnostic(style.pos, f"unknown style '{style.name}'{did_you_mean(style.name, list(STYLES))}",
                                len(style.name)))
        return
    allowed = OPTIONS[style.name]
    seen: set[str] = set()
    for opt in style.options:
        if opt.key not in allowed:
            hint = did_you_mean(opt.key, list(allowed)) or (
                f"; {style.name} takes {', '.join(allowed)}" if allowed else f"; {style.name} takes no options")
            diags.append(Diagnostic(opt.pos, f"unknown option '{opt.key}' for {style.name}{hint}", len(opt.key)))
            continue
        if opt.key in seen:
            diags.append(Diagnostic(opt.pos, f"option '{opt.key}' given twice", len(opt.key)))
        seen.add(opt.key)
        kind, value = allowed[opt.key], opt.value
        if kind == "layout" and value == "shard":
            diags.append(Diagnostic(opt.value_pos, f"option '{opt.key}': shard needs the dimension, e.g. shard(1)", 5))
        elif kind == "layout" and not isinstance(value, ir.Layout):
            shown = str(value).lower() if isinstance(value, bool) else value
            diags.append(Diagnostic(opt.value_pos, f"option '{opt.key}' takes a layout (replicate, shard(DIM) or "
                                    f"partial), not '{shown}'{did_you_mean(str(shown), ['replicate', 'partial', 'shard'])}",
                                    len(str(shown))))
        elif kind == "bool" and not isinstance(value, bool):
            diags.append(Diagnostic(opt.value_pos, f"option '{opt.key}' takes true or false, not '{value}'", len(str(value))))
        elif kind == "parts" and not check_layouts.parts_option_ok(value):
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            diags.append(Diagnostic(opt.value_pos, f"option '{opt.key}' takes a positive integer or a part list "
                                    f"such as [q, kv, kv], not '{shown}'", len(shown)))
        elif kind == "index" and (isinstance(value, bool) or not isinstance(value, int)):
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            diags.append(Diagnostic(opt.value_pos, f"option '{opt.key}' takes a dimension index (0, 1, …), not "
                                    f"'{shown}'", len(shown)))
        elif kind == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            diags.append(Diagnostic(opt.value_pos, f"option '{opt.key}' takes a positive integer, not '{shown}'",
                                    len(shown)))


def check_syntax_level(plan: ir.Plan) -> list[Diagnostic]:
    """Style names, option names and option values: what needs no model."""
    diags: list[Diagnostic] = []
    rules, _, _ = ir.flatten(plan)
    for rule in rules:
        _check_style(rule.style, diags)
    return diags


# ---- model checks --------------------------------------------------------------------------------

def _packed(style: ir.Style) -> int:
    value = style.option("packed", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


class _Reporter:
    """Collapses one error per rule that repeats over many matched modules into a single diagnostic."""

    def __init__(self) -> None:
        self.groups: dict[tuple, list] = {}

    def add(self, pos: ir.Pos, length: int, path: str, message: str) -> None:
        self.groups.setdefault((pos, length, message), []).append(path)

    def diagnostics(self) -> list[Diagnostic]:
        out = []
        for (pos, length, message), paths in self.groups.items():
            more = f" (and {len(paths) - 1} more module{'s' if len(paths) > 2 else ''})" if len(paths) > 1 else ""
            out.append(Diagnostic(pos, f"{paths[0]}{more}: {message}", length))
        return out


def _attention_of(res: Resolution, path: str) -> tuple[str, nn.Module] | None:
    """The attention-like module that owns Linear `path` (its parent), if any."""
    from dtp import attention

    parent = path.rpartition(".")[0]
    module = res.modules.get(parent) if "." in path else None
    return (parent, module) if module is not None and attention.attention_like(module) else None


def _check_modules(res: Resolution, model: nn.Module, tp: int | None, rep: _Reporter, sizes: list[int]) -> bool:
    """Style fits, packed parts, divisibility and heads of every claimed module; False when a style does not fit."""
    from dtp import attention, models  # torch: only once a model is checked

    vocab = models.vocab_size(model)
    fits = True
    for path, rule in res.claims.items():
        module, style = res.modules[path], rule.style
        if style.name not in STYLES:
            continue
        kind = type(module).__name__
        length = len(style.name)
        problem = module_fits(style.name, module, vocab)
        if problem:
            rep.add(style.pos, length, path, f"{problem}; this module is {kind}")
            fits = False
            continue
        if style.name == "slice_input":
            check_slices.check_slice_input(path, style, module, res.modules[""], tp, rep, sizes)
            continue
        if style.name == "slice_params":
            check_slices.check_slice_params(path, style, module, res, tp, rep)
            continue
        if style.name == "sharded_norm":  # an RMS norm over colwise-sharded features (dtp/sharded_norm.py)
            from dtp.sharded_norm import check_sharded_norm
            before = len(rep.groups)
            check_sharded_norm(res, path, style, rep)
            if len(rep.groups) != before:
                fits = False
                continue
        if isinstance(style.option("packed"), ir.PartList):  # unequal or replicated parts (dtp/parts.py)
            before = len(rep.groups)
            check_layouts.check_parts(path, module, style, res.modules[""], tp, rep, sizes)
            fits = fits and len(rep.groups) == before  # parts that do not fit give no layout to follow
            continue
        packed = _packed(style)
        fan_in, fan_out = features(module) if is_linear(module) else (0, 0)
        owner = _attention_of(res, path) if style.name in ("colwise", "rowwise") else None
        info = attention.heads(model, *owner) if owner else None
        parts = attention.fused_parts(owner[1], module, info) if info and style.name == "colwise" else None
        if parts and packed > 1 and len(set(parts)) > 1:
            rep.add(style.pos, length, path, attention.unequal_parts_message(parts, packed, info, fan_out))
            continue
        if parts and packed not in (1, len(parts)):
            rep.add(style.pos, length, path, f"out_features={fan_out} holds {len(parts)} equal parts "
                    f"(q, k and v of {parts[0]}), not {packed}; use packed={len(parts)}")
            continue
        if packed > 1 and fan_out % packed:
            rep.add(style.pos, length, path, f"packed={packed} needs out_features={fan_out} to split into "
                    f"{packed} equal parts")
            continue
        for what, size in sharded_sizes(style.name, module, packed):
            if style.name == "vocab_parallel":  # uneven vocabulary shards are fine (torch.chunk layout)
                if tp and -(-size // tp) * (tp - 1) >= size:  # torch.chunk would leave the last ranks empty
                    good = [t for t in range(1, min(size, MAX_TP_SHOWN) + 1) if -(-size // t) * (t - 1) < size]
                    rep.add(style.pos, length, path, f"vocab_parallel shards {what} over tp={tp}, which leaves the "
                            f"last ranks without rows (torch.chunk layout); tp values up to {good[-1]} work")
                continue
            sizes.append(size)
            if tp and size % tp:
                rep.add(style.pos, length, path, f"{style.name} shards {what} over tp={tp}, which does not divide it; "
                        f"tp values that work: {working_tp(size)}")
        if info:
            width = fan_out // packed if style.name == "colwise" else fan_in
            if width % info.head_dim == 0:
                n = width // info.head_dim
                kv = n == info.n_kv_head != info.n_head
                what = "key/value heads" if kv else "attention heads"
                if not kv and n > info.n_head > 0 and n % info.n_head == 0:  # q, k, v fused per head (GPT-NeoX)
                    n, what = info.n_head, f"attention heads ({n // info.n_head} fused blocks each)"
                sizes.append(n)
                source = info.kv_source if kv else info.source
                if tp and n % tp:
                    per = " per packed part" if packed > 1 else ""
                    rep.add(style.pos, length, path, f"{n} {what}{per} (head size {info.head_dim}, {source}) do not "
                            f"divide by tp={tp}; each rank must hold whole heads; tp values that work: {working_tp(n)}")
    return fits


def _check_ties(res: Resolution, model: nn.Module, diags: list[Diagnostic]) -> None:
    owners: dict[int, list[tuple[str, str, Placement, ir.FlatRule | None]]] = {}
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
        diags.append(Diagnostic(where.pos if where else ir.NOWHERE,
                                f"{path_a}.{name_a} and {path_b}.{name_b} are one tied parameter but get different "
                                f"placements: {pl_a} ({why(rule_a)}) vs {pl_b} ({why(rule_b)}); {fix}",
                                len(str(where.pattern)) if where else 1))


class _ExprError(Exception):
    def __init__(self, pos: ir.Pos, message: str, length: int = 1):
        super().__init__(message)
        self.pos, self.message, self.length = pos, message, length


def evaluate(expr: ir.Expr, lookup) -> int | None:
    """Integer value of a set expression; `lookup(Var)` gives a name's value (None: unknown yet)."""
    if isinstance(expr, ir.Num):
        return expr.value
    if isinstance(expr, ir.Var):
        return lookup(expr)
    left, right = evaluate(expr.left, lookup), evaluate(expr.right, lookup)
    if left is None or right is None:
        return None
    if expr.op == "+":
        return left + right
    if expr.op == "-":
        return left - right
    if expr.op == "*":
        return left * right
    if right == 0:
        raise _ExprError(expr.pos, "division by zero")
    if left % right:
        raise _ExprError(expr.pos, f"{left} / {right} does not divide exactly")
    return left // right


def int_attributes(module: object) -> dict[str, int]:
    """The module's (or a held object's) integer attributes (what a set expression may name)."""
    return {k: v for k, v in vars(module).items() if isinstance(v, int) and not isinstance(v, bool)}


def set_target(module: nn.Module, attr: str) -> tuple[object, str]:
    """(the object a `set` rewrites, its attribute): the module itself, or for `HOLDER.ATTR` the plain object
    it holds (dtp.resolve.holder_paths); a set expression's bare names read that object's attributes."""
    from dtp.resolve import held_object

    holder, _, name = attr.rpartition(".")
    return (held_object(module, holder), name) if holder else (module, attr)


def _check_sets(res: Resolution, tp: int | None, rep: _Reporter, plan: ir.Plan) -> None:
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
                    raise _ExprError(var.pos, err.diagnostic.message, len(var.name)) from None
            if var.name not in attrs:
                raise _ExprError(var.pos, f"unknown name '{var.name}': {type(module).__name__} has no integer attribute "
                                 f"of that name{did_you_mean(var.name, list(attrs) + ['tp'])}", len(var.name))
            return attrs[var.name]

        try:
            value = evaluate(stmt.expr, lookup)
        except _ExprError as err:
            extra = f" at tp={tp}" if tp and err.message.endswith(("exactly", "zero")) else ""
            rep.add(err.pos, err.length, shown, err.message + extra)
            continue
        if value is not None and value < 1:
            rep.add(stmt.pos, 3, shown, f"set {attr} evaluates to {value}; it must be a positive integer")


def _check_flow(res: Resolution, model: nn.Module, rep: _Reporter) -> None:
    """Follow the activations' layouts through the model (dtp/flow.py)."""
    from dtp import flow, models
    from dtp.compiler import _module_layout  # the compiler imports this module

    sp = any(rule.style.name == "sequence_parallel" for rule in res.claims.values())
    layouts = {path: m for path, rule in res.claims.items()
               if (m := _module_layout(rule.style, res.modules[path], sp)) is not None}
    flow.analyse(res, sp, layouts, models.vocab_size(model), rep.add)


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
        res = resolve(plan, model, cond_tp)
        structural = bool(diags or res.diagnostics)
        diags += res.diagnostics
        rep = _Reporter()
        fits = _check_modules(res, model, tp, rep, sizes)
        if fits:  # a norm left whole over a sharded output: the flow walk would only echo it
            from dtp.attention import check_per_head_lists
            from dtp.partial_grads import check_partial_grads
            from dtp.sharded_norm import check_unsharded_norms
            before = len(rep.groups)
            check_unsharded_norms(res, rep)
            check_per_head_lists(res, model, tp, rep)
            if len(rep.groups) == before:  # a per-head list's norms would only echo it
                check_partial_grads(res, model, tp, rep)
            fits = len(rep.groups) == before
        if fits and not structural:  # layouts of styles that do not apply would only echo those errors
            _check_flow(res, model, rep)
        _check_sets(res, tp, rep, plan)
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
