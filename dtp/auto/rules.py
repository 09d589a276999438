"""What `dtp plan --auto` writes for one part of a model: rule lines with the fact each was found
from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    """One statement of the plan: `PATH: STYLE` or `set PATH = EXPR`, with the comment saying why."""

    path: str  # relative to the block it sits in ("" for the block's own module)
    text: str  # the style ("colwise(packed=3)") or, for a set, the expression
    why: str
    is_set: bool = False

    def render(self, prefix: str = "") -> str:
        """The statement as plan text (without indentation)."""
        path = ".".join(p for p in (prefix, self.path) if p)
        body = f"set {path} = {self.text}" if self.is_set else f"{path}: {self.text}"
        return f"{body}  # {self.why}" if self.why else body


@dataclass(frozen=True)
class Unit:
    """The rules for one module of a block (an attention, an MLP, experts), or why it stays
    replicated."""

    owner: str  # path relative to the block
    kind: str  # "attention", "mlp" or "experts"
    lines: tuple[Line, ...] = ()
    refused: str = ""  # non-empty: the module stays whole on every rank, for this reason

    def refuse(self, why: str) -> "Unit":
        """This unit without rules, kept replicated for `why`."""
        return Unit(self.owner, self.kind, (), why)

    def render(self, prefix: str = "") -> list[str]:
        """The unit's statements (or its one comment when refused)."""
        if self.refused:
            where = ".".join(p for p in (prefix, self.owner) if p) or "this block"
            return [f"# {where} stays replicated: {self.refused}"]
        return [line.render(prefix) for line in self.lines]
