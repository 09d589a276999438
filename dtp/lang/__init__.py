"""The plan language: text ⇄ plan IR.

Input: a `.tp` file's text. Output: a frozen, positioned `ir.Plan` (`parse.parse`, `load`),
canonical text (format), the values of `when` conditions and `set` expressions. Imports `dtp.errors`
and `dtp.files` only; never torch. Modules: ir (the IR), parse (Lark grammar → IR, positioned
errors), format, vocabulary (styles and their options), conditions (`when`), expr (`set`
arithmetic).
"""

from dtp.lang.format import format_plan
from dtp.lang.parse import load, read_plan_text

__all__ = ["format_plan", "load", "read_plan_text"]
