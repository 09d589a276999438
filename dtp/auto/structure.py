"""The parts of a model `dtp plan --auto` writes rules for, found by structure and data flow, never
by names alone.

- the input embedding and the output head (their rows are the vocabulary);
- the blocks: children of a ModuleList, Sequential or ModuleDict, or sibling attributes of one
  class, that hold modules of their own (dtp/layout/blocks.py);
- inside a block, every module whose linear children form Megatron's pair: "first" layers reading
  the module's input (colwise) and one "second" layer reading only what they computed (rowwise), as
  the forward's source says (dtp/layout/forward_source.py) or, where the source cannot be followed
  (a lambda, a partial, a ModuleDict called from its parent), as one forward on fake tensors ran it
  (dtp/layout/trace.py); a module with linears but no such pair (a router, a gate) is not one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from dtp.layout.attention import PROJECTIONS, attention_like
from dtp.layout.blocks import blocks as layout_blocks
from dtp.layout.forward_source import forward_facts
from dtp.layout.modules import features, is_experts, is_linear
from dtp.layout.trace import Trace
from dtp.models.spec import vocab_size


@dataclass(frozen=True)
class Pair:
    """A module whose linear children form Megatron's colwise → rowwise pair."""

    owner: str  # path relative to its block ("" for the block itself)
    firsts: tuple[str, ...]  # child names, read the owner's input
    second: str  # child name, reads only what the firsts computed
    # other children on the way from the firsts to the second (norms, activations)
    between: tuple[str, ...]
    # linear children outside the pair (routers, gates): they stay replicated
    others: tuple[str, ...]
    # the source did not show the flow: q/k/v by their names, the output by elimination
    by_names: bool = False


@dataclass(frozen=True)
class Ends:
    """The vocabulary's two ends: the input embedding and the output head (None where the model has
    none)."""

    vocab: int | None
    embedding: str | None
    head: str | None
    tied: bool
    # other embeddings holding the same weight (ProphetNet's decoder): vocab_parallel too
    also: tuple[str, ...] = ()


def ends(model: nn.Module) -> Ends:
    """The input embedding (an nn.Embedding of vocabulary rows) and the output head (a linear of
    vocabulary outputs)."""
    vocab = vocab_size(model)
    names = {id(m): n for n, m in model.named_modules()}
    embedding = head = None
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            found = getter()
            embedding = names.get(id(found)) if isinstance(found, nn.Embedding) else None
        except (NotImplementedError, AttributeError):
            embedding = None
    if embedding is None:
        embedding = next(
            (
                n
                for n, m in model.named_modules()
                if isinstance(m, nn.Embedding) and m.num_embeddings == vocab
            ),
            None,
        )
    heads = [n for n, m in model.named_modules() if is_linear(m) and features(m)[1] == vocab]
    head = heads[-1] if heads else None
    tied = (
        bool(embedding and head)
        and model.get_submodule(embedding).weight is model.get_submodule(head).weight
    )
    weight = model.get_submodule(embedding).weight if embedding else None
    also = tuple(
        n
        for n, m in model.named_modules()
        if n not in (embedding, head)
        and weight is not None
        and isinstance(m, nn.Embedding)
        and m.weight is weight
    )
    return Ends(vocab, embedding, head, tied, also)


def blocks(model: nn.Module) -> list[str]:
    """The model's repeated blocks, however the code holds them (dtp/layout/blocks.py)."""
    return layout_blocks(dict(model.named_modules()))


def pairs(block: nn.Module, tr: Trace | None = None, at: str = "") -> list[Pair]:
    """Every module in `block` (the block itself included) whose linear children form a colwise →
    rowwise pair: as the forward's source shows, else as the model's trace `tr` saw it run (`at`:
    the block's path in it)."""
    out = []
    for path, module in block.named_modules():
        linears = [n for n, c in module.named_children() if is_linear(c)]
        if len(linears) < 2:
            continue
        pair = _pair(path, module, linears)
        if pair is None and tr is not None:
            pair = _traced_pair(tr, ".".join(p for p in (at, path) if p), path, module, linears)
        if pair is None and attention_like(module):
            pair = _named_pair(path, linears)
        if pair is not None:
            out.append(pair)
    return out


