"""Plan IR × model → which rule claims which module (and which `set` rewrites which attribute).

Patterns match dotted paths from `model.named_modules()`. The most specific rule wins; equally
specific rules on one module are an error naming both lines.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.nn as nn

from dtp.errors import MAX_SHOWN, Diagnostic, did_you_mean
from dtp.lang import conditions, ir
from dtp.lang.vocabulary import slice_names
from dtp.layout.modules import features, is_linear
from dtp.layout.norms import norm_width
from dtp.layout.parts import try_parts
from dtp.layout.placement import ParamPlacement
from dtp.layout.styles import Style, param_placements


def _segment_matches(seg: ir.Segment, name: str) -> bool:
    if isinstance(seg, ir.IndexRange):
        return name.isdigit() and seg.lo <= int(name) <= seg.hi
    if "*" in seg or "?" in seg:
        return fnmatch.fnmatchcase(name, seg)
    return seg == name


def matches(pattern: ir.Pattern, path: str) -> bool:
    """Whether `pattern` matches the dotted module path (`**` spans any number of segments)."""
    names = tuple(path.split(".")) if path else ()
    # reach[j]: the segments seen so far can consume exactly the first j names (iterative: no
    # recursion limit however many `**` a pattern holds)
    reach = [True] + [False] * len(names)
    for seg in pattern.segments:
        if seg == "**":
            for j in range(1, len(names) + 1):
                reach[j] = reach[j] or reach[j - 1]
        else:
            reach = [False] + [
                reach[j] and _segment_matches(seg, names[j]) for j in range(len(names))
            ]
        if not any(reach):
            return False
    return reach[len(names)]


def generic_path(path: str) -> str:
    """A module path with its layer indices as `*` (`model.layers.3.mlp` → `model.layers.*.mlp`):
    the pattern a plan writes for that module in every layer."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path)


def sharded_colwise(res: Resolution) -> dict[str, list[str]]:
    """Parent path → its colwise children whose output stays sharded (no output=replicate), in plan
    order: the containers whose code runs on the features each rank holds."""
    out: dict[str, list[str]] = {}
    for path, rule in sorted(
        res.claims.items(), key=lambda c: (c[1].pos.line, c[1].pos.column, c[0])
    ):
        if (
            "." in path
            and rule.style.name == Style.COLWISE
            and getattr(rule.style.option("output"), "kind", "shard") == "shard"
        ):
            out.setdefault(path.rpartition(".")[0], []).append(path)
    return out


def specificity(pattern: ir.Pattern) -> tuple[int, ...]:
    """Orders patterns: literal segments beat ranges, ranges beat partial wildcards, which beat `*`,
    then `**`."""
    literal = ranges = partial = star = globstar = 0
    for seg in pattern.segments:
        if isinstance(seg, ir.IndexRange):
            ranges += 1
        elif seg == "**":
            globstar += 1
        elif seg == "*":
            star += 1
        elif "*" in seg or "?" in seg:
            partial += 1
        else:
            literal += 1
    return (literal, ranges, partial, star, -globstar)


