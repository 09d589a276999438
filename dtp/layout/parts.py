"""Packed parts of unequal sizes, some of them replicated: `colwise(packed=[q, replicate(kv),
replicate(kv)])`.

A fused projection whose output features are [q; k; v] with k and v narrower than q (grouped-query
Phi-3: 64/32/32) or a single head (multi-query GPT-BigCode, Falcon-7B: h + 2·head_dim). Each item of
the list is one part, in order:

| item            | size                                               | on each rank          |
|-----------------|----------------------------------------------------|-----------------------|
| `q`             | config's attention heads × head size               | its 1/tp slice        |
| `kv`            | config's key/value heads × head size               | its 1/tp slice        |
| `head`          | one head (multi-query k or v)                      | its 1/tp slice        |
| `N` (integer)   | N features                                         | its 1/tp slice        |
| `replicate(P)`  | P's size (`q`, `kv` or `N`)                        | the whole part        |
| `repeat(kv)`    | config's key/value heads × head size               | its 1/tp slice when tp divides the heads; else the one head its query heads read |

Sizes come from the model's config and must add up to the module's output features (`check` says so
otherwise). A replicated part's rows are held by every rank; each rank's gradient for them covers
only its own heads, so it is all-reduced in the backward pass (like HF's
`replicated_with_grad_allreduce`). A list of only replicated parts replicates a projection inside
the colwise region: grouped-query attention with fewer key/value heads than tp when there is one
(`k_proj: colwise(packed=[replicate(kv)])`).

`repeat(kv)` adapts to tp: with H key/value heads, tp dividing H shards them as `kv` does; H
dividing tp (2 heads at tp 4) gives rank r head r·H/tp, the one its query heads read (ranks r·tp/H …
hold the same head), and the gradient of those rows is summed over the ranks that share it (one
all-reduce). A part's kind is True (sharded), False (replicated) or the head count H of a repeated
part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtp.lang import ir
from dtp.layout.attention import config_heads

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
    info = config_heads(root)
    if item not in NAMES:
        raise PartsError(
            f"unknown part '{item}'; a part is q, kv, head, an integer, or replicate(PART)"
        )
    if info is None:
        raise PartsError(f"part '{item}' needs the model's config to give its head counts")
    return {"q": info.n_head, "kv": info.n_kv_head, "head": 1}[item] * info.head_dim


Kind = "bool | int"  # True: sharded, False: replicated, an int H: repeat(kv) of H heads


def local_rows(n: int, kind: bool | int, tp: int) -> int:
    """Rows of a part of `n` rows that each rank holds."""
    if kind is True:
        return n // tp
    if kind is False:
        return n
    # repeat: a slice of the heads, or one whole head
    return n // tp if kind % tp == 0 else n // kind


def reduced_rows(n: int, kind: bool | int, tp: int) -> int:
    """Rows of the gradient buffer all-reduced for this part (replicated parts, repeated heads)."""
    if kind is False:
        return n
    if kind is True or kind % tp == 0:
        return 0
    return n  # repeat: each rank's head placed in a zero buffer of every head, summed


def repeated(kind: bool | int, tp: int) -> bool:
    """Whether a part is a repeat(kv) whose heads tp does not divide (each rank holds one whole
    head)."""
    return kind is not True and kind is not False and kind % tp != 0


def _item(item: object, root: nn.Module) -> tuple[int, bool | int]:
    if isinstance(item, str) and item.startswith("replicate(") and item.endswith(")"):
        inner = item[len("replicate(") : -1]
        return _size(int(inner) if inner.isdigit() else inner, root), False
    if item == "repeat(kv)":
        size = _size("kv", root)
        return size, config_heads(root).n_kv_head  # type: ignore[union-attr]
    if isinstance(item, str) and "(" in item:
        raise PartsError(f"unknown part '{item}'; only replicate(PART) and repeat(kv) wrap a part")
    return _size(item, root), True  # type: ignore[arg-type]


def resolve_parts(
    value: ir.PartList, width: int, root: nn.Module
) -> tuple[tuple[int, bool | int], ...]:
    """(size, sharded) per part for a module whose packed dimension has `width` features."""
    parts = tuple(_item(item, root) for item in value.items)
    total = sum(n for n, _ in parts)
    if total != width:
        shown = " + ".join(f"{n}" if s is not False else f"{n} (replicated)" for n, s in parts)
        raise PartsError(
            f"packed parts {value} add up to {shown} = {total}, not the {width} output features"
        )
    # Every part replicated is meaningful inside a colwise region: a single key/value head that
    # every rank's query heads read (`k_proj: colwise(packed=[replicate(kv)])`): whole weights,
    # gradients summed.
    return parts


def try_parts(value: object, width: int, root: nn.Module) -> tuple[tuple[int, bool | int], ...]:
    """Like resolve_parts, but () for anything that is not a valid part list (check reports it)."""
    if not isinstance(value, ir.PartList):
        return ()
    try:
        return resolve_parts(value, width, root)
    except PartsError:
        return ()


Parts = tuple[tuple[int, bool | int], ...]  # (size, kind): dtp/layout/parts.py


def equal_parts(size: int, k: int) -> Parts:
    """`packed=K` as a part list: K equal sharded parts."""
    return tuple((size // k, True) for _ in range(k))
