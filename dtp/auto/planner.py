"""`dtp plan --auto`: write a plan from a model's structure, then let `dtp check` judge it.

The draft (dtp/auto/attention.py, ffn.py) is written for one tp. The checker then runs on it; every
unit a diagnostic points into is left replicated with the checker's own words as the reason, and the
plan is checked again, until it passes. What reaches the user is a plan the checker accepts at every
tp its header names; `--verify` adds the parity proof of `dtp apply`.

The planner's work grows linearly with the blocks: the model is read once (dtp/auto/structure.py's
Reading), each block's pairs are found once for every tp, another tp is tried on each group's first
block before all of them, and the checker runs once per round and once per other tp claimed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.nn as nn

from dtp.auto.attention import attention_unit
from dtp.auto.ffn import experts_unit, mlp_unit
from dtp.auto.rules import Line, Unit
from dtp.auto.structure import Reading
from dtp.checks.checker import Checked, check
from dtp.checks.messages import MAX_TP_SHOWN
from dtp.cost.param_bytes import replicated_fraction
from dtp.errors import PlanError, UsageError
from dtp.lang.parse import parse
from dtp.layout.norms import is_norm

_MAX_ROUNDS = 64  # each round replicates at least one unit; a model has few kinds of unit


@dataclass(frozen=True)
class AutoPlan:
    """The plan text, the tp it was written for, and every tp `dtp check` accepts it at."""

    text: str
    tp: int
    checked_tp: tuple[int, ...]
    refused: tuple[str, ...]  # "PATH: why" of every part left replicated
    # "blocks split 2/2, attention whole in 0, MLP whole in 0; 12.5 % of the bytes on every rank"
    summary: str = ""


@dataclass(frozen=True)
class _Group:
    """Consecutive blocks with the same rules: `prefix` is their pattern (`model.layers.*`,
    `h.[0..3]`)."""

    prefix: str
    units: tuple[Unit, ...]
    first: str  # the path of its first block


def block_units(reading: Reading, path: str, tp: int, sp: bool = False) -> list[Unit]:
    """The units of block `path`: each attention and MLP pair, each experts module, each module
    whose linears form no pair (replicated, with the reason) and, with `sp`, its residual-stream
    norms."""
    block = reading.modules[path]
    parts = reading.parts(path)
    units = []
    if sp:
        norms = tuple(
            Line(
                n,
                "sequence_parallel",
                f"residual-stream {'norm' if is_norm(c) else 'dropout'}: runs on "
                "this rank's tokens",
            )
            for n, c in block.named_children()
            if is_norm(c) or _dropout(c)
        )
        units.append(Unit("", "sequence", norms))
    for pair, attention in parts.pairs:
        owner = f"{path}.{pair.owner}" if pair.owner else path
        module = reading.modules[owner]
        if attention:
            units.append(attention_unit(reading, owner, module, pair, tp))
        else:
            units.append(mlp_unit(reading, module, pair, tp))
    units += [experts_unit(p, block.get_submodule(p), tp) for p in parts.experts]
    # linears that form no pair: say so, never guess, never silently
    units += [Unit(sub, kind, (), why) for sub, kind, why in parts.unpaired]
    return units


def _groups(reading: Reading, tp: int, sp: bool) -> list[_Group]:
    """Runs of blocks with the same rules under one parent: `parent.*` when they are all its
    children (a ModuleList, Sequential or ModuleDict), `parent.[a..b]` for numbered runs, else one
    group per block."""
    runs: list[tuple[str, list[str], tuple[Unit, ...]]] = []
    for path in reading.blocks:
        parent, _, name = path.rpartition(".")
        units = tuple(block_units(reading, path, tp, sp))
        last = runs[-1] if runs else None
        if (
            last
            and last[0] == parent
            and last[2] == units
            and (
                not name.isdigit() or (last[1][-1].isdigit() and int(last[1][-1]) == int(name) - 1)
            )
        ):
            last[1].append(name)
        else:
            runs.append((parent, [name], units))
    out: list[_Group] = []
    for parent, names, units in runs:
        holder = reading.modules[parent]
        first = ".".join(p for p in (parent, names[0]) if p)
        every = isinstance(holder, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) and len(
            holder
        ) == len(names)
        if every:
            out.append(_Group(f"{parent}.*" if parent else "*", units, first))
        elif all(n.isdigit() for n in names) and len(names) > 1:
            out.append(_Group(f"{parent}.[{names[0]}..{names[-1]}]", units, first))
        else:
            out += [
                _Group(path, units, path)
                for path in (".".join(p for p in (parent, n) if p) for n in names)
            ]
    return out


def _dropout(module: nn.Module) -> bool:
    return isinstance(module, nn.Dropout)


def _top(reading: Reading, sp: bool) -> list[Line]:
    lines, e = [], reading.ends
    outside = [(p, m) for p, m in reading.modules.items() if p and not reading.in_block(p)]
    positions = [p for p, m in outside if isinstance(m, nn.Embedding) and p != e.embedding]
    if e.embedding:
        tied = f", tied to {e.head}" if e.tied else ""
        # the position embedding is added to whole rows: sequence parallelism starts after
        if sp and positions:
            lines.append(
                Line(
                    e.embedding,
                    "vocab_parallel(output=replicate, local=true)",
                    f"input embedding of {e.vocab} rows{tied}: rows split; whole output, to add "
                    f"{positions[0]} to",
                )
            )
        else:
            lines.append(
                Line(
                    e.embedding,
                    "vocab_parallel",
                    f"input embedding of {e.vocab} rows{tied}: rows split, output all-reduced",
                )
            )
    lines += [
        Line(path, "vocab_parallel", f"holds {e.embedding}'s weight: the same rows split")
        for path in e.also
        if not sp
    ]
    if e.head:
        lines.append(
            Line(
                e.head,
                "vocab_parallel",
                f"{e.vocab} logits: they stay sharded, the cross-entropy is vocabulary-parallel",
            )
        )
    if sp:
        lines += _sequence_parallel(reading)
    return lines


def _sequence_parallel(reading: Reading) -> list[Line]:
    """`sequence_parallel` on every norm and dropout outside the blocks (the blocks' own are their
    units)."""
    return [
        Line(
            path,
            "sequence_parallel",
            f"{'norm' if is_norm(module) else 'dropout'} of the residual stream: runs "
            "on this rank's tokens",
        )
        for path, module in reading.modules.items()
        if (is_norm(module) or _dropout(module)) and not reading.in_block(path, strict=True)
    ]


def render(
    name: str,
    model_name: str,
    tp: int,
    top: list[Line],
    groups: list[_Group],
    checked: str,
    sp: bool,
) -> tuple[str, dict[int, tuple]]:
    """The plan text and, per line number, which part wrote it (("top", i) or ("unit", group,
    unit))."""
    text = [
        f"# Written by `dtp plan --auto` for {model_name} at tp "
        f"{tp}{' with sequence parallelism' if sp else ''}.",
        f"# {checked}",
        "# Each rule says what it was found from; what could not be split stays replicated, with "
        "the reason.",
        "dtp 1",
        f"plan {name} version 1",
        "",
    ]
    where: dict[int, tuple] = {}
    body_top = [(i, line) for i, line in enumerate(top)]
    for i, line in body_top[:1]:
        where[len(text) + 1] = ("top", i)
        text.append(line.render())
    for g, group in enumerate(groups):
        text += ["", f"{group.prefix} {{"]
        for u, unit in enumerate(group.units):
            for row in unit.render():
                where[len(text) + 1] = ("unit", g, u)
                text.append("    " + row)
        text.append("}")
    text.append("")
    for i, line in body_top[1:]:
        where[len(text) + 1] = ("top", i)
        text.append(line.render())
    return "\n".join(text) + "\n", where


def auto_plan(
    model: nn.Module, model_name: str, tp: int, sp: bool = False, scan: bool = True
) -> AutoPlan:
    """The plan for `model` at `tp` that `dtp check` accepts, each part it could not split left
    replicated; `scan`: also find every other tp the checker accepts it at (else only `tp` is
    claimed)."""
    reading = Reading(model)
    top, groups = _top(reading, sp), _groups(reading, tp, sp)
    name = (
        "auto-" + re.sub(r"[^A-Za-z0-9_.\-]", "-", model_name.rsplit("/", 1)[-1].rsplit(":", 1)[-1])
        or "auto"
    )
    refused_sp = ""
    for _ in range(_MAX_ROUNDS):
        text, where = render(
            name, model_name, tp, top, groups, f"Checked by dtp check at tp {tp}.", sp
        )
        try:
            checked = check(parse(text, "<auto>"), model, tp)
            break
        except PlanError as err:
            sp_hit = next(
                (d for d in err.diagnostics if _is_sequence(where.get(d.pos.line), top, groups)),
                None,
            )
            # sequence parallelism is all or nothing: without it, the rest is judged again
            if sp and sp_hit:
                refused_sp, sp = _first_sentence(sp_hit.message), False
                top, groups = _top(reading, False), _groups(reading, tp, False)
                continue
            top, groups = _replicate(err, where, top, groups)
    else:
        # each round removes a unit: unreachable
        raise RuntimeError("dtp plan --auto did not converge")
    tps = range(1, max(MAX_TP_SHOWN, tp) + 1) if scan else (tp,)
    # another tp is claimed only where auto would write the same rules and check accepts them;
    # one that does not divide every size the plan shards, check refuses: it is not asked
    admitted = tuple(
        t
        for t in tps
        if t == tp
        or (
            (t > MAX_TP_SHOWN or t in checked.admissible_tp)
            and _same_rules(reading, groups, t, sp)
            and _passes(text, model, t)
        )
    )
    shown = ", ".join(map(str, admitted))
    text, _ = render(
        name, model_name, tp, top, groups, f"`dtp check` accepts it at tp {shown}.", sp
    )
    refused = [f"{g.prefix}.{u.owner}: {u.refused}" for g in groups for u in g.units if u.refused]
    if refused_sp:
        refused.insert(0, f"sequence parallelism: dtp check: {refused_sp}")
        text = text.replace(
            "\ndtp 1\n", f"\n# Without sequence parallelism: {refused_sp}\ndtp 1\n", 1
        )
    return AutoPlan(text, tp, admitted, tuple(refused), _summary(reading, checked, groups))


def _same_rules(reading: Reading, groups: list[_Group], t: int, sp: bool) -> bool:
    """Whether auto would write the rules of `groups` at tp `t` too: each group's first block
    first (where most tp values differ), then every block."""
    mine = _rules(groups)
    if any(
        [_unit_rules(u) for u in block_units(reading, g.first, t, sp)] != rules
        for g, (_, rules) in zip(groups, mine)
    ):
        return False
    return _rules(_groups(reading, t, sp)) == mine


def _summary(reading: Reading, checked: Checked, groups: list[_Group]) -> str:
    """How much of the model the plan splits: blocks with a split part, blocks whose attention or
    MLP stays whole, and the share of the parameter bytes every rank keeps whole (of the plan
    `checked`, the one the user gets but for its header)."""
    counts = {g.prefix: _count(reading, g.prefix) for g in groups}
    total = sum(counts.values())
    split = sum(n for g in groups for n in [counts[g.prefix]] if any(u.lines for u in g.units))
    whole = {
        kind: sum(
            counts[g.prefix] for g in groups if any(u.refused and u.kind == kind for u in g.units)
        )
        for kind in ("attention", "mlp")
    }
    share = replicated_fraction(checked, reading.model)
    return (
        f"blocks split {split}/{total}, attention whole in {whole['attention']}, MLP whole in "
        f"{whole['mlp']}; "
        f"{100 * share:.1f} % of the parameter bytes stay whole on every rank"
    )


def _count(reading: Reading, prefix: str) -> int:
    """The blocks a group's pattern names."""
    parent, _, segment = prefix.rpartition(".")
    if segment == "*":
        return len(reading.modules[parent]) if parent else 1
    if segment.startswith("["):
        a, b = segment[1:-1].split("..")
        return int(b) - int(a) + 1
    return 1


