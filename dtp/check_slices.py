"""Check rules of `slice_input(name=X | [X, Y, …], dim=D)` (the layout itself: dtp/head_slices.py).

Each named input must be one the module's forward takes (a misspelt name would leave the tensor whole on
every rank, for attention to read all heads against its own; through `**kwargs` any name may arrive, so
there only a name close to a named input is an error), the model's config must give the head count, and
tp must divide it. Reported at the option's value, through `check`'s reporter.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

from dtp import ir

if TYPE_CHECKING:
    import torch.nn as nn

EXAMPLE = "e.g. slice_input(name=alibi) or slice_input(name=[alibi, attention_mask], dim=1)"


def slice_names(style: ir.Style) -> tuple[str, ...]:
    """The inputs a `slice_input` rule names (one, or a list); empty when the option is missing or malformed."""
    value = style.option("name")
    items = value.items if isinstance(value, ir.PartList) else (value,)
    if not all(isinstance(i, str) and i.isidentifier() for i in items) or len(set(items)) != len(items):
        return ()
    return tuple(items)


def forward_params(module: nn.Module) -> list[inspect.Parameter] | None:
    """The parameters of `module.forward`; None when it has no Python signature (a builtin or C forward)."""
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None


def forward_inputs(module: nn.Module) -> tuple[list[str], bool]:
    """The named inputs of `module.forward`, and whether it also takes any keyword (`**kwargs`)."""
    params = forward_params(module)
    if params is None:
        return [], True
    named = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return named, any(p.kind == p.VAR_KEYWORD for p in params)


def check_slice_input(path: str, style: ir.Style, module: nn.Module, root: nn.Module, tp: int | None, rep,
                      sizes: list[int]) -> None:
    """Names well formed and taken by the module's forward; the config gives the head count; tp divides it."""
    from dtp.check import did_you_mean, working_tp

    opt = next((o for o in style.options if o.key == "name"), None)
    if opt is None:
        rep.add(style.pos, len(style.name), path, "slice_input needs the keyword input to cut, e.g. "
                "slice_input(name=alibi)")
        return
    names, shown = slice_names(style), str(opt.value).lower() if isinstance(opt.value, bool) else str(opt.value)
    if not names:
        rep.add(opt.value_pos, len(shown), path, f"slice_input's name takes an input name or a list of distinct "
                f"names, not '{shown}'; {EXAMPLE}")
        return
    named, any_keyword = forward_inputs(module)
    for name in names:  # through **kwargs any name may arrive, but one a letter off a named input is a typo
        hint = did_you_mean(name, named)
        if name not in named and (hint or not any_keyword):
            rep.add(opt.value_pos, len(shown), path, f"{type(module).__name__}.forward takes no input '{name}'"
                    + (hint or f"; its inputs are {', '.join(named)}"))
    from dtp import models  # torch, only once a model is checked
    info = models.heads(root)
    if info is None:
        rep.add(style.pos, len(style.name), path, "slice_input cuts per attention head, but the model's config "
                "gives no head count")
        return
    sizes.append(info.n_head)
    if tp and info.n_head % tp:
        rep.add(style.pos, len(style.name), path, f"slice_input cuts {info.n_head} attention heads ({info.source}) "
                f"into whole heads per rank, which tp={tp} does not divide; tp values that work: "
                f"{working_tp(info.n_head)}")
