"""Check rules that need no model: style names, option names and option values (`dtp check PLAN`)."""

from __future__ import annotations

from dtp.errors import Diagnostic, did_you_mean
from dtp.lang import ir
from dtp.lang.vocabulary import OPTIONS, parts_option_ok


def check_style(style: ir.Style, diags: list[Diagnostic]) -> None:
    """An unknown style, and unknown, repeated or ill-typed options of a known one."""
    if style.name not in OPTIONS:
        diags.append(
            Diagnostic(
                style.pos,
                f"unknown style '{style.name}'{did_you_mean(style.name, list(OPTIONS))}",
                len(style.name),
            )
        )
        return
    allowed = OPTIONS[style.name]
    seen: set[str] = set()
    for opt in style.options:
        if opt.key not in allowed:
            hint = did_you_mean(opt.key, list(allowed)) or (
                f"; {style.name} takes {', '.join(allowed)}"
                if allowed
                else f"; {style.name} takes no options"
            )
            diags.append(
                Diagnostic(
                    opt.pos, f"unknown option '{opt.key}' for {style.name}{hint}", len(opt.key)
                )
            )
            continue
        if opt.key in seen:
            diags.append(Diagnostic(opt.pos, f"option '{opt.key}' given twice", len(opt.key)))
        seen.add(opt.key)
        kind, value = allowed[opt.key], opt.value
        if kind == "layout" and value == "shard":
            diags.append(
                Diagnostic(
                    opt.value_pos,
                    f"option '{opt.key}': shard needs the dimension, e.g. shard(1)",
                    5,
                )
            )
        elif kind == "layout" and not isinstance(value, ir.Layout):
            shown = str(value).lower() if isinstance(value, bool) else value
            diags.append(
                Diagnostic(
                    opt.value_pos,
                    f"option '{opt.key}' takes a layout (replicate, shard(DIM) or "
                    f"partial), not '{shown}'{did_you_mean(str(shown), ['replicate', 'partial', 'shard'])}",
                    len(str(shown)),
                )
            )
        elif kind == "bool" and not isinstance(value, bool):
            diags.append(
                Diagnostic(
                    opt.value_pos,
                    f"option '{opt.key}' takes true or false, not '{value}'",
                    len(str(value)),
                )
            )
        elif kind == "parts" and not parts_option_ok(value):
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            diags.append(
                Diagnostic(
                    opt.value_pos,
                    f"option '{opt.key}' takes a positive integer or a part list "
                    f"such as [q, kv, kv], not '{shown}'",
                    len(shown),
                )
            )
        elif kind == "index" and (isinstance(value, bool) or not isinstance(value, int)):
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            diags.append(
                Diagnostic(
                    opt.value_pos,
                    f"option '{opt.key}' takes a dimension index (0, 1, …), not '{shown}'",
                    len(shown),
                )
            )
        elif kind == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            diags.append(
                Diagnostic(
                    opt.value_pos,
                    f"option '{opt.key}' takes a positive integer, not '{shown}'",
                    len(shown),
                )
            )


def check_syntax_level(plan: ir.Plan) -> list[Diagnostic]:
    """Style names, option names and option values: what needs no model."""
    diags: list[Diagnostic] = []
    rules, _, _ = ir.flatten(plan)
    for rule in rules:
        check_style(rule.style, diags)
    return diags
