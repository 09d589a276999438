"""The layout flow inside a branch whose forward the source reveals (dtp/layout/forward_source.py):
each leaf reads the outputs it really reads, and where outputs meet (q, k and v in the attention's
own code, gate and up in the MLP's product) their layouts must agree."""

from __future__ import annotations

from typing import Protocol

from dtp.checks.activations import Act
from dtp.layout.forward_source import BranchSources
from dtp.layout.styles import Style


class Walk(Protocol):
    """The parts of the layout walk (dtp/checks/flow.py) a branch's data flow needs."""

    def step(self, path: str, got: Act) -> Act | None:
        """The activation after module `path` reads `got`; None after a reported problem."""

    def style(self, path: str) -> str | None:
        """The style of the rule that claims `path`, if any."""

    def rel(self, path: str, anchor: str | None) -> str:
        """`path` relative to the block that holds `anchor` too."""

    def fail(self, subject: str, message: str, *candidates: str | None) -> None:
        """Report `message` about `subject` at the rule of the first claimed candidate."""


def meet_by_source(walk: Walk, sources: BranchSources, start: Act) -> Act | None:
    """Walk `sources`' leaves from `start` (the branch's input); the branch's result, None after a
    problem."""
    outs: dict[str, Act] = {}
    for path, reads in sources.reads:
        got = _meet(walk, reads, outs, path, sources.parent) if reads else start
        if got is None:
            return None
        got = walk.step(path, got)
        if got is None:
            return None
        outs[path] = got
    return _meet(walk, sources.result, outs, None, sources.parent)


def _meet(
    walk: Walk, paths: tuple[str, ...], outs: dict[str, Act], consumer: str | None, parent: str
) -> Act | None:
    """The one activation the outputs of `paths` make together, or None once their disagreement is
    reported."""
    acts = [outs[p] for p in paths]
    first = acts[0]
    if all((a.layout, a.dtensor) == (first.layout, first.dtensor) for a in acts):
        return next((a for a in acts if a.producer), first)
    odd = next(
        p for p, a in zip(paths, acts) if (a.layout, a.dtensor) != (first.layout, first.dtensor)
    )
    a_path, b_path = paths[0], odd
    a_style, b_style = walk.style(a_path), walk.style(b_path)
    if a_style == b_style == Style.COLWISE:  # q/k/v, gate/up: colwise siblings must hand on alike
        walk.fail(
            b_path,
            f"colwise siblings hand on different layouts: {outs[b_path].describe()} here, "
            f"{outs[a_path].describe()} from {walk.rel(a_path, b_path)}; give them the same output "
            "and local "
            "options",
            b_path,
        )
        return None
    where = (
        f"before {walk.rel(consumer, consumer)}"
        if consumer
        else f"in the result of {walk.rel(parent, parent)}"
    )
    if a_style is None or b_style is None:
        plain, sharded = (a_path, b_path) if a_style is None else (b_path, a_path)
        rel_plain, rel_sharded, style = (
            walk.rel(plain, sharded),
            walk.rel(sharded, plain),
            walk.style(sharded),
        )
        walk.fail(
            plain,
            f"not sharded, but its output and {rel_sharded}'s are combined {where}: {rel_sharded} "
            f"({style}) hands "
            f"on {outs[sharded].describe()}, {rel_plain} {outs[plain].describe()}, which cannot be "
            "combined; "
            f"shard it as {rel_sharded} is (`{rel_plain}: {style}`), or leave {rel_sharded} whole",
            sharded,
        )
        return None
    walk.fail(
        b_path,
        f"its output ({outs[b_path].describe()}) meets {walk.rel(a_path, b_path)}'s "
        f"({outs[a_path].describe()}) {where}, and the two cannot be combined; give them the same "
        "layout",
        b_path,
        a_path,
    )
    return None