def _is_sequence(key: tuple | None, top: list[Line], groups: list[_Group]) -> bool:
    """Whether the statement at `key` is one of sequence parallelism's."""
    if key is None:
        return False
    if key[0] == "top":
        return "sequence_parallel" in top[key[1]].text or "local=true" in top[key[1]].text
    return groups[key[1]].units[key[2]].kind == "sequence"


def _rules(groups: list[_Group]) -> list:
    """The statements of `groups` without their comments (which name tp-specific sizes)."""
    return [(g.prefix, [_unit_rules(u) for u in g.units]) for g in groups]


def _unit_rules(unit: Unit) -> tuple:
    return unit.owner, bool(unit.refused), [(x.path, x.text, x.is_set) for x in unit.lines]


def _passes(text: str, model: nn.Module, tp: int) -> bool:
    try:
        check(parse(text, "<auto>"), model, tp)
    except PlanError:
        return False
    return True


def _replicate(err: PlanError, where: dict[int, tuple], top: list[Line], groups: list[_Group]):
    """Every part a diagnostic points into, left replicated with the checker's reason."""
    hit_top: dict[int, str] = {}
    hit_units: dict[tuple[int, int], str] = {}
    for d in err.diagnostics:
        key = where.get(d.pos.line)
        reason = _first_sentence(d.message)
        # not a rule auto wrote: the model itself (a problem no plan avoids) — say so, exit 2
        if key is None:
            raise UsageError(
                f"dtp plan --auto: dtp check refuses every plan for this model: {d.message}"
            )
        if key[0] == "top":
            hit_top.setdefault(key[1], reason)
        else:
            hit_units.setdefault((key[1], key[2]), reason)
    top = [line for i, line in enumerate(top) if i not in hit_top]
    groups = [
        _Group(
            g.prefix,
            tuple(
                u.refuse(f"dtp check: {hit_units[(gi, ui)]}") if (gi, ui) in hit_units else u
                for ui, u in enumerate(g.units)
            ),
            g.first,
        )
        for gi, g in enumerate(groups)
    ]
    return top, groups


def _first_sentence(message: str) -> str:
    head = message.split("; ")[0]
    return head if len(head) <= 240 else head[:240] + " …"
