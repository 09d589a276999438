"""`when config.ATTR { ... } else { ... }`: which branch a model's config selects.

A condition reads attributes of the model's config object (`config`, `model_args` or `args`, as the
head counts do): `when config.multi_query` (truthiness) or `when config.num_key_value_heads < tp`
(== != < <= > >= between integers, booleans, `config.ATTR` and `tp`, the size of the tp mesh
dimension). Only integers, booleans and None can be read: a plan is data, so a condition never calls
anything, and an attribute the config lacks is an error with its position (and the nearest name),
never a silent else.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Callable

from dtp.errors import Diagnostic, did_you_mean
from dtp.lang import ir

if TYPE_CHECKING:
    import torch.nn as nn

_OPS: dict[str, Callable[[object, object], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


class ConditionError(ValueError):
    """A condition that cannot be evaluated on this model; carries the diagnostic."""

    def __init__(self, diagnostic: Diagnostic):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


# where models keep their config (HF, Meta's Llama, nanoGPT-likes)
CONFIG_ATTRS = ("config", "model_args", "args")


def model_config(model: nn.Module) -> object | None:
    """The model's config object: the first of CONFIG_ATTRS it has."""
    for attr in CONFIG_ATTRS:
        config = getattr(model, attr, None)
        if config is not None:
            return config
    return None


def _public_names(config: object) -> list[str]:
    names = set(getattr(config, "__dict__", {}))
    if isinstance(config, dict):
        names |= set(config)
    return sorted(n for n in names if isinstance(n, str) and not n.startswith("_"))


def _read(operand: ir.Operand, config: object | None, tp: int | None = None) -> int | bool | None:
    if isinstance(operand, ir.Literal):
        return operand.value
    if isinstance(operand, ir.Var):  # `tp`
        if tp is None:
            raise ConditionError(
                Diagnostic(
                    operand.pos,
                    "this condition reads `tp`: give the tp the plan runs at (--tp N)",
                    2,
                )
            )
        return tp
    where = len(str(operand))
    if config is None:
        raise ConditionError(
            Diagnostic(
                operand.pos,
                f"`{operand}`: this model has no config object to read "
                "(a `when` condition reads `model.config`)",
                where,
            )
        )
    # vars(), not getattr: a property or a method on the config would run code a plan names
    names = _public_names(config)
    # Hugging Face configs alias standard names (GPT-2's num_attention_heads is n_head)
    aliases = getattr(type(config), "attribute_map", None)
    name = aliases.get(operand.name, operand.name) if isinstance(aliases, dict) else operand.name
    found = (
        config.get(name, KeyError)
        if isinstance(config, dict)
        else getattr(config, "__dict__", {}).get(name, KeyError)
    )
    if found is KeyError or operand.name.startswith("_"):
        hint = did_you_mean(operand.name, names, cutoff=0.6, prefix="config.")
        raise ConditionError(
            Diagnostic(
                operand.pos, f"the model's config has no attribute '{operand.name}'{hint}", where
            )
        )
    if found is not None and not isinstance(found, (bool, int)):
        shown = repr(found) if len(repr(found)) <= 40 else repr(found)[:37] + "..."
        raise ConditionError(
            Diagnostic(
                operand.pos,
                f"`{operand}` is {shown} ({type(found).__name__}); a condition "
                "compares integers and booleans",
                where,
            )
        )
    return found


def holds(cond: ir.Condition, config: object | None, tp: int | None = None) -> bool:
    """Whether `cond` holds for `config` at `tp`; ConditionError (with a position) when it cannot be
    read."""
    left = _read(cond.left, config, tp)
    if cond.op is None:
        return bool(left)
    right = _read(cond.right, config, tp)  # type: ignore[arg-type]
    if cond.op not in ("==", "!=") and (
        left is None or right is None or isinstance(left, bool) or isinstance(right, bool)
    ):
        raise ConditionError(
            Diagnostic(
                cond.pos,
                f"`{cond}` orders {left!r} and {right!r}; < <= > >= compare integers",
                len(str(cond)),
            )
        )
    return _OPS[cond.op](left, right)


def chooser(
    model: nn.Module, diags: list[Diagnostic], tp: int | None = None
) -> Callable[[ir.When], bool | None]:
    """A branch picker for `ir.flatten`: errors go to `diags` (once each) and take neither branch."""
    config = model_config(model)
    seen: set = set()

    def choose(when: ir.When) -> bool | None:
        try:
            return holds(when.condition, config, tp)
        except ConditionError as err:
            key = (err.diagnostic.pos, err.diagnostic.message)
            if key not in seen:
                seen.add(key)
                diags.append(err.diagnostic)
            return None

    return choose


def config_int(model: nn.Module, var: ir.Var) -> int:
    """The value of `config.ATTR` in a set expression: an integer of the model's config (not a
    boolean)."""
    ref = ir.ConfigRef(var.name[len("config.") :], var.pos)
    value = _read(ref, model_config(model))
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConditionError(
            Diagnostic(
                var.pos, f"`{ref}` is {value!r}; a set expression needs an integer", len(var.name)
            )
        )
    return value


def _whens(body: tuple) -> list[ir.When]:
    out: list[ir.When] = []
    for stmt in body:
        if isinstance(stmt, ir.When):
            out += [stmt, *_whens(stmt.body), *_whens(stmt.orelse or ())]
        elif isinstance(stmt, ir.Block):
            out += _whens(stmt.body)
    return out


def reads_tp(plan: ir.Plan) -> bool:
    """Whether some `when` condition of `plan` reads `tp` (its branches depend on the mesh)."""
    return any(
        isinstance(op, ir.Var)
        for w in _whens(plan.body)
        for op in (w.condition.left, w.condition.right)
    )


def branches(plan: ir.Plan, config: object | None, tp: int) -> tuple:
    """Which way every `when` of `plan` goes at `tp` (None where it cannot be evaluated)."""
    out = []
    for when in _whens(plan.body):
        try:
            out.append(holds(when.condition, config, tp))
        except ConditionError:
            out.append(None)
    return tuple(out)
