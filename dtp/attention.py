"""Which modules are attention, how many heads they hold, and what a fused projection really packs.

Decided by structure, not by a module's path: a module is attention-like when its class says so, when it
keeps head counts or a head size as integer attributes, or when it owns q/k/v (or fused qkv) projections.
Head counts come from the model's config where it has one, else from the attention module's own
attributes. A fused projection's parts are read from its weight's shape: `config.multi_query` or a key/value
head count in the config are only cross-checked against it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from dtp import models

# Names of query/key/value projections across common codebases (Hugging Face, nanoGPT, Meta's Llama, MPT).
PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "q_attn", "query_key_value", "wq", "wk",
                         "wv", "wqkv", "Wqkv", "query", "key", "value", "qkv", "kv_proj", "in_proj"})
_COUNT_ATTRS = ("num_heads", "n_head", "n_heads", "num_attention_heads")
_KV_ATTRS = ("num_key_value_heads", "n_kv_head", "n_kv_heads", "num_kv_heads")
_SIZE_ATTRS = ("head_dim", "head_size")


def _int_attr(obj: object, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def attention_like(module: nn.Module) -> bool:
    """Whether `module` is an attention layer, judged by its class, its attributes and its projections."""
    if "attention" in type(module).__name__.lower():
        return True
    if _int_attr(module, _COUNT_ATTRS + _KV_ATTRS + _SIZE_ATTRS):
        return True
    return any(name in PROJECTIONS and isinstance(child, nn.Linear) for name, child in module.named_children())


@dataclass(frozen=True)
class Heads:
    """Head counts and size for one attention module, and where each number came from."""

    n_head: int
    n_kv_head: int
    head_dim: int
    source: str  # e.g. "config.n_head" or "attn.n_heads"
    kv_source: str


def heads(model: nn.Module, path: str, module: nn.Module) -> Heads | None:
    """The heads of attention module `path`: the model's config first, the module's own attributes second."""
    cfg = models.heads(model)
    name = path.rsplit(".", 1)[-1] or "attention"
    size = _int_attr(module, _SIZE_ATTRS)
    if cfg is not None:
        n_kv, kv_source = cfg.n_kv_head, cfg.kv_source
        config = getattr(model, cfg.source.split(".")[0], None)
        if kv_source == cfg.source and getattr(config, "multi_query", False) is True:
            n_kv, kv_source = 1, f"{cfg.source.split('.')[0]}.multi_query"
        return Heads(cfg.n_head, n_kv, size[1] if size else cfg.head_dim, cfg.source, kv_source)
    count = _int_attr(module, _COUNT_ATTRS)
    if count is None:
        return None
    kv = _int_attr(module, _KV_ATTRS)
    if size is None:
        width = next((c.in_features for n, c in module.named_children() if n in PROJECTIONS  # the hidden size
                      and isinstance(c, nn.Linear)), None)
        if width is None or width % count[1]:
            return None
        size = ("", width // count[1])
    source = f"{name}.{count[0]}"
    return Heads(count[1], kv[1] if kv else count[1], size[1], source, f"{name}.{kv[0]}" if kv else source)


def fused_parts(attention: nn.Module, linear: nn.Linear, info: Heads) -> tuple[int, ...] | None:
    """The widths packed in a fused q/k/v projection, from its weight's shape; None when it is not one."""
    names = {n for n, _ in attention.named_children()}
    if {"q_proj", "k_proj"} <= names or {"wq", "wk"} <= names or {"query", "key"} <= names:
        return None  # separate projections
    from dtp.placement import features

    q, width, hd = info.n_head * info.head_dim, features(linear)[1], info.head_dim
    if width <= q:
        return None
    if width == 3 * q:
        return (q, q, q)
    if (width - q) % (2 * hd) == 0:
        kv = (width - q) // 2
        return (q, kv, kv)
    return None


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


def check_per_head_lists(res, model: nn.Module, tp: int | None, rep) -> None:
    """Refuse splitting the heads of an attention that keeps one module per head in a ModuleList (StableLM
    2 12B's q/k LayerNorms): the model zips a rank's local heads with the list's first entries."""
    from dtp.resolve import sharded_colwise

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
