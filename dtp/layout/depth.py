"""A deep model traced on its first blocks.

A trace runs every op of the forward (dtp/layout/trace.py), milliseconds per block even on meta
tensors: 20,000 blocks took minutes. Blocks that are copies of one another (one class; the same
modules, parameter shapes, hooks, and state their forwards read: one code path) do the same thing,
so a container of more than DEEP such blocks is traced on its first KEEP, and the trace of each
block left out is the last kept block's, its names moved to the block's own. What a trace is read
for stays inside one block (which child feeds which, how a linear's output is cut into heads: the
readers in dtp/layout/trace.py, dtp/auto/structure.py and dtp/checks/flow.py), so a copy answers as
its block would; an edge that comes from outside the block keeps the name it had in the last kept
block, and reads as "from outside" all the same.

Blocks that differ in anything that could change their forward (a different child or shape, a
sliding-window flag or a layer index a forward reads, of the block's modules or of the modules
holding them) are not alike: the whole model is traced, as any model of at most DEEP blocks is. What
a forward reads comes from its source (dtp/layout/forward_source.py's forward_attributes); where the
source cannot say (no source, `getattr(self, …)`, `self` handed to a function), every attribute
counts. An attribute no forward reads (torchtitan's `layer_id`, read by weight init) is no
difference.
"""

from __future__ import annotations

import types
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import torch
import torch.nn as nn

from dtp.layout.blocks import ancestors, blocks
from dtp.layout.forward_source import forward_attributes

# A container traced on its first blocks holds more than DEEP: deeper than any model the field
# trains (Llama 3.1 405B has 126 layers), so every such model is traced whole.
DEEP = 256
KEEP = 3  # blocks traced: the last of them has a block before it that has one before it
_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device)
# what nn.Module keeps in every instance (parameters, buffers, children and hooks are compared as
# such; the rest is torch's bookkeeping)
_MODULE_STATE = frozenset(vars(nn.Module())) - {"training"}


@dataclass(frozen=True)
class Short:
    """The blocks a trace leaves out: `dropped[container]` the paths past its first KEEP, `source[
    container]` the last kept block, whose trace each dropped block takes."""

    dropped: Mapping[str, tuple[str, ...]]
    source: Mapping[str, str]

    def paths(self) -> list[str]:
        """Every block left out."""
        return [p for paths in self.dropped.values() for p in paths]


NONE = Short({}, {})


class Flow(Protocol):
    """What `expand` reads and rebuilds of a dtp.layout.trace.Trace (which imports this module)."""

    order: list[str]
    edges: dict[str, set[str]]
    inputs: dict[str, set[str]]
    outputs: dict[str, set[str]]
    views: dict[str, set]


T = TypeVar("T", bound=Flow)


def containers(model: nn.Module) -> dict[str, list[str]]:
    """The blocks of `model` (dtp/layout/blocks.py) held in a ModuleList, Sequential or ModuleDict,
    by that container's path."""
    by_parent: dict[str, list[str]] = {}
    for path in blocks(dict(model.named_modules())):
        by_parent.setdefault(path.rpartition(".")[0], []).append(path)
    return {
        parent: paths
        for parent, paths in by_parent.items()
        if isinstance(
            model.get_submodule(parent) if parent else model,
            (nn.ModuleList, nn.Sequential, nn.ModuleDict),
        )
    }


def short(model: nn.Module) -> Short:
    """The containers of `model` holding more than DEEP blocks all alike, and what a trace leaves
    out of each."""
    dropped, source = {}, {}
    for parent, paths in containers(model).items():
        holder = model.get_submodule(parent) if parent else model
        if len(paths) <= DEEP:
            continue
        if list(holder._modules) != [p.rpartition(".")[2] for p in paths]:
            continue  # a member that is not a block (no children): positions would not match
        outer = [model, *(model.get_submodule(a) for a in (*ancestors(parent), parent) if a)]
        read = _read(outer, model.get_submodule(paths[0]))
        first = _signature(model.get_submodule(paths[0]), read)
        if all(_signature(model.get_submodule(p), read) == first for p in paths[1:]):
            dropped[parent], source[parent] = tuple(paths[KEEP:]), paths[KEEP - 1]
    return Short(dropped, source)


