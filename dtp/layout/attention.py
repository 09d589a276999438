"""Which modules are attention, how many heads they hold, and what a fused projection really packs.

Decided by structure, not by a module's path: a module is attention-like when its class says so,
when it keeps head counts or a head size as integer attributes, or when it owns q/k/v (or fused qkv)
projections. Head counts come from the model's config where it has one (`config_heads`), else from
the attention module's own attributes. A fused projection's parts are read from its weight's shape:
`config.multi_query` or a key/value head count in the config are only cross-checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from dtp.lang.conditions import CONFIG_ATTRS
from dtp.layout.modules import features
from dtp.layout.trace import model_trace

# Names of query/key/value projections across common codebases (Hugging Face, nanoGPT, Meta's Llama,
# MPT).
PROJECTIONS = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "qkv_proj",
        "c_attn",
        "q_attn",
        "query_key_value",
        "wq",
        "wk",
        "wv",
        "wqkv",
        "Wqkv",
        "query",
        "key",
        "value",
        "qkv",
        "kv_proj",
        "in_proj",
    }
)
HEAD_COUNTS = ("num_heads", "n_head", "n_heads", "num_attention_heads")
KV_HEAD_COUNTS = ("num_key_value_heads", "n_kv_head", "n_kv_heads", "num_kv_heads")
HEAD_SIZES = ("head_dim", "head_size")
# a config's names, in this order
_CONFIG_HEAD_KEYS = ("n_head", "num_attention_heads", "n_heads", "num_heads")
_HIDDEN_KEYS = ("n_embd", "hidden_size", "dim", "d_model")


def _int_attr(obj: object, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def attention_like(
    module: nn.Module,
    read: Callable[[object, tuple[str, ...]], tuple[str, int] | None] = _int_attr,
) -> bool:
    """Whether `module` is an attention layer, judged by its class, its attributes (`read(module,
    names)`: the first positive integer among them) and its projections."""
    if "attention" in type(module).__name__.lower():
        return True
    if read(module, HEAD_COUNTS + KV_HEAD_COUNTS + HEAD_SIZES):
        return True
    return any(
        name in PROJECTIONS and isinstance(child, nn.Linear)
        for name, child in module.named_children()
    )


@dataclass(frozen=True)
class Heads:
    """Head counts and size for one attention module, and where each number came from."""

    n_head: int
    n_kv_head: int
    head_dim: int
    source: str  # e.g. "config.n_head" or "attn.n_heads"
    kv_source: str = ""  # e.g. "config.num_key_value_heads"


def heads(model: nn.Module, path: str, module: nn.Module) -> Heads | None:
    """The heads of attention module `path`: the model's config first, the module's own attributes
    second."""
    cfg = config_heads(model)
    size = _int_attr(module, HEAD_SIZES)
    if cfg is not None:
        n_kv, kv_source = cfg.n_kv_head, cfg.kv_source
        config = getattr(model, cfg.source.split(".")[0], None)
        if kv_source == cfg.source and getattr(config, "multi_query", False) is True:
            n_kv, kv_source = 1, f"{cfg.source.split('.')[0]}.multi_query"
        return Heads(cfg.n_head, n_kv, size[1] if size else cfg.head_dim, cfg.source, kv_source)
    return module_heads(path, module)


def module_heads(
    path: str,
    module: nn.Module,
    read: Callable[[object, tuple[str, ...]], tuple[str, int] | None] = _int_attr,
) -> Heads | None:
    """The heads of attention module `path` from its own attributes alone (a head count, a key/value
    count, a head size or the projections' width; `read(module, names)` as attention_like takes
    it)."""
    name = path.rsplit(".", 1)[-1] or "attention"
    size = read(module, HEAD_SIZES)
    count = read(module, HEAD_COUNTS)
    if count is None:
        return None
    kv = read(module, KV_HEAD_COUNTS)
    if size is None:
        # the hidden size
        width = next(
            (
                c.in_features
                for n, c in module.named_children()
                if n in PROJECTIONS and isinstance(c, nn.Linear)
            ),
            None,
        )
        if width is None or width % count[1]:
            return None
        size = ("", width // count[1])
    source = f"{name}.{count[0]}"
    return Heads(
        count[1], kv[1] if kv else count[1], size[1], source, f"{name}.{kv[0]}" if kv else source
    )


def fused_parts(attention: nn.Module, linear: nn.Linear, info: Heads) -> tuple[int, ...] | None:
    """The widths packed in a fused q/k/v projection, from its weight's shape; None when it is not
    one."""
    names = {n for n, _ in attention.named_children()}
    if {"q_proj", "k_proj"} <= names or {"wq", "wk"} <= names or {"query", "key"} <= names:
        return None  # separate projections
    q, width, hd = info.n_head * info.head_dim, features(linear)[1], info.head_dim
    if width <= q:
        return None
    if width == 3 * q:
        return (q, q, q)
    if (width - q) % (2 * hd) == 0:
        kv = (width - q) // 2
        return (q, kv, kv)
    return None


def _read(config: object, key: str) -> object:
    """`config.key`, or None: a config may refuse a global read of a per-layer value (transformers'
    heterogeneous configs raise their own error, not AttributeError)."""
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - whatever a config raises, it does not state this value
        return None


def config_heads(model: nn.Module) -> Heads | None:
    """Head counts from the model's config object (`config`, `model_args` or `args`), if it has one."""
    # the first config that gives a head count (a model may hold several objects)
    for attr in CONFIG_ATTRS:
        config = getattr(model, attr, None)
        if config is None:
            continue
        n_head = next(
            ((k, _read(config, k)) for k in _CONFIG_HEAD_KEYS if isinstance(_read(config, k), int)),
            None,
        )
        if n_head is None:
            continue
        kv = next(
            ((k, _read(config, k)) for k in KV_HEAD_COUNTS if isinstance(_read(config, k), int)),
            None,
        )
        head_dim = _read(config, "head_dim")
        if not isinstance(head_dim, int):
            hidden = next(
                (_read(config, k) for k in _HIDDEN_KEYS if isinstance(_read(config, k), int)), None
            )
            if hidden is None:
                continue
            head_dim = hidden // n_head[1]
        source = f"{attr}.{n_head[0]}"
        # no key/value count under a name we
        if kv is None and getattr(config, "multi_query", None) is not True:
            # know: the forward's views say (gpt-fast's n_local_heads)
            traced = _traced_kv(model, config, attr, n_head[1], head_dim)
            if traced is not None:
                return Heads(n_head[1], traced[0], head_dim, source, traced[1])
        return Heads(
            n_head[1],
            kv[1] if kv else n_head[1],
            head_dim,
            source,
            f"{attr}.{kv[0]}" if kv else source,
        )
    return None


def _traced_kv(
    model: nn.Module, config: object, attr: str, n_head: int, head_dim: int
) -> tuple[int, str] | None:
    """The key/value head count the forward views its projections with, when it is not the query
    count: one count of heads of `head_dim` that divides `n_head` (e.g. 2 of 4), named after the
    config attribute that holds it."""
    tr = model_trace(model)
    if tr is None or not tr.ok:
        return None
    counts = {
        v.heads
        for views in tr.views.values()
        for v in views
        if v.head_dim == head_dim and v.heads != n_head and v.heads and n_head % v.heads == 0
    }
    if len(counts) != 1:
        return None
    kv = counts.pop()
    names = sorted(
        k
        for k in dir(config)
        if not k.startswith("_")
        and "head" in k.lower()
        and _read(config, k) == kv
        and not callable(_read(config, k))
    )
    return kv, f"{attr}.{names[0]}" if names else "the forward's views of the key/value projections"
