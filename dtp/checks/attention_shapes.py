"""Check rules for attentions whose own code reads all heads: a per-head bias built outside the
attention (ALiBi, as an input of its own or folded into the attention mask) that no `slice_input`
cuts, a head count or width the forward shapes tensors with that no `set` rewrites, and a key/value
repeat count (query heads per key/value head) left at the whole model's where the plan keeps
key/value heads whole. Each runs without a tensor error or fails only deep in the forward, and
computes the wrong attention (parity finds it only after a run)."""

from __future__ import annotations

import ast

import torch.nn as nn

from dtp.checks.heads import split_attentions
from dtp.checks.messages import Reporter
from dtp.lang.vocabulary import slice_names
from dtp.layout.attention import Heads
from dtp.layout.forward_source import forward_facts, is_self_attribute, method_ast
from dtp.layout.modules import features, forward_inputs
from dtp.layout.parts import try_parts
from dtp.layout.resolve import Resolution, generic_path
from dtp.layout.styles import Style

ALIBI_INPUTS = ("alibi", "position_bias")  # Bloom, Falcon-RW; MPT
_SIZE_NAMES = ("head_dim", "head_size")  # a head's size does not change when heads are split
# n_rep, num_key_value_groups: a ratio of head counts, unchanged where tp splits both (equal to a
# head count only by coincidence, 4 heads over 2 key/value heads); _repeat_count asks for it where
# key/value heads stay whole
_RATIO_WORDS = ("group", "rep")
# a layer's index (BART's layer_idx 4 in a 4-head model) is no size
_INDEX_WORDS = ("layer", "idx", "index")


def check_attention_shapes(
    res: Resolution, model: nn.Module, tp: int | None, rep: Reporter
) -> None:
    """For every attention whose heads the plan splits: ALiBi inputs are sliced, head-count
    attributes set, and a key/value repeat count set where key/value heads stay whole."""
    if tp == 1:
        return
    for path, module, info, projs in split_attentions(res, model):
        rule = res.claims[projs[0]]
        where = (rule.style.pos, len(rule.style.name), projs[0])
        _alibi(res, model, path, module, where, rep)
        _head_attributes(res, path, module, info, tp, where, rep)
        _repeat_count(res, path, module, info, projs, tp, rep)


def _alibi(
    res: Resolution, model: nn.Module, path: str, module: nn.Module, where: tuple, rep: Reporter
) -> None:
    named, _ = forward_inputs(module)
    bias = next((n for n in ALIBI_INPUTS if n in named), None)
    config = getattr(model, "config", None)
    # Falcon: bias folded into the mask
    folded = getattr(config, "alibi", None) is True and "attention_mask" in named
    # Falcon without ALiBi: alibi=None
    if (bias is None and not folded) or getattr(config, "alibi", True) is False:
        return
    rule = res.claims.get(path)
    sliced = (
        slice_names(rule.style) if rule is not None and rule.style.name == Style.SLICE_INPUT else ()
    )
    if (bias or "attention_mask") in sliced:
        return
    names = ", ".join(n for n in (bias, "attention_mask") if n)
    fix = f"slice_input(name=[{names}], dim=1)" if folded else f"slice_input(name={bias})"
    # transformers 5.25's Falcon: the mask alone carries the bias, one (queries, keys) plane a head
    if bias is None:
        what = (
            "`attention_mask`, into which the model folds an ALiBi bias built for every head "
            "outside it "
            "(config.alibi)"
        )
    else:
        what = f"`{bias}`, an ALiBi bias built for every head outside it"
    also = " (this model folds the bias into attention_mask too)" if folded and bias else ""
    rep.add(
        *where,
        f"the heads of {generic_path(path)} are split, but its forward also takes {what}, which "
        "each "
        f"rank would add to its own heads; cut it to this rank's heads{also}: "
        f"`{generic_path(path)}: {fix}`",
    )


def _head_attributes(
    res: Resolution,
    path: str,
    module: nn.Module,
    info: Heads,
    tp: int | None,
    where: tuple,
    rep: Reporter,
) -> None:
    facts = forward_facts(module)
    if facts is None:
        return
    counts = {info.n_head: "query heads", info.n_head * info.head_dim: "query features"}
    # whole key/value heads are split too
    if info.n_kv_head > 1 and (tp is None or info.n_kv_head % tp == 0):
        counts.setdefault(info.n_kv_head, "key/value heads")
    for attr in sorted(facts.shape_attrs):
        value = getattr(module, attr, None)
        if (
            attr in _SIZE_NAMES
            or isinstance(value, bool)
            or not isinstance(value, int)
            or value not in counts
        ):
            continue
        if any(w in attr.lower() for w in _RATIO_WORDS + _INDEX_WORDS):  # the same on every rank
            continue
        if (path, attr) in res.sets:
            continue
        rep.add(
            *where,
            f"{generic_path(path)}'s forward shapes its heads with self.{attr} ({value}, the "
            f"{counts[value]} of the whole model), but each rank holds only its share of the heads; "
            "rewrite it: "
            f"`set {generic_path(path)}.{attr} = {attr} / tp`",
        )


