"""Check rules about attention heads: every rank must hold whole heads (tp divides the query and
key/value head counts a colwise or rowwise layer splits), a fused projection's parts must be listed
as they are, and an attention that keeps one module per head cannot be split (the facts:
dtp/layout/attention.py)."""

from __future__ import annotations

from collections.abc import Iterator

import torch.nn as nn

from dtp.checks.messages import MAX_TP_SHOWN, Reporter, working_tp
from dtp.lang import ir, vocabulary
from dtp.layout.attention import Heads, attention_like, fused_parts, heads
from dtp.layout.modules import features
from dtp.layout.resolve import Resolution, generic_path, sharded_colwise


def check_fused_parts(
    path: str,
    style: ir.Style,
    attention: nn.Module,
    linear: nn.Module,
    info: Heads,
    rep: Reporter,
    tp: int | None = None,
) -> bool:
    """A colwise fused q/k/v projection says how many parts it packs, and lists them when they
    differ in width (grouped- or multi-query); False once a problem is reported."""
    packed, width = vocabulary.packed(style), features(linear)[1]
    parts = fused_parts(attention, linear, info)
    if (
        parts
        and style.option("packed") is None
        and parts[1] == info.head_dim < parts[0]
        and tp != 1
    ):
        # one key/value head packed after q: [q; k; v] is never interleaved, a plain colwise cuts
        # across it
        rep.add(
            style.pos,
            len(style.name),
            path,
            f"out_features={width} holds q {parts[0]} + k {parts[1]} + v "
            f"{parts[2]} (multi-query: {info.n_head} query heads and one key/value head of size "
            f"{info.head_dim}, "
            "read from the weight's shape), and a plain colwise would cut each rank's slice across "
            "q, k and v; "
            "shard q by heads and keep k and v whole: colwise(packed=[q, replicate(head), "
            "replicate(head)])",
        )
        return False
    if parts and packed > 1 and len(set(parts)) > 1:
        rep.add(style.pos, len(style.name), path, unequal_parts_message(parts, packed, info, width))
        return False
    if parts and packed not in (1, len(parts)):
        rep.add(
            style.pos,
            len(style.name),
            path,
            f"out_features={width} holds {len(parts)} equal parts "
            f"(q, k and v of {parts[0]}), not {packed}; use packed={len(parts)}",
        )
        return False
    return True


def check_whole_heads(
    path: str,
    style: ir.Style,
    info: Heads,
    width: int,
    packed: int,
    tp: int | None,
    rep: Reporter,
    sizes: list[int],
    attention: nn.Module | None = None,
) -> None:
    """The `width` features a colwise (per packed part) or rowwise layer splits hold whole heads: tp
    must divide their count (query heads, key/value heads, or heads of q, k, v fused per head as in
    GPT-NeoX)."""
    if width % info.head_dim:
        return
    n = width // info.head_dim
    kv = n == info.n_kv_head != info.n_head
    what = "key/value heads" if kv else "attention heads"
    if not kv and n > info.n_head > 0 and n % info.n_head == 0:  # q, k, v fused per head (GPT-NeoX)
        n, what = info.n_head, f"attention heads ({n // info.n_head} fused blocks each)"
    sizes.append(n)
    source = info.kv_source if kv else info.source
    if tp and n % tp:
        per = " per packed part" if packed > 1 else ""
        hint = (
            repeat_hint(info, tp, path.rpartition(".")[0], attention) if kv and packed == 1 else ""
        )
        rep.add(
            style.pos,
            len(style.name),
            path,
            f"{n} {what}{per} (head size {info.head_dim}, {source}) do not "
            f"divide by tp={tp}; each rank must hold whole heads; tp values that work: "
            f"{working_tp(n)}{hint}",
        )


def repeat_tp(info: Heads) -> list[int]:
    """The tp values `repeat(kv)` admits: they divide the query heads, and divide or are a multiple
    of the key/value heads."""
    kv = info.n_kv_head
    return [
        d
        for d in range(1, MAX_TP_SHOWN + 1)
        if info.n_head % d == 0 and (kv % d == 0 or d % kv == 0)
    ]


