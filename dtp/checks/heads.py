"""Check rules about attention heads: every rank must hold whole heads (tp divides the query and key/value head
counts a colwise or rowwise layer splits), a fused projection's parts must be listed as they are, and an
attention that keeps one module per head cannot be split (the facts: dtp/layout/attention.py)."""
from __future__ import annotations

import torch.nn as nn

from dtp.checks.messages import Reporter, working_tp
from dtp.lang import ir, vocabulary
from dtp.layout.attention import Heads, attention_like, fused_parts, heads
from dtp.layout.modules import features
from dtp.layout.resolve import Resolution, sharded_colwise


def check_fused_parts(path: str, style: ir.Style, attention: nn.Module, linear: nn.Module, info: Heads,
                      rep: Reporter) -> bool:
    """A colwise fused q/k/v projection says how many parts it packs, and lists them when they differ in
    width (grouped- or multi-query); False once a problem is reported."""
    packed, width = vocabulary.packed(style), features(linear)[1]
    parts = fused_parts(attention, linear, info)
    if parts and packed > 1 and len(set(parts)) > 1:
        rep.add(style.pos, len(style.name), path, unequal_parts_message(parts, packed, info, width))
        return False
    if parts and packed not in (1, len(parts)):
        rep.add(style.pos, len(style.name), path, f"out_features={width} holds {len(parts)} equal parts "
                f"(q, k and v of {parts[0]}), not {packed}; use packed={len(parts)}")
        return False
    return True


def check_whole_heads(path: str, style: ir.Style, info: Heads, width: int, packed: int, tp: int | None,
                      rep: Reporter, sizes: list[int]) -> None:
    """The `width` features a colwise (per packed part) or rowwise layer splits hold whole heads: tp must divide
    their count (query heads, key/value heads, or heads of q, k, v fused per head as in GPT-NeoX)."""
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
        rep.add(style.pos, len(style.name), path, f"{n} {what}{per} (head size {info.head_dim}, {source}) do not "
                f"divide by tp={tp}; each rank must hold whole heads; tp values that work: {working_tp(n)}")


def unequal_parts_message(parts: tuple[int, ...], packed: int, info: Heads, width: int) -> str:
    """Why `packed=K` cannot shard a fused projection whose q, k and v differ in width."""
    q, kv = parts[0], parts[1]
    n_kv = kv // info.head_dim
    kind = "multi-query" if n_kv == 1 else "grouped-query"
    parts = "q, replicate(head), replicate(head)" if n_kv == 1 else "q, kv, kv"
    hint = f"colwise(packed=[{parts}])" + ("" if n_kv == 1 else " (replicate(kv) for key/value heads tp does not divide)")
    said = ""
    if info.n_kv_head != n_kv:
        said = f"; {info.kv_source} says {info.n_kv_head}, the weight says {n_kv}"
    elif info.kv_source != info.source:
        said = f", as {info.kv_source} says"
    return (f"packed={packed} needs {packed} equal parts, but out_features={width} holds q {q} + k {kv} + v {kv} "
            f"({kind}: {info.n_head} query heads and {n_kv} key/value head{'s' if n_kv > 1 else ''} of size "
            f"{info.head_dim}, read from the weight's shape{said}); list the parts instead: {hint}")


def check_per_head_lists(res: Resolution, model: nn.Module, tp: int | None, rep: Reporter) -> None:
    """Refuse splitting the heads of an attention that keeps one module per head in a ModuleList (StableLM
    2 12B's q/k LayerNorms): the model zips a rank's local heads with the list's first entries."""
    if tp == 1:
        return
    for path, projs in sharded_colwise(res).items():
        module = res.modules.get(path)
        info = heads(model, path, module) if module is not None and attention_like(module) else None
        if info is None:
            continue
        for sub, child in module.named_modules():
            if sub and isinstance(child, nn.ModuleList) and len(child) > 1 and len(child) in (info.n_head,
                                                                                             info.n_kv_head):
                proj, rule = projs[0], res.claims[projs[0]]
                rep.add(rule.style.pos, len(rule.style.name), proj,
                        f"{path.rsplit('.', 1)[-1]}.{sub} holds one {type(child[0]).__name__} per head ({len(child)}), "
                        "and the model pairs a rank's local heads with the list's first entries: split heads would "
                        "run with other heads' weights; keep this attention whole (no colwise or rowwise in it)")
                break
