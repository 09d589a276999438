"""The parts of a model `dtp plan --auto` writes rules for, found by structure and data flow, never
by names alone.

- the input embedding and the output head (their rows are the vocabulary);
- the blocks: children of a ModuleList, Sequential or ModuleDict, or sibling attributes of one
  class, that hold modules of their own (dtp/layout/blocks.py);
- inside a block, every module whose linear children form Megatron's pair: "first" layers reading
  the module's input (colwise) and one "second" layer reading only what they computed (rowwise), as
  the forward's source says (dtp/layout/forward_source.py) or, where the source is read but cannot
  be followed (a loop, a `match`, a ModuleDict called from its parent through a lambda or a
  partial), as one forward on fake tensors ran it (dtp/layout/trace.py); a module with linears but
  no such pair (a router, a gate) is not one. A module whose forward's source cannot be read at all
  (a class made by `exec` or compiled code, a lambda, partial or builtin as `forward`, a forward set
  on the instance) has no pair: its layers' names are no evidence.

A `Reading` reads each of these once per model, whatever the number of blocks or tp values asked
about: one walk of the modules (at most MAX_MODULES), the forward's source once per kind of module,
the config once per attribute, the trace only when a source does not show a pair. Attributes of
modules are read as stored (`inspect.getattr_static`): no property runs.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, replace
from typing import Callable

import torch.nn as nn

from dtp.errors import UsageError
from dtp.layout.attention import (
    Heads,
    config_heads,
)
from dtp.layout.attention import attention_like as layout_attention_like
from dtp.layout.attention import module_heads as layout_module_heads
from dtp.layout.blocks import blocks as layout_blocks
from dtp.layout.forward_source import ForwardFacts, forward_facts, method_ast
from dtp.layout.modules import features, is_experts, is_linear
from dtp.layout.trace import Trace, model_trace
from dtp.models.spec import vocab_size

# Modules read: the largest real models hold about 10^4 (a MoE with every expert a module), a stack
# of 20,000 tiny blocks 2.6 × 10^5; past this a plan is written by hand (`layers.*`), not searched.
MAX_MODULES = 500_000

# Why no pair is read from a module whose forward's source dtp cannot read.
NO_SOURCE = "dtp splits only what a forward's source shows, never by the layers' names"


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


@dataclass(frozen=True)
class Parts:
    """What one block holds that rules are written for; the same at every tp."""

    pairs: tuple[tuple[Pair, bool], ...]  # each pair, and whether its owner is an attention
    experts: tuple[str, ...]  # paths (in the block) of expert modules
    # (path in the block, "attention" or "mlp", why) of modules with linears but no pair
    unpaired: tuple[tuple[str, str, str], ...]


def stated(obj: object, name: str) -> object:
    """`obj.name` as stored, in the instance or on its class (what `inspect.getattr_static` finds,
    without its cost); None for a property or any other descriptor (reading it would run code) and
    for what is not there."""
    on_class = next((c.__dict__[name] for c in type(obj).__mro__ if name in c.__dict__), None)
    if hasattr(type(on_class), "__get__"):
        return None  # a property, a method: on the class, it wins over the instance's value
    value = getattr(obj, "__dict__", {}).get(name, on_class)
    return None if hasattr(type(value), "__get__") else value


def stated_int(obj: object, names: tuple[str, ...]) -> tuple[str, int] | None:
    """The first of `names` that `obj` stores as a positive integer, and its value."""
    for name in names:
        value = stated(obj, name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def attention_like(module: nn.Module) -> bool:
    """Whether `module` is an attention layer, judged as dtp/layout/attention.py judges it, with
    attributes read as stored."""
    return layout_attention_like(module, read=stated_int)


def module_heads(path: str, module: nn.Module) -> Heads | None:
    """The heads of attention module `path` from its own stored attributes alone, as
    dtp/layout/attention.py reads them."""
    return layout_module_heads(path, module, read=stated_int)


def unreadable(module: nn.Module) -> str | None:
    """Why the source of the forward `module` runs cannot be read (None when it can)."""
    if "forward" in vars(module):
        return "it is set on the instance, not by the class"
    if method_ast(type(module), "forward") is not None:
        return None
    fn = inspect.getattr_static(type(module), "forward", None)
    if isinstance(fn, functools.partial):
        return "a functools.partial"
    if inspect.isfunction(fn) and fn.__name__ == "<lambda>":
        return "a lambda"
    if inspect.isfunction(fn):
        return "inspect.getsource finds none: a class made by exec or compiled code"
    return f"a {type(fn).__name__}, not a Python function"


def _kind(module: nn.Module) -> tuple:
    """All that reading a forward's source depends on: the class, the children's names and the
    boolean attributes (the branches `if self.FLAG:` takes)."""
    flags = tuple(sorted((k, v) for k, v in vars(module).items() if isinstance(v, bool)))
    return type(module), tuple(n for n, _ in module.named_children()), flags


class Reading:
    """What `dtp plan --auto` reads of one model, each thing once (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.modules = _walk(model)
        self.blocks = tuple(layout_blocks(self.modules))
        self._blocks = frozenset(self.blocks)
        self._sources: dict[tuple, object] = {}
        self._kinds: dict[int, tuple | None] = {}  # by id: every module is held in self.modules
        self._values: dict[tuple[int, str], tuple[object, object]] = {}
        self._parts: dict[str, Parts] = {}

    def in_block(self, path: str, strict: bool = False) -> bool:
        """Whether module `path` is a block (unless `strict`) or inside one."""
        if strict:
            path = path.rpartition(".")[0]
        while path:
            if path in self._blocks:
                return True
            path = path.rpartition(".")[0]
        return False

    def source(self, fn: Callable, module: nn.Module, *args: object):
        """`fn(module, *args)`, a reading of the module's forward's source, once per kind of module;
        None when that source cannot be read."""
        if id(module) not in self._kinds:
            self._kinds[id(module)] = None if unreadable(module) else _kind(module)
        if self._kinds[id(module)] is None:
            return None
        key = (fn, self._kinds[id(module)], args)
        if key not in self._sources:
            self._sources[key] = fn(module, *args)
        return self._sources[key]

    def facts(self, module: nn.Module) -> ForwardFacts | None:
        """What `module`'s forward reads (dtp/layout/forward_source.py); None without its source."""
        return self.source(forward_facts, module)

    def value(self, obj: object, name: str) -> object:
        """`getattr(obj, name, None)` for a config (Hugging Face's map names in
        `__getattribute__`), read once; None where reading it raises."""
        key = (id(obj), name)
        if key not in self._values:
            try:
                got = getattr(obj, name, None)
            except Exception:  # noqa: BLE001 - whatever a config raises, it does not state this
                got = None
            self._values[key] = (obj, got)  # obj kept: its id stays its own
        return self._values[key][1]

    @functools.cached_property
    def heads(self) -> Heads | None:
        """The config's head counts (dtp/layout/attention.py's config_heads; a multi-query config
        has one key/value head), read once."""
        cfg = config_heads(self.model)
        if cfg is None:
            return None
        holder = cfg.source.split(".")[0]
        config = self.value(self.model, holder)
        if cfg.kv_source == cfg.source and self.value(config, "multi_query") is True:
            return replace(cfg, n_kv_head=1, kv_source=f"{holder}.multi_query")
        return cfg

    @functools.cached_property
    def trace(self) -> Trace | None:
        """The model's one forward on fake tensors, run the first time a source does not show a
        pair."""
        return model_trace(self.model)

    @functools.cached_property
    def ends(self) -> Ends:
        """The input embedding (an nn.Embedding of vocabulary rows) and the output head (a linear of
        vocabulary outputs)."""
        model, modules = self.model, self.modules
        vocab = vocab_size(model)
        names = {id(m): n for n, m in modules.items()}
        embedding = None
        getter = getattr(model, "get_input_embeddings", None)
        if callable(getter):
            try:
                found = getter()
                embedding = names.get(id(found)) if isinstance(found, nn.Embedding) else None
            except Exception:  # noqa: BLE001 - the model's own method: the rows then tell
                embedding = None
        if embedding is None:
            embedding = next(
                (
                    n
                    for n, m in modules.items()
                    if isinstance(m, nn.Embedding) and m.num_embeddings == vocab
                ),
                None,
            )
        heads = [n for n, m in modules.items() if is_linear(m) and features(m)[1] == vocab]
        head = heads[-1] if heads else None
        weight = modules[embedding].weight if embedding else None
        tied = bool(embedding and head) and weight is modules[head].weight
        also = tuple(
            n
            for n, m in modules.items()
            if n not in (embedding, head)
            and weight is not None
            and isinstance(m, nn.Embedding)
            and m.weight is weight
        )
        return Ends(vocab, embedding, head, tied, also)

    def parts(self, path: str) -> Parts:
        """The pairs, experts and unpaired linear modules of block `path`."""
        if path not in self._parts:
            self._parts[path] = self._read_parts(path)
        return self._parts[path]

    def _read_parts(self, at: str) -> Parts:
        block = self.modules[at]
        pairs, experts, unpaired = [], [], []
        for path, module in block.named_modules():
            # experts hold their FFNs as parameters (dtp/layout/experts.py): no other is asked
            if path and "gate_up_proj" in module._parameters and is_experts(module):
                experts.append(path)
                continue
            linears = [n for n, c in module.named_children() if is_linear(c)]
            attention = bool(linears) and attention_like(module)
            if not (attention or len(linears) >= 2):
                continue
            why = unreadable(module)
            pair = None
            if why is None and len(linears) >= 2:
                facts = self.facts(module)
                pair = _pair(path, module, linears, facts) if facts is not None else None
                if pair is None and self.trace is not None:
                    full = ".".join(p for p in (at, path) if p)
                    pair = _traced_pair(self.trace, full, path, module, linears)
            if pair is not None:
                pairs.append((pair, attention))
                continue
            reason = (
                f"its forward's source cannot be read ({why}): {NO_SOURCE}"
                if why
                else "its linear layers form no colwise → rowwise pair that its forward shows "
                "(e.g. low-rank or latent projections, or a forward dtp could neither read nor "
                "run)"
            )
            unpaired.append((path, "attention" if attention else "mlp", reason))
        return Parts(tuple(pairs), tuple(experts), tuple(unpaired))


def _walk(model: nn.Module) -> dict[str, nn.Module]:
    """`dict(model.named_modules())`, refused past MAX_MODULES."""
    modules: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if len(modules) == MAX_MODULES:
            raise UsageError(
                f"dtp plan --auto reads at most {MAX_MODULES:,} modules and this model holds more: "
                "write its plan by hand, one rule per kind of block (`layers.*`)"
            )
        modules[path] = module
    return modules


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


def _pair(path: str, module: nn.Module, linears: list[str], facts: ForwardFacts) -> Pair | None:
    if any(n not in facts.inputs for n in linears):
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


def _downstream(name: str, inputs: dict[str, frozenset[str]]) -> frozenset[str]:
    """The children whose input comes from `name`'s output."""
    return frozenset(n for n, src in inputs.items() if name in src)
