"""`set` arithmetic: the integer value of a set expression (`num_heads / tp`), exact or an error."""

from __future__ import annotations

from typing import Callable

from dtp.errors import Pos
from dtp.lang import ir


class ExprError(Exception):
    """A set expression that has no integer value (division by zero, an inexact division, an unknown
    name)."""

    def __init__(self, pos: Pos, message: str, length: int = 1):
        super().__init__(message)
        self.pos, self.message, self.length = pos, message, length


def evaluate(expr: ir.Expr, lookup: Callable[[ir.Var], int | None]) -> int | None:
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
        raise ExprError(expr.pos, "division by zero")
    if left % right:
        raise ExprError(expr.pos, f"{left} / {right} does not divide exactly")
    return left // right
