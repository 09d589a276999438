"""The plan IR: immutable, typed nodes that remember where in the source they came from.

Positions are excluded from equality so that a plan formatted and parsed again compares equal to the
original (the round-trip property the tests check).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

from dtp.errors import NOWHERE, Pos


def _pos() -> Pos:
    return field(default=NOWHERE, compare=False, repr=False)


# ---- patterns ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexRange:
    """An inclusive range of integer segment values, written `[lo..hi]`."""

    lo: int
    hi: int

    def __str__(self) -> str:
        return f"[{self.lo}..{self.hi}]"


Segment = Union[str, IndexRange]  # a name with fnmatch `*`/`?`, the literal "**", or a range


@dataclass(frozen=True)
class Pattern:
    """A dotted module path pattern, relative to the enclosing block (if any)."""

    segments: tuple[Segment, ...]
    pos: Pos = _pos()

    def __str__(self) -> str:
        return ".".join(str(s) for s in self.segments)

    def joined(self, inner: Pattern) -> Pattern:
        """This pattern followed by `inner` (a block prefix applied to a rule inside it)."""
        return Pattern(self.segments + inner.segments, inner.pos)


# ---- styles -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A DTensor placement named in a plan: replicate, shard(dim) or partial."""

    kind: str  # "replicate" | "shard" | "partial"
    dim: int | None = None

    def __str__(self) -> str:
        return f"shard({self.dim})" if self.kind == "shard" else self.kind


@dataclass(frozen=True)
class PartList:
    """`[q, replicate(kv), 32]`: the packed parts of a sharded dimension, in order (see
    dtp/layout/parts.py)."""

    items: tuple[Union[int, str], ...]

    def __str__(self) -> str:
        return "[" + ", ".join(str(i) for i in self.items) + "]"


OptionValue = Union[int, bool, Layout, str, PartList]


@dataclass(frozen=True)
class Option:
    """One `KEY=VALUE` argument of a style; unchecked values stay strings until `check`."""

    key: str
    value: OptionValue
    pos: Pos = _pos()
    value_pos: Pos = _pos()


@dataclass(frozen=True)
class Style:
    """A parallel style applied to the modules a rule matches, e.g. `colwise(packed=3)`."""

    name: str
    options: tuple[Option, ...] = ()
    pos: Pos = _pos()

    def option(self, key: str, default: OptionValue | None = None) -> OptionValue | None:
        """The value of option `key`, or `default` when the plan does not give it."""
        for opt in self.options:
            if opt.key == key:
                return opt.value
        return default


# ---- expressions (set statements) ----------------------------------------------------------------------


@dataclass(frozen=True)
class Num:
    """An integer literal."""

    value: int
    pos: Pos = _pos()


@dataclass(frozen=True)
class Var:
    """An attribute of the matched module, `config.ATTR` (the model's config), or `tp`."""

    name: str
    pos: Pos = _pos()

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class BinOp:
    """`left OP right` with OP one of + - * / (exact integer division)."""

    op: str
    left: Expr
    right: Expr
    pos: Pos = _pos()


Expr = Union[Num, Var, BinOp]


# ---- statements -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """`PATTERN: STYLE`."""

    pattern: Pattern
    style: Style
    pos: Pos = _pos()


@dataclass(frozen=True)
class SetAttr:
    """`set PATTERN.ATTR = EXPR`: rewrite an integer attribute of every matched module, per rank."""

    pattern: Pattern  # the modules
    attr: str
    expr: Expr
    pos: Pos = _pos()


@dataclass(frozen=True)
class Block:
    """`PATTERN { ... }`: the statements inside are relative to PATTERN."""

    pattern: Pattern
    body: tuple[Statement, ...]
    pos: Pos = _pos()
    end: Pos = _pos()  # the closing brace


@dataclass(frozen=True)
class ConfigRef:
    """`config.ATTR`: an attribute of the model's config, read when the plan meets a model."""

    name: str
    pos: Pos = _pos()

    def __str__(self) -> str:
        return f"config.{self.name}"


