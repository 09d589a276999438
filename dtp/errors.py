"""User-facing errors: positioned plan diagnostics (exit 2), usage errors (exit 2), run failures
(exit 1)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass


@dataclass(frozen=True)
class Pos:
    """A place in a plan file: 1-based line and column."""

    file: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


NOWHERE = Pos("<plan>", 0, 0)


def did_you_mean(word: str, choices: list[str], cutoff: float = 0.5, prefix: str = "") -> str:
    """`; did you mean 'x'?` for the choice nearest `word` (difflib ratio ≥ `cutoff`), or nothing."""
    best = difflib.get_close_matches(word, choices, n=1, cutoff=cutoff)
    return f"; did you mean '{prefix}{best[0]}'?" if best else ""


MAX_SHOWN = 50  # diagnostics rendered per file; the count says how many there were


@dataclass(frozen=True)
class Diagnostic:
    """One `FILE:LINE:COL: error: MESSAGE` (or `warning:`), underlining `length` characters at
    `pos`."""

    pos: Pos
    message: str
    length: int = 1
    severity: str = "error"  # "error" (exit 2) or "warning" (printed; the plan still passes)

    def render(self, source: str | None) -> str:
        """The message, then the source line and a caret under the offending text."""
        head = f"{self.pos}: {self.severity}: {self.message}"
        if not source or self.pos.line <= 0:
            return head
        lines = source.split("\n")  # as the grammar counts lines
        if self.pos.line > len(lines):
            return head
        line = lines[self.pos.line - 1].rstrip("\r").expandtabs(1)
        if len(line) > 200:  # a 1 MB line is not worth echoing
            start = max(0, self.pos.column - 60)
            line = line[start : start + 120]
            col = self.pos.column - start
        else:
            col = self.pos.column
        caret = " " * (col - 1) + "^" + "~" * max(0, min(self.length, len(line) - col + 1) - 1)
        return f"{head}\n    {line}\n    {caret}"


class DtpError(Exception):
    """Base of the errors dtp reports to a user without a traceback."""

    exit_code = 2

    def render(self) -> str:
        """The text printed to stderr."""
        return f"error: {self}"


class UsageError(DtpError):
    """A bad flag, model spec or file: one paragraph, exit 2."""


class PlanError(DtpError):
    """One or more positioned errors in a plan file (all semantic errors of a file are collected)."""

    def __init__(self, diagnostics: list[Diagnostic], source: str | None = None):
        self.diagnostics = sorted(diagnostics, key=lambda d: (d.pos.line, d.pos.column))
        self.source = source
        super().__init__("; ".join(f"{d.pos}: {d.message}" for d in self.diagnostics))

    def render(self) -> str:
        """The first MAX_SHOWN diagnostics with their source excerpts, then a count."""
        parts = [d.render(self.source) for d in self.diagnostics[:MAX_SHOWN]]
        n = len(self.diagnostics)
        if n > MAX_SHOWN:
            parts.append(f"... and {n - MAX_SHOWN} more")
        if n > 1:
            parts.append(f"{n} errors")
        return "\n".join(parts)


class RunError(DtpError):
    """A sharded run that raised, crashed or timed out: exit 1. `rank`, `where` and `error` say
    which rank failed first, in which module or phase, and what it raised (None for a timeout)."""

    exit_code = 1

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        where: str | None = None,
        error: str | None = None,
    ):
        super().__init__(message)
        self.rank, self.where, self.error = rank, where, error


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every `finally` (ranks, temp dirs) runs before dtp exits."""


def clip(text: str, limit: int = 300) -> str:
    """`text` cut to `limit` characters (an exception's message, a file's contents)."""
    return text if len(text) <= limit else text[:limit] + " …"


def shorten(value: object, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: a user's value never floods a message."""
    text = repr(value) if not isinstance(value, str) else f"'{value}'"
    return text if len(text) <= limit else text[: limit - 5] + " …" + text[-2:]
