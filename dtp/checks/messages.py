"""How check rules report: one diagnostic per rule that fails on many matched modules, and the tp
values that would work."""

from __future__ import annotations

from dtp.errors import Diagnostic, Pos

MAX_TP_SHOWN = 64  # "tp values that work" lists divisors up to this


def working_tp(size: int) -> str:
    """The tp values up to MAX_TP_SHOWN that divide `size`, as text."""
    values = [str(d) for d in range(1, MAX_TP_SHOWN + 1) if size % d == 0]
    return ", ".join(values)


class Reporter:
    """Collapses one error per rule that repeats over many matched modules into a single diagnostic."""

    def __init__(self) -> None:
        self.groups: dict[tuple, list] = {}

    def add(self, pos: Pos, length: int, path: str, message: str) -> None:
        """Record `message` for the module at `path`, reported at `pos`."""
        self.groups.setdefault((pos, length, message), []).append(path)

    def diagnostics(self) -> list[Diagnostic]:
        """One diagnostic per (position, message), naming the first module and how many more."""
        out = []
        for (pos, length, message), paths in self.groups.items():
            more = (
                f" (and {len(paths) - 1} more module{'s' if len(paths) > 2 else ''})"
                if len(paths) > 1
                else ""
            )
            out.append(Diagnostic(pos, f"{paths[0]}{more}: {message}", length))
        return out
