"""The rules `dtp plan --auto` writes for one attention: Megatron's split by heads, found from
shapes and source.

Query/key/value projections are colwise, the output projection rowwise. A fused projection's parts
come from its weight's shape (dtp/layout/attention.py); whether it is [q | k | v] (`packed`) or
interleaved per head or group (plain colwise) from how the forward takes it apart
(dtp/auto/sizes.py). Key/value heads tp does not divide are repeated (`repeat(kv)`) where tp is a
multiple of them. Per-head norms, per-head parameters and ALiBi inputs get the rule their shape asks
for; the attributes the forward sizes tensors with are `set` to this rank's values. Anything else
leaves the attention whole, with the reason.
"""

from __future__ import annotations

from dataclasses import replace

import torch.nn as nn

from dtp.auto.rules import Line, Unit
from dtp.auto.sizes import fused_view, input_width_sizes, size_reads
from dtp.auto.structure import Pair, Reading, module_heads, stated, stated_int
from dtp.checks.attention_shapes import ALIBI_INPUTS
from dtp.layout.attention import HEAD_SIZES, Heads, fused_parts
from dtp.layout.modules import features, forward_inputs
from dtp.layout.norms import is_norm, norm_width
from dtp.layout.styles import Style

_PRIORITY = (
    "query heads per key/value head",
    "key/value features",
    "key/value heads",
    "query heads",
    "query features",
)  # the most specific word in a name decides what it counts
# names of head counts and widths
_WORDS = ("head", "kv", "key_value", "group", "rep", "embed_dim", "split_size")


def attention_unit(
    reading: Reading, owner_path: str, module: nn.Module, pair: Pair, tp: int
) -> Unit:
    """The rules for attention `module` (at `owner_path` in the model) at `tp`, or why it stays
    whole."""
    unit = Unit(pair.owner, "attention")
    info = _own_heads(module, owner_path, pair, _heads(reading, owner_path, module))
    if info is None:
        return unit.refuse("neither the config nor the module states its head count")
    if info.n_head % tp:
        return unit.refuse(f"{info.n_head} query heads ({info.source}) do not divide by tp={tp}")
    if info.n_head % info.n_kv_head:
        return unit.refuse(
            f"{info.n_head} query heads are no multiple of {info.n_kv_head} key/value heads "
            f"({info.kv_source})"
        )
    if any(
        isinstance(c, nn.ModuleList) and len(c) in (info.n_head, info.n_kv_head) and len(c) > 1
        for c in module.modules()
    ):
        return unit.refuse(
            "it keeps one module per head in a list, which split heads would pair with other heads"
        )
    width = reading.source(input_width_sizes, module)
    if width:
        return unit.refuse(
            f"its forward sizes the heads' output with `{width}`, its input's whole width, read "
            "from "
            "the tensor: no `set` can make that this rank's"
        )
    kv = _kv_mode(info, tp)
    rel = lambda c: f"{pair.owner}.{c}" if pair.owner else c
    lines: list[Line] = []
    if len(pair.firsts) == 1:
        found = _fused(reading, module, pair.firsts[0], info, kv, tp)
        if isinstance(found, str):
            return unit.refuse(found)
        style, why, local_kv, info, grouped = found
        lines.append(Line(rel(pair.firsts[0]), style, why))
    else:
        found = _separate(module, pair.firsts, info, kv, tp)
        if isinstance(found, str):
            return unit.refuse(found)
        local_kv, grouped = found[1], frozenset()
        lines += [Line(rel(n), s, w) for n, s, w in found[0]]
    second = module.get_submodule(pair.second)
    if features(second)[0] != info.n_head * info.head_dim:
        return unit.refuse(
            f"{pair.second} reads {features(second)[0]} features, not the {info.n_head} heads × "
            f"{info.head_dim} the projections make"
        )
    lines.append(
        Line(
            rel(pair.second),
            "rowwise",
            "output projection: partial sums over this rank's heads, all-reduced",
        )
    )
    extra = _around(reading, module, pair, info, kv, rel)
    if isinstance(extra, str):
        return unit.refuse(extra)
    lines += extra
    sets = _sets(reading, module, info, tp, local_kv, pair.owner, grouped)
    if isinstance(sets, str):
        return unit.refuse(sets)
    return Unit(pair.owner, "attention", tuple(lines + sets))