def _traced_pair(
    tr: Trace, full: str, path: str, module: nn.Module, linears: list[str]
) -> Pair | None:
    """The pair as one forward ran it: for a forward the source reader cannot follow (a lambda over
    a ModuleDict, minGPT's `mlpf`; a `functools.partial`; a `match`). Only modules the trace saw
    run."""
    if not tr.ok or not all(tr.called(f"{full}.{n}") for n in linears):
        return None
    among = {f"{full}.{n}" for n in linears}
    # a container is never called: its parent's
    inside = full.rpartition(".")[0] if not tr.called(full) else full
    fed = {
        n: tr.nearest(tr.edges.get(f"{full}.{n}", set()), among - {f"{full}.{n}"}, inside)[0]
        for n in linears
    }
    seconds = [n for n in linears if fed[n]]
    if len(seconds) != 1:
        return None
    second = seconds[0]
    feeding = tuple(n for n in linears if f"{full}.{n}" in fed[second] and not fed[n])
    if not feeding or any(features(module.get_submodule(n))[1] < 1 for n in feeding):
        return None
    if (
        tr.called(full)
        and f"{full}.{second}" not in tr.nearest(tr.outputs.get(full, set()), among, full)[0]
    ):
        return None  # the module's result does not come from the second layer
    firsts = {f"{full}.{n}" for n in feeding}
    reads_second = tr.edges.get(f"{full}.{second}", set())
    between = tuple(
        n
        for n, _ in module.named_children()
        if n not in linears
        and tr.called(f"{full}.{n}")
        and tr.nearest(tr.inputs.get(f"{full}.{n}", set()), firsts, inside)[0]
        and tr.nearest(reads_second, {f"{full}.{n}"}, inside)[0]
    )
    others = tuple(n for n in linears if n not in feeding and n != second)
    return Pair(path, feeding, second, between, others)


def _pair(path: str, module: nn.Module, linears: list[str]) -> Pair | None:
    facts = forward_facts(module)
    if facts is None or any(n not in facts.inputs for n in linears):
        return None
    lin = set(linears)

    def fed_by(name: str) -> frozenset[str]:
        return facts.inputs.get(name, frozenset())

    firsts = [n for n in linears if not fed_by(n) & lin]
    seconds = [n for n in linears if fed_by(n) & lin]
    if len(seconds) != 1:
        return None
    second = seconds[0]
    if second not in facts.result and not (facts.result & _downstream(second, facts.inputs)):
        return None  # the owner's result does not come from the second layer
    feeding = tuple(n for n in firsts if n in fed_by(second))
    if not feeding:
        return None
    width = features(module.get_submodule(second))[0]
    if any(features(module.get_submodule(n))[1] < 1 for n in feeding) or width < 1:
        return None
    between = tuple(
        n
        for n, c in module.named_children()
        if n not in lin and n in fed_by(second) and fed_by(n) & set(feeding)
    )
    others = tuple(n for n in linears if n not in feeding and n != second)
    return Pair(path, feeding, second, between, others)


def _named_pair(path: str, linears: list[str]) -> Pair | None:
    """An attention whose forward's source does not show its flow (projections called in a loop):
    the children named as q/k/v projections are the firsts, the one other linear the second."""
    firsts = tuple(n for n in linears if n in PROJECTIONS)
    rest = [n for n in linears if n not in PROJECTIONS]
    return Pair(path, firsts, rest[0], (), (), by_names=True) if firsts and len(rest) == 1 else None


def _downstream(name: str, inputs: dict[str, frozenset[str]]) -> frozenset[str]:
    """The children whose input comes from `name`'s output."""
    return frozenset(n for n, src in inputs.items() if name in src)


def experts(block: nn.Module) -> list[str]:
    """Paths (in `block`) of modules holding every expert's FFN as 3-D parameters dtp can split."""
    return [p for p, m in block.named_modules() if p and is_experts(m)]
