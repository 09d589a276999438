"""Check rules for the layouts of Hugging Face families: packed part lists (`colwise(packed=[…])`).

A rule whose `packed` is a part list is checked here instead of by the equal-parts rules; problems
are reported at the option's value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtp.checks.messages import working_tp
from dtp.lang import ir
from dtp.layout.attention import config_heads
from dtp.layout.modules import features, is_linear
from dtp.layout.norms import norm_width
from dtp.layout.parts import PartsError, resolve_parts

if TYPE_CHECKING:
    import torch.nn as nn


def check_parts(
    path: str,
    module: nn.Module,
    style: ir.Style,
    root: nn.Module,
    tp: int | None,
    rep,
    sizes: list[int],
) -> None:
    """Sizes add up to the output features, every sharded part divides by tp in whole heads."""
    opt = next(o for o in style.options if o.key == "packed")
    length = len(str(opt.value))
    try:
        parts = resolve_parts(
            opt.value, features(module)[1] if is_linear(module) else norm_width(module), root
        )
    except PartsError as err:
        rep.add(opt.value_pos, length, path, str(err))
        return
    info = config_heads(root)
    for index, (size, sharded) in enumerate(parts):
        what = f"packed part {index + 1} ({opt.value.items[index]}, {size} features)"
        if sharded is False:
            continue
        if sharded is not True:  # repeat(kv) of `sharded` heads: tp divides them, or they divide tp
            if tp and sharded % tp and tp % sharded:
                rep.add(
                    opt.value_pos,
                    length,
                    path,
                    f"{what} holds {sharded} key/value heads: tp={tp} neither "
                    f"divides them nor is a multiple of them, so ranks cannot share whole heads",
                )
            continue
        sizes.append(size)
        if tp and size % tp:
            rep.add(
                opt.value_pos,
                length,
                path,
                f"{style.name} shards {what} over tp={tp}, which does not divide it; "
                f"tp values that work: {working_tp(size)}",
            )
        elif info and size % info.head_dim == 0:
            heads = size // info.head_dim
            sizes.append(heads)
            if tp and heads % tp:
                hint = (
                    "; keep it whole with replicate(" + str(opt.value.items[index]) + ")"
                    if heads < tp
                    else ""
                )
                # grouped-query: each rank its own head
                if opt.value.items[index] == "kv" and tp % heads == 0:
                    hint = (
                        "; give each rank the key/value head its query heads read with repeat(kv)"
                    )
                rep.add(
                    opt.value_pos,
                    length,
                    path,
                    f"{what} holds {heads} heads (head size {info.head_dim}), which "
                    f"do not divide by tp={tp}; each rank must hold whole heads; tp values that "
                    "work: "
                    f"{working_tp(heads)}{hint}",
                )