def _heads(reading: Reading, path: str, module: nn.Module) -> Heads | None:
    """The heads of attention module `path`: the model's config first (its head size where the
    module states one), the module's own attributes second (dtp/layout/attention.py's `heads`, each
    read once)."""
    if reading.heads is None:
        return module_heads(path, module)
    size = stated_int(module, HEAD_SIZES)
    return replace(reading.heads, head_dim=size[1]) if size else reading.heads


def _own_heads(module: nn.Module, path: str, pair: Pair, info: Heads | None) -> Heads | None:
    """The config's head counts, unless they do not make the output projection's width and the
    module's own attributes do (BART's decoder: `config.num_attention_heads` is the encoder's
    count)."""
    width = features(module.get_submodule(pair.second))[0]
    if info is not None and info.n_head * info.head_dim == width:
        return info
    own = module_heads(path, module)
    return own if own is not None and own.n_head * own.head_dim == width else info


def _kv_mode(info: Heads, tp: int) -> str | None:
    """ "split" (tp divides the key/value heads), "repeat" (tp is a multiple of them) or None."""
    if info.n_kv_head % tp == 0:
        return "split"
    if tp % info.n_kv_head == 0:
        return "repeat"
    return None


def _heads_text(info: Heads) -> str:
    kv = "" if info.n_kv_head == info.n_head else f", {info.n_kv_head} key/value ({info.kv_source})"
    return f"{info.n_head} query heads ({info.source}){kv}, head size {info.head_dim}"


def _fused(reading: Reading, module: nn.Module, name: str, info: Heads, kv: str | None, tp: int):
    """(style, why, local key/value heads, heads as the weight says, attributes counting interleaved
    groups) for a fused q/k/v projection, or why it cannot be split."""
    layout, reads = reading.source(fused_view, module, name) or (None, frozenset())
    found = _fused_style(module, name, info, kv, tp, layout)
    if isinstance(found, str):
        return found
    style, why, local_kv = found
    q, k, _ = fused_parts(module, module.get_submodule(name), info)
    n_kv = k // info.head_dim
    weight_info = (
        replace(info, n_kv_head=n_kv, kv_source="the weight's shape")
        if n_kv != info.n_kv_head
        else info
    )
    return (
        style,
        why,
        local_kv,
        weight_info,
        (reads if layout == "interleaved" and style == Style.COLWISE else frozenset()),
    )


def _fused_style(
    module: nn.Module, name: str, info: Heads, kv: str | None, tp: int, layout: str | None
):
    linear = module.get_submodule(name)
    parts = fused_parts(module, linear, info)
    if parts is None:
        return f"{name}'s {features(linear)[1]} outputs are no q/k/v split of {_heads_text(info)}"
    q, k, v = parts
    shape = f"fused q|k|v {q}|{k}|{v} from the weight's shape"
    if k == info.head_dim < q:
        return (
            "colwise(packed=[q, replicate(head), replicate(head)])",
            f"{shape}: multi-query, the one key/value head whole on every rank",
            1,
        )
    if layout is None:
        return f"the forward's source does not show whether {name} packs [q | k | v] or interleaves heads"
    if layout == "interleaved":
        groups = info.n_kv_head if k < q else info.n_head
        if groups % tp:
            return f"{name} interleaves {groups} groups of heads, which tp={tp} does not divide"
        what = "key/value group" if k < q else "head"
        return (
            "colwise",
            f"{shape}, interleaved per {what} (the forward views it to heads first): whole heads a "
            "rank",
            info.n_kv_head // tp,
        )
    if q == k:
        return (
            "colwise(packed=3)",
            f"{shape}, [q | k | v] (the forward splits it): whole heads of each a rank",
            info.n_head // tp,
        )
    if kv == "split":
        return (
            "colwise(packed=[q, kv, kv])",
            f"{shape}, grouped-query {info.n_head}/{info.n_kv_head}",
            info.n_kv_head // tp,
        )
    if kv == "repeat":
        return (
            "colwise(packed=[q, repeat(kv), repeat(kv)])",
            f"{shape}, {info.n_kv_head} key/value heads < tp: each rank the one its query heads "
            "read",
            1,
        )
    return f"{info.n_kv_head} key/value heads neither divide by tp={tp} nor divide it"