def _repeat_count(
    res: Resolution,
    path: str,
    module: nn.Module,
    info: Heads,
    projs: list[str],
    tp: int | None,
    rep: Reporter,
) -> None:
    """A ratio attribute (HF's num_key_value_groups, dtp Llama's n_rep) the attention repeats
    key/value heads by is unchanged where tp splits the key/value heads as it splits the query
    heads; where the plan keeps them whole (`replicate(head)`, `replicate(kv)`) or gives each rank
    one (`repeat(kv)` at tp above their count), a rank's n_head / tp query heads share fewer
    key/value heads than the whole model's count says, and it must be set."""
    if info.n_kv_head < 1 or info.n_head % info.n_kv_head:
        return
    ratio = info.n_head // info.n_kv_head
    found = _kv_kind(res, projs, info)
    if found is None:
        # key/value heads split with the query heads (or not known to be otherwise): the ratio holds
        return
    proj, kind = found
    if kind is False:  # whole on every rank: n_head / tp query heads read all n_kv_head
        local_kv = info.n_kv_head
        why = (
            f"every rank keeps all {local_kv} key/value heads"
            if local_kv > 1
            else "every rank keeps the key/value head"
        ) + " whole (replicated)"
    elif tp is None or kind % tp == 0 or tp % kind:
        # repeat(kv) that tp divides shards them as kv does (another tp: a rule elsewhere says so)
        return
    else:
        local_kv, why = (
            1,
            "each rank keeps the one key/value head its query heads read (repeat(kv))",
        )
    if tp is not None and (info.n_head % tp or (info.n_head // tp) % local_kv):
        return  # no whole heads: the head rules report it
    local = info.n_head // tp // local_kv if tp is not None else None
    for attr in sorted(
        k for k, v in vars(module).items() if isinstance(v, int) and not isinstance(v, bool)
    ):
        if getattr(module, attr) != ratio or not any(w in attr.lower() for w in _RATIO_WORDS):
            continue
        if local == ratio or (path, attr) in res.sets or not _reads(module, attr):
            continue
        if kind is False:
            expr = f"{attr} / tp"
        else:
            expr = f"{_heads_expr(module, info)} / tp"
        now = f" ({local} at tp={tp})" if local is not None else ""
        rule = res.claims[proj]
        rep.add(
            rule.style.pos,
            len(rule.style.name),
            proj,
            f"{generic_path(path)}'s attention repeats each key/value head self.{attr} times "
            f"({ratio}, the query "
            f"heads per key/value head of the whole model), but {why} and only its share of the "
            "query heads, "
            f"so fewer of them read each key/value head{now}; rewrite it: `set "
            f"{generic_path(path)}.{attr} = {expr}`",
        )


def _kv_kind(res: Resolution, projs: list[str], info: Heads) -> tuple[str, bool | int] | None:
    """(the projection, how a rank holds the key/value heads: False whole, an int H repeat(kv) of H
    heads) when a part list names them (`kv` or `head`, wrapped); None when they are split as the
    query heads are."""
    kinds = []
    for proj in projs:
        value = res.claims[proj].style.option("packed")
        parts = try_parts(value, features(res.modules[proj])[1], res.modules[""])
        for item, (size, kind) in zip(value.items if parts else (), parts):
            inner = str(item).rpartition("(")[2].rstrip(")")
            if inner in ("kv", "head") and size == info.n_kv_head * info.head_dim:
                kinds.append((proj, kind))
    if not kinds or len({k for _, k in kinds}) > 1 or kinds[0][1] is True:
        return None
    return kinds[0]


def _heads_expr(module: nn.Module, info: Heads) -> str:
    """The whole model's query-head count as a `set` expression names it (as repeat(kv)'s hint
    does)."""
    if info.source.startswith("config.") and hasattr(module, "config"):
        return info.source
    return str(info.n_head)


def _reads(module: nn.Module, attr: str) -> bool:
    """Whether the forward (or a `self.` method it calls) reads `self.<attr>`, or hands `self` to a
    function (HF's attention interface reads module.num_key_value_groups)."""
    seen, todo = {"forward"}, ["forward"]
    while todo:
        fn = method_ast(type(module), todo.pop())
        for node in ast.walk(fn) if fn is not None else ():
            if is_self_attribute(node) and node.attr == attr:
                return True
            if isinstance(node, ast.Call) and any(
                isinstance(a, ast.Name) and a.id == "self" for a in node.args
            ):
                return True
            if (
                isinstance(node, ast.Call)
                and is_self_attribute(node.func)
                and node.func.attr not in seen
            ):
                seen.add(node.func.attr)
                todo.append(node.func.attr)
    return False