def repeat_hint(info: Heads, tp: int, owner: str, attention: nn.Module | None) -> str:
    """How `repeat(kv)` shards key/value heads tp does not divide ("" when it cannot at this tp)."""
    if tp % info.n_kv_head or info.n_head % tp:
        return ""
    # The attribute the attention repeats key/value heads by (HF's num_key_value_groups, dtp Llama's
    # n_rep): under repeat(kv) a rank holds one key/value head for its n_head / tp query heads.
    ratio = info.n_head // info.n_kv_head
    groups = sorted(
        k
        for k, v in vars(attention or nn.Module()).items()
        if isinstance(v, int)
        and not isinstance(v, bool)
        and v == ratio > 1
        and ("group" in k.lower() or "rep" in k.lower())
    )
    heads_expr = (
        info.source
        if info.source.startswith("config.") and hasattr(attention, "config")
        else info.n_head
    )
    also = (
        f"; the attention repeats key/value heads by {groups[0]}, so where tp ≥ {info.n_kv_head} "
        "also `set "
        f"{generic_path(owner)}.{groups[0]} = {heads_expr} / tp` (both under a `when`, as "
        "plans/hf/llama.tp does)"
        if groups
        else ""
    )
    return (
        "; or give each rank the key/value head its query heads read: "
        "`colwise(packed=[repeat(kv)])` on the "
        f"key and value projections, which works at tp {', '.join(map(str, repeat_tp(info)))}{also}"
    )


def unequal_parts_message(parts: tuple[int, ...], packed: int, info: Heads, width: int) -> str:
    """Why `packed=K` cannot shard a fused projection whose q, k and v differ in width."""
    q, kv = parts[0], parts[1]
    n_kv = kv // info.head_dim
    kind = "multi-query" if n_kv == 1 else "grouped-query"
    parts = "q, replicate(head), replicate(head)" if n_kv == 1 else "q, kv, kv"
    hint = f"colwise(packed=[{parts}])" + (
        "" if n_kv == 1 else " (replicate(kv) for key/value heads tp does not divide)"
    )
    said = ""
    if info.n_kv_head != n_kv:
        said = f"; {info.kv_source} says {info.n_kv_head}, the weight says {n_kv}"
    elif info.kv_source != info.source:
        said = f", as {info.kv_source} says"
    return (
        f"packed={packed} needs {packed} equal parts, but out_features={width} holds q {q} + k {kv} "
        f"+ v {kv} "
        f"({kind}: {info.n_head} query heads and {n_kv} key/value head{'s' if n_kv > 1 else ''} of "
        "size "
        f"{info.head_dim}, read from the weight's shape{said}); list the parts instead: {hint}"
    )


def split_attentions(
    res: Resolution, model: nn.Module
) -> Iterator[tuple[str, nn.Module, Heads, list[str]]]:
    """(path, module, head counts, its colwise projections) of every attention whose heads the plan
    splits."""
    for path, projs in sharded_colwise(res).items():
        module = res.modules.get(path)
        info = heads(model, path, module) if module is not None and attention_like(module) else None
        if info is not None:
            yield path, module, info, projs


def check_per_head_lists(res: Resolution, model: nn.Module, tp: int | None, rep: Reporter) -> None:
    """Refuse splitting the heads of an attention that keeps one module per head in a ModuleList
    (StableLM 2 12B's q/k LayerNorms): the model zips a rank's local heads with the list's first
    entries."""
    if tp == 1:
        return
    for path, module, info, projs in split_attentions(res, model):
        for sub, child in module.named_modules():
            if (
                sub
                and isinstance(child, nn.ModuleList)
                and len(child) > 1
                and len(child) in (info.n_head, info.n_kv_head)
            ):
                proj, rule = projs[0], res.claims[projs[0]]
                rep.add(
                    rule.style.pos,
                    len(rule.style.name),
                    proj,
                    f"{path.rsplit('.', 1)[-1]}.{sub} holds one {type(child[0]).__name__} per head "
                    f"({len(child)}), "
                    "and the model pairs a rank's local heads with the list's first entries: split "
                    "heads would "
                    "run with other heads' weights; keep this attention whole (no colwise or "
                    "rowwise in it)",
                )
                break