def _separate(module: nn.Module, firsts: tuple[str, ...], info: Heads, kv: str | None, tp: int):
    """([(name, style, why)], local key/value heads) for separate projections, or why they cannot be
    split."""
    q_width, kv_width = info.n_head * info.head_dim, info.n_kv_head * info.head_dim
    out = []
    for name in firsts:
        width = features(module.get_submodule(name))[1]
        if width == q_width:
            out.append((name, "colwise", f"{_heads_text(info)}: this rank's heads"))
        elif width == kv_width and kv == "split":
            out.append(
                (
                    name,
                    "colwise",
                    f"grouped-query: {info.n_kv_head // tp} of {info.n_kv_head} key/value heads a "
                    "rank",
                )
            )
        elif width == kv_width and kv == "repeat":
            out.append(
                (
                    name,
                    "colwise(packed=[repeat(kv)])",
                    f"{info.n_kv_head} key/value heads < tp={tp}: each rank the one its query heads "
                    "read",
                )
            )
        elif width == kv_width:
            return f"{info.n_kv_head} key/value heads neither divide by tp={tp} nor divide it"
        else:
            return f"{name} makes {width} features, neither the query ({q_width}) nor key/value ({kv_width}) width"
    if not any(
        w == Style.COLWISE and features(module.get_submodule(n))[1] == q_width for n, w, _ in out
    ):
        return "no projection makes the query heads"
    local = info.n_kv_head // tp if kv == "split" or info.n_kv_head == info.n_head else 1
    return out, local


def _around(
    reading: Reading, module: nn.Module, pair: Pair, info: Heads, kv: str | None, rel
) -> list[Line] | str:
    """Rules for what sits between the projections (norms of q or k), per-head parameters and ALiBi
    inputs."""
    q_width, kv_width, out = info.n_head * info.head_dim, info.n_kv_head * info.head_dim, []
    for name in pair.between:
        child = module.get_submodule(name)
        if not any(True for _ in child.parameters(recurse=True)):
            continue
        width = norm_width(child) if is_norm(child) else 0
        if width == info.head_dim:
            out.append(
                Line(
                    rel(name),
                    "replicate(reduce_grad=true)",
                    f"per-head norm ({width}) on this rank's heads: its gradient summed over the "
                    "ranks",
                )
            )
        elif width and width in (q_width, kv_width):
            repeat = width == kv_width != q_width and kv == "repeat"
            style = "sharded_norm(packed=[repeat(kv)])" if repeat else "sharded_norm"
            out.append(
                Line(
                    rel(name),
                    style,
                    f"norm over all {width} features of the heads: this rank's heads, "
                    "sum of squares all-reduced",
                )
            )
        else:
            return f"{name} ({type(child).__name__}) holds parameters on the heads' features that no rule can split"
    own = [
        n
        for n, p in module.named_parameters(recurse=False)
        if p.dim() >= 1 and p.shape[0] == info.n_head
    ]
    if own:
        names = own[0] if len(own) == 1 else "[" + ", ".join(own) + "]"
        out.append(
            Line(
                pair.owner,
                f"slice_params(name={names})",
                "one value per query head: each rank its heads'",
            )
        )
    elif any(True for _ in module.parameters(recurse=False)):
        return "it holds parameters of its own that are not one per query head"
    named, _ = reading.source(forward_inputs, module) or ([], True)
    bias = next((n for n in ALIBI_INPUTS if n in named), None)
    alibi = reading.value(stated(module, "config"), "alibi")
    folded = alibi is True and "attention_mask" in named
    if bias and alibi is not False:
        style = (
            f"slice_input(name=[{bias}, attention_mask], dim=1)"
            if folded
            else f"slice_input(name={bias})"
        )
        out.append(
            Line(
                pair.owner,
                style,
                f"the forward takes `{bias}`, a bias for every head built outside it",
            )
        )
    # transformers 5.25's Falcon: the ALiBi bias reaches attention inside the 4-D mask alone
    elif folded:
        out.append(
            Line(
                pair.owner,
                "slice_input(name=attention_mask, dim=1)",
                "the model folds an ALiBi bias for "
                "every head into `attention_mask`: this rank's heads' planes",
            )
        )
    return out


