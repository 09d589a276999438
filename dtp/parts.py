"""Packed parts of unequal sizes, some of them replicated: `colwise(packed=[q, replicate(kv), replicate(kv)])`.

A fused projection whose output features are [q; k; v] with k and v narrower than q (grouped-query Phi-3:
64/32/32) or a single head (multi-query GPT-BigCode, Falcon-7B: h + 2·head_dim). Each item of the list is
one part, in order:

| item            | size                                               | on each rank          |
|-----------------|----------------------------------------------------|-----------------------|
| `q`             | config's attention heads × head size               | its 1/tp slice        |
| `kv`            | config's key/value heads × head size               | its 1/tp slice        |
| `head`          | one head (multi-query k or v)                      | its 1/tp slice        |
| `N` (integer)   | N features                                         | its 1/tp slice        |
| `replicate(P)`  | P's size (`q`, `kv` or `N`)                        | the whole part        |

Sizes come from the model's config and must add up to the module's output features (`check` says so
otherwise). A replicated part's rows are held by every rank; each rank's gradient for them covers only its
own heads, so it is all-reduced in the backward pass (like HF's `replicated_with_grad_allreduce`). A list of
only replicated parts replicates a projection inside the colwise region: grouped-query attention with
fewer key/value heads than tp when there is one (`k_proj: colwise(packed=[replicate(kv)])`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from dtp import ir

NAMES = ("q", "kv", "head")


if TYPE_CHECKING:
    import torch.nn as nn

class PartsError(ValueError):
    """A part list that cannot be laid out on this module; the message says why."""


def _size(item: str | int, root: nn.Module) -> int:
    if isinstance(item, int):
        if item < 1:
            raise PartsError(f"part size {item} must be positive")
        return item
    from dtp import models  # torch, only once a model is checked
    info = models.heads(root)
    if item not in NAMES:
        raise PartsError(f"unknown part '{item}'; a part is q, kv, head, an integer, or replicate(PART)")
    if info is None:
        raise PartsError(f"part '{item}' needs the model's config to give its head counts")
    return {"q": info.n_head, "kv": info.n_kv_head, "head": 1}[item] * info.head_dim


def _item(item: object, root: nn.Module) -> tuple[int, bool]:
    if isinstance(item, str) and item.startswith("replicate(") and item.endswith(")"):
        inner = item[len("replicate("):-1]
        return _size(int(inner) if inner.isdigit() else inner, root), False
    if isinstance(item, str) and "(" in item:
        raise PartsError(f"unknown part '{item}'; only replicate(PART) wraps a part")
    return _size(item, root), True  # type: ignore[arg-type]


def resolve_parts(value: ir.PartList, width: int, root: nn.Module) -> tuple[tuple[int, bool], ...]:
    """(size, sharded) per part for a module whose packed dimension has `width` features."""
    parts = tuple(_item(item, root) for item in value.items)
    total = sum(n for n, _ in parts)
    if total != width:
        shown = " + ".join(f"{n}" if s else f"{n} (replicated)" for n, s in parts)
        raise PartsError(f"packed parts {value} add up to {shown} = {total}, not the {width} output features")
    # Every part replicated is meaningful inside a colwise region: a single key/value head that every rank's
    # query heads read (`k_proj: colwise(packed=[replicate(kv)])`): whole weights, gradients summed.
    return parts


def try_parts(value: object, width: int, root: nn.Module) -> tuple[tuple[int, bool], ...]:
    """Like resolve_parts, but () for anything that is not a valid part list (check reports it)."""
    if not isinstance(value, ir.PartList):
        return ()
    try:
        return resolve_parts(value, width, root)
    except PartsError:
        return ()