@dataclass(frozen=True)
class Resolution:
    """The outcome of matching a plan against a model."""

    modules: Mapping[str, nn.Module]
    claims: Mapping[str, ir.FlatRule]  # module path → the rule that claims it
    sets: Mapping[tuple[str, str], ir.FlatSet]  # (module path, attribute) → the set statement
    diagnostics: list[Diagnostic] = field(default_factory=list)
    # placements by module path, worked out once (the checks ask for each module's several times)
    _placed: dict[str, dict[str, ParamPlacement]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def sequence_parallel(self) -> bool:
        """Whether a rule runs norms sequence-parallel: the activations between blocks are then
        split on the sequence."""
        return any(rule.style.name == Style.SEQUENCE_PARALLEL for rule in self.claims.values())

    def placements(self, path: str) -> dict[str, ParamPlacement]:
        """Where each of module `path`'s own parameters lives under the rule claiming it (if any)."""
        if path not in self._placed:
            self._placed[path] = self._place(path)
        return dict(self._placed[path])

    def _place(self, path: str) -> dict[str, ParamPlacement]:
        rule = self.claims.get(path)
        if rule is None:
            return param_placements(None, self.modules[path])
        if rule.style.name == Style.SLICE_PARAMS:
            dim = rule.style.option("dim", 0)
            return param_placements(
                Style.SLICE_PARAMS,
                self.modules[path],
                sliced=slice_names(rule.style),
                dim=dim if isinstance(dim, int) and not isinstance(dim, bool) else 0,
            )
        packed = rule.style.option("packed", 1)
        valid = isinstance(packed, int) and not isinstance(packed, bool) and packed >= 1
        module = self.modules[path]
        width = (
            features(module)[1]
            if is_linear(module)
            else norm_width(module)
            if rule.style.name == Style.SHARDED_NORM
            else 0
        )
        parts = try_parts(packed, width, self.modules[""]) if width else ()
        return param_placements(rule.style.name, module, packed=packed if valid else 1, parts=parts)


def _suggest(pattern: ir.Pattern, paths: list[str]) -> str:
    # Offer the nearest module path, with its layer indices generalised the way the pattern writes
    # them.
    text = str(pattern)
    candidates = set(paths)
    for path in paths:
        names = path.split(".")
        if len(names) == len(pattern.segments):
            candidates.add(
                ".".join(
                    str(s) if not isinstance(s, str) or "*" in s or "?" in s else n
                    for s, n in zip(pattern.segments, names)
                )
            )
    return did_you_mean(text, sorted(candidates), cutoff=0.6)


def _pick(candidates: list, path: str, what: str, diags: list[Diagnostic], reported: set) -> object:
    """The most specific candidate; a tie at the top is reported once per pair of statements."""
    ranked = sorted(candidates, key=lambda c: specificity(c.pattern), reverse=True)
    best = ranked[0]
    if len(ranked) > 1 and specificity(ranked[1].pattern) == specificity(best.pattern):
        first, second = sorted(ranked[:2], key=lambda c: (c.pos.line, c.pos.column))
        key = (first.pos, second.pos)
        if key not in reported:
            reported.add(key)
            diags.append(
                Diagnostic(
                    second.pos,
                    f"{what} at lines {first.pos.line} and {second.pos.line} both claim "
                    f"'{path}' and are equally specific; make one more specific or remove one",
                    len(str(second.pattern)),
                )
            )
    return best


def held_object(module: nn.Module, name: str) -> object | None:
    """The plain object (a config, not a module, tensor or number) `module` keeps in attribute
    `name`."""
    value = vars(module).get(name)
    if value is None or isinstance(
        value, (nn.Module, torch.Tensor, int, float, str, bool, tuple, list, dict)
    ):
        return None
    return value if hasattr(value, "__dict__") else None


def holder_paths(
    pattern: ir.Pattern, modules: Mapping[str, nn.Module], paths: list[str]
) -> list[str]:
    """For `set MODULES.HOLDER.ATTR`, whose MODULES.HOLDER is no module: the modules MODULES matches
    that keep a plain object in attribute HOLDER (Phi-3's attention reads its query width from
    `self.config`). The rewrite then goes to a per-module copy of that object
    (dtp.compiler.styles.SetAttributes)."""
    if not pattern.segments:  # `set ATTR`: an attribute of the model itself
        return []
    *prefix, last = pattern.segments
    if (
        not isinstance(last, str)
        or not last.isidentifier()
        or any(matches(pattern, p) for p in paths)
    ):
        return []
    inner = ir.Pattern(tuple(prefix), pattern.pos)
    hits = [p for p in modules if matches(inner, p)] if prefix else [""]
    return [p for p in hits if held_object(modules[p], last) is not None]


def written_length(plan: ir.Plan, pattern: ir.Pattern) -> int:
    """How long the pattern is as written at its position (inside a block it is shorter than the
    joined one)."""
    lines = (plan.source or "").splitlines()
    line = lines[pattern.pos.line - 1] if 0 < pattern.pos.line <= len(lines) else ""
    written = line[pattern.pos.column - 1 :].split("=")[0].split()
    return len(written[0]) if written else len(str(pattern))


def _not_held(
    pattern: ir.Pattern, modules: Mapping[str, nn.Module], paths: list[str]
) -> str | None:
    """Why `set MODULES.NAME.ATTR` reaches nothing when MODULES matches modules but NAME is neither
    a child module nor a held object (None when MODULES matches nothing: the usual no-match message
    says so)."""
    if len(pattern.segments) < 2:
        return None
    *prefix, last = pattern.segments
    if not isinstance(last, str) or any(matches(pattern, p) for p in paths):
        return None
    inner = ir.Pattern(tuple(prefix), pattern.pos)
    hits = [p for p in paths if matches(inner, p)]
    if not hits:
        return None
    module = modules[hits[0]]
    held = [k for k in vars(module) if held_object(module, k) is not None]
    names = held + [n for n, _ in module.named_children()]
    hint = did_you_mean(str(last), names)
    return (
        f"'{last}' is neither a module under '{inner}' nor an object it holds "
        f"({type(module).__name__} holds "
        f"{', '.join(held) or 'none'}); `set` reaches MODULE.ATTR or MODULE.OBJECT.ATTR{hint}"
    )


def resolve(plan: ir.Plan, model: nn.Module, tp: int | None = None) -> Resolution:
    """Match every rule, block and set of `plan` against `model`'s modules (`when` branches chosen
    by its config and `tp`); collect diagnostics."""
    diags: list[Diagnostic] = []
    rules, sets, blocks = ir.flatten(plan, conditions.chooser(model, diags, tp))
    modules = dict(model.named_modules())
    paths = [p for p in modules if p]
    # a pattern without `**` whose last segment is a name matches only paths of its length that
    # end in that name: one lookup instead of a test of every module (20,000 blocks hold 10^5)
    by_end: dict[tuple[int, str], list[str]] = {}
    for p in paths:
        names = p.split(".")
        by_end.setdefault((len(names), names[-1]), []).append(p)

    unmatched = [0]

    def matched(pattern: ir.Pattern, allow_root: bool = False) -> list[str]:
        if all(isinstance(s, str) and not any(c in s for c in "*?") for s in pattern.segments):
            # literal: one lookup
            hits = [str(pattern)] if str(pattern) in modules and pattern.segments else []
        else:
            last = pattern.segments[-1] if pattern.segments else "**"
            named = isinstance(last, str) and not any(c in last for c in "*?")
            candidates = (
                by_end.get((len(pattern.segments), last), [])
                if named and "**" not in pattern.segments
                else paths
            )
            hits = [p for p in candidates if matches(pattern, p)]
        if allow_root and not pattern.segments:
            hits = [""]
        if not hits:
            # Suggestions cost a fuzzy search over every module: only for the errors a user will
            # read.
            unmatched[0] += 1
            hint = _suggest(pattern, paths) if unmatched[0] <= MAX_SHOWN else ""
            diags.append(
                Diagnostic(
                    pattern.pos,
                    f"pattern '{pattern}' matches no module{hint}",
                    len(str(pattern)) or 1,
                )
            )
        return hits

    for block in blocks:
        matched(block)
    by_module: dict[str, list[ir.FlatRule]] = {}
    for rule in rules:
        for path in matched(rule.pattern):
            by_module.setdefault(path, []).append(rule)
    by_attr: dict[tuple[str, str], list[ir.FlatSet]] = {}
    for stmt in sets:
        # `set self_attn.config.X`: an object the module holds
        held = holder_paths(stmt.pattern, modules, paths)
        if not held and (problem := _not_held(stmt.pattern, modules, paths)):
            diags.append(Diagnostic(stmt.pattern.pos, problem, written_length(plan, stmt.pattern)))
            continue
        for path in held or matched(stmt.pattern, allow_root=True):
            attr = f"{stmt.pattern.segments[-1]}.{stmt.attr}" if held else stmt.attr
            by_attr.setdefault((path, attr), []).append(stmt)

    reported: set = set()
    claims = {path: _pick(c, path, "rules", diags, reported) for path, c in by_module.items()}
    chosen = {
        key: _pick(c, f"{key[0]}.{key[1]}".lstrip("."), "set statements", diags, reported)
        for key, c in by_attr.items()
    }
    return Resolution(modules, claims, chosen, diags)


def int_attributes(module: object) -> dict[str, int]:
    """The module's (or a held object's) integer attributes (what a set expression may name)."""
    return {k: v for k, v in vars(module).items() if isinstance(v, int) and not isinstance(v, bool)}


def set_target(module: nn.Module, attr: str) -> tuple[object, str]:
    """(the object a `set` rewrites, its attribute): the module itself, or for `HOLDER.ATTR` the
    plain object it holds (dtp.layout.resolve.holder_paths); a set expression's bare names read that
    object's attributes."""
    holder, _, name = attr.rpartition(".")
    return (held_object(module, holder), name) if holder else (module, attr)