def _sets(
    reading: Reading,
    module: nn.Module,
    info: Heads,
    tp: int,
    local_kv: int,
    owner: str,
    grouped: frozenset[str],
) -> list[Line] | str:
    """`set` lines for every head-count attribute (read by the forward as a size, or named as one)
    whose value this rank holds less of; `grouped`: the attributes an interleaved projection is
    viewed to groups by."""
    reads = reading.source(size_reads, module) or set()
    facts = reading.facts(module)
    named = {
        n
        for n, v in vars(module).items()
        if isinstance(v, int) and any(w in n.lower() for w in _WORDS)
    }
    names = sorted(
        n
        for n in reads | (facts.shape_attrs if facts else set()) | named | grouped
        if not any(w in n.lower() for w in ("layer", "idx"))
    )
    local_q = info.n_head // tp
    quantities = {  # (global, local, words a name of it would contain)
        "query heads": (info.n_head, local_q, ("head",)),
        "query features": (
            info.n_head * info.head_dim,
            local_q * info.head_dim,
            ("dim", "size", "embed", "hidden"),
        ),
        "key/value heads": (info.n_kv_head, local_kv, ("kv", "key_value")),
        "key/value features": (
            info.n_kv_head * info.head_dim,
            local_kv * info.head_dim,
            ("kv_dim", "kv_size"),
        ),
        "query heads per key/value head": (
            info.n_head // info.n_kv_head,
            local_q // local_kv if local_kv else 0,
            ("group", "rep"),
        ),
    }
    out = []
    for name in names:
        value = _read(reading, module, name)
        if value is None or name.rpartition(".")[2] in HEAD_SIZES:
            continue
        if name in grouped:  # the number of interleaved groups: a rank holds 1/tp of them
            if value % tp:
                return f"{name} interleaves {value} groups of heads, which tp={tp} does not divide"
            hits = {"interleaved groups of heads": (value, value // tp, ())}
        else:  # a head count whose name says what it counts
            leaf = name.rpartition(".")[2].lower()
            # groups before kv
            said = next((q for q in _PRIORITY if any(w in leaf for w in quantities[q][2])), None)
            if info.kv_source.rpartition(".")[2].lower() == leaf and info.n_kv_head != info.n_head:
                # the name the heads were found under (gpt-fast's n_local_heads)
                said = "key/value heads"
            hits = {k: q for k, q in quantities.items() if k == said and q[0] == value}
        locals_ = {q[1] for q in hits.values()}
        if not hits or locals_ == {value}:
            continue
        if len(locals_) > 1:
            return f"self.{name} ({value}) could be {' or '.join(hits)}, which differ on a rank"
        what, (_, local, _) = next(iter(hits.items()))
        leaf = name.rpartition(".")[2]
        expr = f"{leaf} / tp" if local * tp == value else str(local)
        path = ".".join(p for p in (owner, name) if p)
        out.append(
            Line(
                path,
                expr,
                f"the forward sizes tensors with self.{name}, the {what} ({value})",
                is_set=True,
            )
        )
    return out


def _read(reading: Reading, module: nn.Module, name: str) -> int | None:
    """`self.NAME` as the module stores it, or `self.config.NAME` as its config gives it (once)."""
    first, *rest = name.split(".")
    obj = stated(module, first)
    for part in rest:
        obj = reading.value(obj, part)
    return obj if isinstance(obj, int) and not isinstance(obj, bool) and obj > 0 else None
