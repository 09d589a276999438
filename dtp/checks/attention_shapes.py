"""Check rules for attentions whose own code reads all heads: a per-head bias built outside the attention (ALiBi)
that no `slice_input` cuts, and a head count or width the forward shapes tensors with that no `set` rewrites.
Either runs without a tensor error and computes the wrong attention (parity finds it only after a run)."""
from __future__ import annotations

import torch.nn as nn

from dtp.checks.heads import split_attentions
from dtp.checks.messages import Reporter
from dtp.lang.vocabulary import slice_names
from dtp.layout.attention import Heads
from dtp.layout.forward_source import forward_facts
from dtp.layout.modules import forward_inputs
from dtp.layout.resolve import Resolution, generic_path

ALIBI_INPUTS = ("alibi", "position_bias")  # Bloom, Falcon-RW; MPT
_SIZE_NAMES = ("head_dim", "head_size")  # a head's size does not change when heads are split
# n_rep, num_key_value_groups: a ratio of head counts, unchanged where tp splits both (equal to a head count
# only by coincidence, 4 heads over 2 key/value heads); repeat(kv)'s hint rewrites it where it must change
_RATIO_WORDS = ("group", "rep")
_INDEX_WORDS = ("layer", "idx", "index")  # a layer's index (BART's layer_idx 4 in a 4-head model) is no size


def check_attention_shapes(res: Resolution, model: nn.Module, tp: int | None, rep: Reporter) -> None:
    """For every attention whose heads the plan splits: ALiBi inputs are sliced, head-count attributes set."""
    if tp == 1:
        return
    for path, module, info, projs in split_attentions(res, model):
        rule = res.claims[projs[0]]
        where = (rule.style.pos, len(rule.style.name), projs[0])
        _alibi(res, model, path, module, where, rep)
        _head_attributes(res, path, module, info, tp, where, rep)


def _alibi(res: Resolution, model: nn.Module, path: str, module: nn.Module, where: tuple, rep: Reporter) -> None:
    named, _ = forward_inputs(module)
    bias = next((n for n in ALIBI_INPUTS if n in named), None)
    config = getattr(model, "config", None)
    if bias is None or getattr(config, "alibi", True) is False:  # Falcon without ALiBi passes alibi=None
        return
    rule = res.claims.get(path)
    if rule is not None and rule.style.name == "slice_input" and bias in slice_names(rule.style):
        return
    folded = getattr(config, "alibi", None) is True and "attention_mask" in named  # Falcon: bias folded into the mask
    fix = f"slice_input(name=[{bias}, attention_mask], dim=1)" if folded else f"slice_input(name={bias})"
    also = " (this model folds the bias into attention_mask too)" if folded else ""
    rep.add(*where, f"the heads of {generic_path(path)} are split, but its forward also takes `{bias}`, an ALiBi "
            f"bias built for every head outside it, which each rank would add to its own heads; cut it to this "
            f"rank's heads{also}: `{generic_path(path)}: {fix}`")


def _head_attributes(res: Resolution, path: str, module: nn.Module, info: Heads, tp: int | None, where: tuple,
                     rep: Reporter) -> None:
    facts = forward_facts(module)
    if facts is None:
        return
    counts = {info.n_head: "query heads", info.n_head * info.head_dim: "query features"}
    if info.n_kv_head > 1 and (tp is None or info.n_kv_head % tp == 0):  # whole key/value heads are split too
        counts.setdefault(info.n_kv_head, "key/value heads")
    for attr in sorted(facts.shape_attrs):
        value = getattr(module, attr, None)
        if attr in _SIZE_NAMES or isinstance(value, bool) or not isinstance(value, int) or value not in counts:
            continue
        if any(w in attr.lower() for w in _RATIO_WORDS + _INDEX_WORDS):  # the same on every rank
            continue
        if (path, attr) in res.sets:
            continue
        rep.add(*where, f"{generic_path(path)}'s forward shapes its heads with self.{attr} ({value}, the "
                f"{counts[value]} of the whole model), but each rank holds only its share of the heads; rewrite it: "
                f"`set {generic_path(path)}.{attr} = {attr} / tp`")
