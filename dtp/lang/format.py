"""Plan IR → canonical .tp text (`dtp fmt`): four-space blocks, one blank line kept, comments kept."""

from __future__ import annotations

from dtp.errors import Pos
from dtp.lang import ir

INDENT = "    "
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def format_option(opt: ir.Option) -> str:
    """`key=value` as written canonically."""
    value = opt.value
    if isinstance(value, bool):
        text = "true" if value else "false"
    else:
        text = str(value)
    return f"{opt.key}={text}"


def format_style(style: ir.Style) -> str:
    """`name` or `name(k=v, ...)`."""
    if not style.options:
        return style.name
    return f"{style.name}({', '.join(format_option(o) for o in style.options)})"


def format_expr(expr: ir.Expr, parent: int = 0, right: bool = False) -> str:
    """An expression with the fewest parentheses that still parse back to the same tree."""
    if isinstance(expr, ir.Num):
        return str(expr.value)
    if isinstance(expr, ir.Var):
        return expr.name
    prec = _PRECEDENCE[expr.op]
    text = f"{format_expr(expr.left, prec)} {expr.op} {format_expr(expr.right, prec, right=True)}"
    # Operators are left-associative: a right operand of equal precedence needs parentheses.
    needs = prec < parent or (right and prec == parent)
    return f"({text})" if needs else text


def format_statement(stmt: ir.Rule | ir.SetAttr) -> str:
    """One rule or set statement on one line."""
    if isinstance(stmt, ir.Rule):
        return f"{stmt.pattern}: {format_style(stmt.style)}"
    target = f"{stmt.pattern}.{stmt.attr}" if stmt.pattern.segments else stmt.attr
    return f"set {target} = {format_expr(stmt.expr)}"


class _Writer:
    """Emits lines, re-inserting comments and single blank lines by their source line numbers."""

    def __init__(self, plan: ir.Plan, source: str | None):
        self.lines: list[str] = []
        self.standalone = sorted(
            (c for c in plan.comments if not c.trailing), key=lambda c: c.pos.line
        )
        self.trailing = {c.pos.line: c.text for c in plan.comments if c.trailing}
        src = source.split("\n") if source is not None else []
        self.blank = {n for n, line in enumerate(src, 1) if not line.strip()}
        self.last_line = 0  # last source line accounted for

    def _gap_has_blank(self, upto: int) -> bool:
        return any(self.last_line < n < upto for n in self.blank)

    def comments_before(self, line: int, indent: str, blank: bool = False) -> bool:
        """Standalone comments above source `line`, with a blank line where the source had one (or
        where `blank` asks for one before the first); returns whether that blank is still owed."""
        while self.standalone and (line <= 0 or self.standalone[0].pos.line < line):
            comment = self.standalone.pop(0)
            if (
                (blank or self._gap_has_blank(comment.pos.line))
                and self.lines
                and self.lines[-1]
                and not self.lines[-1].endswith("{")
            ):
                self.lines.append("")
            blank = False
            self.lines.append(indent + comment.text)
            self.last_line = comment.pos.line
        return blank

    def emit(self, text: str, pos: Pos, indent: str, blank_before: bool = False) -> None:
        """A line of code for the statement that started at `pos`."""
        if pos.line > 0:
            blank_before = self.comments_before(
                pos.line, indent, blank_before
            ) or self._gap_has_blank(pos.line)
        if blank_before and self.lines and self.lines[-1] and not self.lines[-1].endswith("{"):
            self.lines.append("")
        comment = self.trailing.pop(pos.line, None) if pos.line > 0 else None
        self.lines.append(indent + text + (f"  {comment}" if comment else ""))
        self.last_line = max(self.last_line, pos.line)


def format_plan(plan: ir.Plan, source: str | None = None) -> str:
    """Canonical text of `plan`; `source` (the text it was parsed from) locates its blank lines."""
    w = _Writer(plan, source)
    w.emit(f"dtp {plan.version}", plan.version_pos, "")
    if plan.name is not None:
        version = f" version {plan.plan_version}" if plan.plan_version is not None else ""
        w.emit(f"plan {plan.name}{version}", plan.plan_pos, "")
    if plan.mesh != ("tp",) or plan.mesh_pos.line > 0:
        w.emit(f"mesh {', '.join(plan.mesh)}", plan.mesh_pos, "")

    def close(end: Pos, indent: str, text: str) -> None:
        # the comments inside a body before its closing brace, then the brace line
        if end.line > 0:
            w.comments_before(end.line, indent + INDENT)
            w.last_line = max(w.last_line, end.line)
        comment = w.trailing.pop(end.line, None) if end.line > 0 else None
        w.lines.append(indent + text + (f"  {comment}" if comment else ""))

    def body(stmts: tuple[ir.Statement, ...], indent: str, first_blank: bool) -> None:
        for i, stmt in enumerate(stmts):
            blank = first_blank and i == 0
            if isinstance(stmt, ir.Block):
                w.emit(f"{stmt.pattern} {{", stmt.pos, indent, blank)
                body(stmt.body, indent + INDENT, False)
                close(stmt.end, indent, "}")
            elif isinstance(stmt, ir.When):
                w.emit(f"when {stmt.condition} {{", stmt.pos, indent, blank)
                body(stmt.body, indent + INDENT, False)
                if stmt.orelse is None:
                    close(stmt.end, indent, "}")
                    continue
                close(stmt.end, indent, "} else {")
                body(stmt.orelse, indent + INDENT, False)
                close(stmt.else_end, indent, "}")
            else:
                w.emit(format_statement(stmt), stmt.pos, indent, blank)

    body(plan.body, "", True)
    w.comments_before(0, "")
    return "\n".join(w.lines) + "\n"
