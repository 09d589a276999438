"""Check rules of `slice_input(name=X | [X, Y, …], dim=D)` and `slice_params(name=X | [X, …],
dim=D)` (the layouts themselves: dtp/compiler/head_slices.py).

Each named input must be one the module's forward takes (a misspelt name would leave the tensor
whole on every rank, for attention to read all heads against its own; through `**kwargs` any name
may arrive, so there only a name close to a named input is an error), the model's config must give
the head count, and tp must divide it. Reported at the option's value, through `check`'s reporter.
slice_params names an attention module's own parameters — all of them — that hold one value per
query head (GPT-OSS's `sinks`), and is refused where no colwise layer splits that module's heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtp.checks.messages import working_tp
from dtp.errors import did_you_mean
from dtp.lang import ir
from dtp.lang.vocabulary import slice_names
from dtp.layout.attention import attention_like, config_heads, heads
from dtp.layout.modules import forward_inputs
from dtp.layout.resolve import sharded_colwise

if TYPE_CHECKING:
    import torch.nn as nn

EXAMPLE = "e.g. slice_input(name=alibi) or slice_input(name=[alibi, attention_mask], dim=1)"


def _names_option(style: ir.Style, path: str, rep, what: str, one: str, first: str, examples: str):
    """(names, the `name` option, its text as written); None once a missing or malformed option is
    reported."""
    opt = next((o for o in style.options if o.key == "name"), None)
    if opt is None:
        rep.add(
            style.pos, len(style.name), path, f"{style.name} needs the {what} to cut, e.g. {first}"
        )
        return None
    names, shown = (
        slice_names(style),
        str(opt.value).lower() if isinstance(opt.value, bool) else str(opt.value),
    )
    if not names:
        owner = style.name + ("'" if style.name.endswith("s") else "'s")
        rep.add(
            opt.value_pos,
            len(shown),
            path,
            f"{owner} name takes {one} or a list of distinct names, not '{shown}'; {examples}",
        )
        return None
    return names, opt, shown


def _whole_heads(style: ir.Style, path: str, info, tp: int | None, rep) -> None:
    """Report a tp that does not divide the heads a slice_input / slice_params rule cuts."""
    if tp and info.n_head % tp:
        rep.add(
            style.pos,
            len(style.name),
            path,
            f"{style.name} cuts {info.n_head} attention heads ({info.source}) "
            f"into whole heads per rank, which tp={tp} does not divide; tp values that work: "
            f"{working_tp(info.n_head)}",
        )


def check_slice_input(
    path: str,
    style: ir.Style,
    module: nn.Module,
    root: nn.Module,
    tp: int | None,
    rep,
    sizes: list[int],
) -> None:
    """Names well formed and taken by the module's forward; the config gives the head count; tp
    divides it."""
    named_option = _names_option(
        style, path, rep, "keyword input", "an input name", "slice_input(name=alibi)", EXAMPLE
    )
    if named_option is None:
        return
    names, opt, shown = named_option
    named, any_keyword = forward_inputs(module)
    # through **kwargs any name may arrive, but one a letter off a named input is a typo
    for name in names:
        hint = did_you_mean(name, named)
        if name not in named and (hint or not any_keyword):
            rep.add(
                opt.value_pos,
                len(shown),
                path,
                f"{type(module).__name__}.forward takes no input '{name}'"
                + (hint or f"; its inputs are {', '.join(named)}"),
            )
    info = config_heads(root)
    if info is None:
        rep.add(
            style.pos,
            len(style.name),
            path,
            "slice_input cuts per attention head, but the model's config gives no head count",
        )
        return
    sizes.append(info.n_head)
    _whole_heads(style, path, info, tp, rep)


def check_slice_params(
    path: str, style: ir.Style, module: nn.Module, res, tp: int | None, rep
) -> None:
    """Names are the attention module's own parameters, every one of them, each holding its heads at
    `dim`; a colwise layer in the module splits its heads (else every rank computes every head)."""

    named_option = _names_option(
        style,
        path,
        rep,
        "parameters",
        "a parameter name",
        "slice_params(name=sinks)",
        "e.g. slice_params(name=sinks)",
    )
    if named_option is None:
        return
    names, opt, shown = named_option
    own = dict(module.named_parameters(recurse=False))
    info = heads(res.modules[""], path, module) if attention_like(module) else None
    if info is None:
        rep.add(
            style.pos,
            len(style.name),
            path,
            f"slice_params cuts an attention module's per-head parameters, "
            f"but {type(module).__name__} is no attention module with a known head count",
        )
        return
    dim = style.option("dim", 0)
    dim = dim if isinstance(dim, int) and not isinstance(dim, bool) else 0
    for name in names:
        if name not in own:
            rep.add(
                opt.value_pos,
                len(shown),
                path,
                f"{type(module).__name__} has no parameter '{name}' of its own"
                + (
                    did_you_mean(name, list(own)) or f"; its own parameters are {', '.join(own)}"
                    if own
                    else " (it has none)"
                ),
            )
        elif own[name].dim() <= dim or own[name].shape[dim] != info.n_head:
            rep.add(
                opt.value_pos,
                len(shown),
                path,
                f"{name} {tuple(own[name].shape)} does not hold the "
                f"{info.n_head} attention heads ({info.source}) at dimension {dim}",
            )
    left = [
        n for n in own if n not in names and not did_you_mean(n, [m for m in names if m not in own])
    ]
    # applied to this rank's heads, any other own parameter's gradient would be a partial sum
    if left:
        rep.add(
            opt.value_pos,
            len(shown),
            path,
            f"slice_params must name every parameter of "
            f"{type(module).__name__} itself; {', '.join(left)} would stay whole beside sliced "
            "heads",
        )
    _whole_heads(style, path, info, tp, rep)
    if tp != 1 and path not in sharded_colwise(res):
        rep.add(
            style.pos,
            len(style.name),
            path,
            "slice_params cuts per-head parameters to this rank's heads, but "
            "no colwise layer in this module splits its heads: every rank computes all of them; "
            "drop the "
            "rule, or shard the attention's projections colwise",
        )