@dataclass(frozen=True)
class Literal:
    """An integer, `true` or `false` in a condition."""

    value: Union[int, bool]
    pos: Pos = _pos()

    def __str__(self) -> str:
        return str(self.value).lower() if isinstance(self.value, bool) else str(self.value)


Operand = Union[ConfigRef, Literal, "Var"]  # Var: only `tp`


@dataclass(frozen=True)
class Condition:
    """`LEFT` (truthiness) or `LEFT OP RIGHT` with OP one of == != < <= > >=."""

    left: Operand
    op: str | None = None
    right: Operand | None = None
    pos: Pos = _pos()

    def __str__(self) -> str:
        return str(self.left) if self.op is None else f"{self.left} {self.op} {self.right}"


@dataclass(frozen=True)
class When:
    """`when CONDITION { ... } else { ... }`: the branch the model's config selects (see
    dtp/lang/conditions.py)."""

    condition: Condition
    body: tuple[Statement, ...]
    orelse: tuple[Statement, ...] | None = None  # None: no else branch
    pos: Pos = _pos()
    end: Pos = _pos()  # the closing brace of the body
    else_end: Pos = _pos()  # the closing brace of the else branch


Statement = Union[Rule, SetAttr, Block, When]


@dataclass(frozen=True)
class Comment:
    """A `#` comment, kept so that `dtp fmt` can put it back."""

    text: str
    pos: Pos
    trailing: bool  # True when code precedes it on its line


@dataclass(frozen=True)
class Plan:
    """A whole `.tp` file."""

    version: int
    body: tuple[Statement, ...]
    name: str | None = None
    plan_version: int | None = None
    mesh: tuple[str, ...] = ("tp",)
    file: str = field(default="<plan>", compare=False)
    comments: tuple[Comment, ...] = field(default=(), compare=False, repr=False)
    # the text, for error excerpts
    source: str | None = field(default=None, compare=False, repr=False)
    # Where the header statements were, for error messages.
    version_pos: Pos = _pos()
    mesh_pos: Pos = _pos()
    plan_pos: Pos = _pos()


@dataclass(frozen=True)
class FlatRule:
    """A rule with its block prefixes applied: what `resolve` matches against module paths."""

    pattern: Pattern
    style: Style
    pos: Pos


@dataclass(frozen=True)
class FlatSet:
    """A `set` statement with its block prefixes applied."""

    pattern: Pattern
    attr: str
    expr: Expr
    pos: Pos


def flatten(
    plan: Plan, choose: Callable[[When], bool | None] | None = None
) -> tuple[list[FlatRule], list[FlatSet], list[Pattern]]:
    """Rules and sets with absolute patterns, plus every block prefix (each must match something).

    `choose` picks the branch of each `when` (True: its body, False: its else, None: neither, for a
    condition that could not be evaluated); without it both branches count (checks that need no
    model)."""
    rules: list[FlatRule] = []
    sets: list[FlatSet] = []
    blocks: list[Pattern] = []

    def walk(body: tuple[Statement, ...], prefix: Pattern | None) -> None:
        for stmt in body:
            if isinstance(stmt, When):
                taken = (True, False) if choose is None else (choose(stmt),)
                for branch in taken:
                    inner = (
                        stmt.body if branch is True else stmt.orelse if branch is False else None
                    )
                    walk(inner or (), prefix)
                continue
            pattern = stmt.pattern if prefix is None else prefix.joined(stmt.pattern)
            if isinstance(stmt, Rule):
                rules.append(FlatRule(pattern, stmt.style, stmt.pos))
            elif isinstance(stmt, SetAttr):
                sets.append(FlatSet(pattern, stmt.attr, stmt.expr, stmt.pos))
            else:
                blocks.append(pattern)
                walk(stmt.body, pattern)

    walk(plan.body, None)
    return rules, sets, blocks