def _read(outer: list[nn.Module], block: nn.Module) -> frozenset[str] | None:
    """The attribute names the forwards of a block's modules and of the modules holding it can read
    (dtp/layout/forward_source.py's forward_attributes); None when any could read any."""
    names: set[str] = set()
    for cls in {type(m) for m in (*outer, *block.modules())}:
        if cls in (nn.ModuleList, nn.ModuleDict, nn.Sequential):
            continue  # containers: no forward, or Sequential's, which reads no attribute
        found = forward_attributes(cls)
        if found is None:
            return None
        names |= found
    return frozenset(names)


def _signature(block: nn.Module, read: frozenset[str] | None) -> tuple:
    """What a block's forward could depend on besides its inputs: each module's path and class, its
    parameters' and buffers' shapes and dtypes, its hooks, and the attributes a forward can read
    (`read`; None: all of them), plain values by value, functions by their code, anything else by
    its class. An attribute no forward reads (torchtitan's `layer_id`, used by weight init) is no
    difference."""
    out = []
    for path, m in block.named_modules():
        tensors = tuple(
            (name, tuple(t.shape), t.dtype) if t is not None else (name,)
            for store in (m._parameters, m._buffers)
            for name, t in store.items()
        )
        hooks = tuple(len(h) for h in (m._forward_hooks, m._forward_pre_hooks))
        state = tuple(
            sorted(
                (k, _value(v))
                for k, v in vars(m).items()
                if k not in _MODULE_STATE and (read is None or k in read)
            )
        )
        out.append((path, type(m), tensors, hooks, state))
    return tuple(out)


def _value(v: object) -> object:
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v):
        return tuple(v)
    if isinstance(v, types.FunctionType):
        return v.__code__
    if isinstance(v, types.MethodType):
        return v.__func__.__code__
    return type(v)


def shorten(twin: nn.Module, dropped: Collection[str]) -> None:
    """Take the blocks `dropped` out of `twin` (a forward looping over its containers then runs the
    blocks left)."""
    for path in sorted(dropped, key=lambda p: -len(p)):
        parent, _, name = path.rpartition(".")
        holder = twin.get_submodule(parent) if parent else twin
        if isinstance(holder, nn.ModuleDict):
            del holder[name]
        else:
            holder._modules.pop(name)
    # ModuleList and Sequential index by position: renumber what is left
    for holder in twin.modules():
        if isinstance(holder, (nn.ModuleList, nn.Sequential)):
            holder._modules = dict(
                zip(map(str, range(len(holder._modules))), holder._modules.values())
            )


def expand(tr: T, cut: Short) -> T:
    """The trace of the whole model from `tr`, the trace of its first blocks: each block left out
    takes its container's last kept block's entries, renamed (see the module docstring)."""
    edges, inputs, outputs, views = (
        dict(tr.edges),
        dict(tr.inputs),
        dict(tr.outputs),
        dict(tr.views),
    )
    order = list(tr.order)
    for container, paths in cut.dropped.items():
        source = cut.source[container]
        under = [p for p in tr.order if p == source or p.startswith(source + ".")]
        nodes = [n for n in tr.edges if n.startswith(source + ".") and n not in tr.inputs]
        after = max((order.index(p) for p in under), default=len(order) - 1) + 1
        added: list[str] = []
        for target in paths:

            def moved(name: str, target: str = target) -> str:
                if name == source or name.startswith(source + "."):
                    return target + name[len(source) :]
                return name

            for store in (edges, inputs, outputs):
                for key in (*under, *nodes):
                    if key in store:
                        store[moved(key)] = {moved(v) for v in store[key]}
            for key in under:
                if key in tr.views:
                    views[moved(key)] = set(tr.views[key])
            added += [moved(p) for p in under]
        order[after:after] = added
    return replace(tr, order=order, edges=edges, inputs=inputs, outputs=outputs, views=views)
