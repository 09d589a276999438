"""A copy of a model that computes what the model computes: `copy.deepcopy`, closures included.

`copy.deepcopy` copies a function by reference. A model that calls a submodule through a closure
built in `__init__` (minGPT's `self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))`, a hook
closing over its module, a helper made by a factory function) keeps, in its copy, a function whose
cells still hold the *original* submodules: the copy would run the original's weights. Here every
function with a closure that the model reaches (module attributes, hooks, lists, dicts,
`functools.partial`, bound methods, plain objects a module holds) gets a copy of its own whose cells
hold the copies of what the original's cells held. Bound methods and partials are already copied
through their `__self__`/`func` by deepcopy; with their functions registered here, they follow.

`tensors` lets a caller replace every tensor on the way (a meta twin: same shapes, no data).
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Callable, Collection

import torch
import torch.nn as nn

# objects visited looking for closures: far above any model, a bound on a hostile graph
MAX_OBJECTS = 200_000


def _reachable(root: object, skip: set[int]) -> tuple[list[types.FunctionType], list[torch.Tensor]]:
    """Functions with closures and tensors reachable from `root` the way deepcopy walks it
    (bounded), not through the objects whose ids are in `skip`."""
    seen: set[int] = set(skip)
    functions: list[types.FunctionType] = []
    tensors: list[torch.Tensor] = []
    stack: list[object] = [root]
    while stack and len(seen) < MAX_OBJECTS:
        obj = stack.pop()
        if (
            id(obj) in seen
            or obj is None
            or isinstance(obj, (str, bytes, int, float, bool, type, types.ModuleType))
        ):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, types.FunctionType):
            if obj.__closure__:
                functions.append(obj)
                stack += [c.cell_contents for c in obj.__closure__ if _filled(c)]
        elif isinstance(obj, types.MethodType):
            stack += [obj.__self__, obj.__func__]
        elif isinstance(obj, functools.partial):
            stack += [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, dict):
            stack += list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += list(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, types.BuiltinFunctionType):
            stack += list(vars(obj).values())
    return functions, tensors


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def clone(
    model: nn.Module,
    tensors: Callable[[torch.Tensor], torch.Tensor] | None = None,
    share: Collection[nn.Module] = (),
) -> nn.Module:
    """A deep copy of `model` whose closures read the copy's objects; `tensors(t)`, when given, is
    what each tensor the model reaches becomes in the copy (parameters stay parameters). The
    modules in `share` are not copied: the copy holds them themselves (a caller that takes them out
    of the copy before it runs saves copying what it would throw away)."""
    memo: dict[int, object] = {id(m): m for m in share}
    functions, found = _reachable(model, set(memo))
    if tensors is not None:
        for t in found:
            new = tensors(t)
            if isinstance(t, nn.Parameter) and not isinstance(new, nn.Parameter):
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            memo[id(t)] = new
    copies = []
    # a new function with empty cells now; the cells are filled once their contents are copied
    for fn in functions:
        cells = tuple(types.CellType() for _ in fn.__closure__)
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
        new.__kwdefaults__, new.__dict__ = fn.__kwdefaults__, dict(fn.__dict__)
        new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
        memo[id(fn)] = new
        copies.append((fn, new))
    out = copy.deepcopy(model, memo)
    for fn, new in copies:
        for old_cell, new_cell in zip(fn.__closure__, new.__closure__):
            if _filled(old_cell):
                new_cell.cell_contents = copy.deepcopy(old_cell.cell_contents, memo)
    return out


def meta_twin(model: nn.Module, share: Collection[nn.Module] = ()) -> nn.Module:
    """`model` with every tensor it reaches on the meta device (same shape, dtype, requires_grad; no
    data) and its Python state copied: a forward run on it changes nothing of `model`'s (`share` as
    `clone` takes it)."""

    def to_meta(t: torch.Tensor) -> torch.Tensor:
        new = (
            torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
            if t.layout == torch.strided
            else torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
        )
        return (
            new.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else new
        )

    return clone(model, to_meta, share)
