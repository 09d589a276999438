"""A model's repeated blocks, by structure: however the code holds them.

- the children of an `nn.ModuleList` or `nn.Sequential` (nanoGPT's `transformer.h`, Hugging Face's
  `layers`);
- the children of an `nn.ModuleDict` keyed by layer numbers, or holding two or more modules of one
  class (torchtitan's `self.layers[str(layer_id)]`, so that pipeline stages can delete some and keep
  the names);
- sibling attributes of one class (`self.block1`, `self.block2`) whose class holds no blocks itself
  (an encoder and a decoder of one class are stacks of blocks, not blocks).

A block is such a child that holds modules of its own; the outermost win (a block's experts list is
inside it).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.nn as nn


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _container_children(path: str, module: nn.Module) -> list[str]:
    kids = [(n, c) for n, c in module.named_children() if any(c.children())]
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        return [f"{path}.{n}" if path else n for n, _ in kids]
    if isinstance(module, nn.ModuleDict):
        names = [n for n, _ in module.named_children()]
        same = len(kids) >= 2 and len({type(c) for _, c in kids}) == 1 and len(kids) == len(names)
        if kids and (all(n.isdigit() for n in names) or same):
            return [f"{path}.{n}" if path else n for n, _ in kids]
    return []


def blocks(modules: Mapping[str, nn.Module]) -> list[str]:
    """The paths of the model's blocks (see the module docstring), in registration order, outermost
    only. `modules` is `dict(model.named_modules())`."""
    held = {p for path, m in modules.items() for p in _container_children(path, m)}
    above = {a for p in held for a in ancestors(p)}  # whatever holds a block
    for path, module in modules.items():  # sibling attributes of one class
        if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        by_class: dict[type, list[str]] = {}
        for name, child in module.named_children():
            if any(child.children()):
                by_class.setdefault(type(child), []).append(f"{path}.{name}" if path else name)
        for paths in by_class.values():
            if len(paths) >= 2 and not any(p in above for p in paths):
                held.update(paths)
                above.update(a for p in paths for a in ancestors(p))
    out: list[str] = []
    chosen: set[str] = set()
    for path in modules:
        if path in held and not _inside(path, chosen):
            out.append(path)
            chosen.add(path)
    return out


def ancestors(path: str) -> list[str]:
    """The paths of the modules holding `path` ("" the model's own is left out)."""
    out = []
    while "." in path:
        path = path.rpartition(".")[0]
        out.append(path)
    return out


def _inside(path: str, outer: set[str]) -> bool:
    """Whether an ancestor of `path` is in `outer` (its depth in steps, not `outer`'s size)."""
    return any(a in outer for a in ancestors(path))
