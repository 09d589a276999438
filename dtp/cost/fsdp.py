"""FSDP2's units over the dp dimension and the bytes each all-gathers, counted statically: each
block of the model's top-level ModuleLists is one unit (a block that is a ModuleDict, its parts) and
the model itself the root."""

from __future__ import annotations

import torch
import torch.nn as nn

from dtp.checks.checker import Checked


def units(model: nn.Module) -> list[str]:
    """Paths of the FSDP units below the root: the elements of ModuleLists not nested in another
    unit. An element that is a container with no forward of its own (a ModuleDict of the block's
    parts, as nanoGPT-style code writes blocks) gives its children instead: FSDP2 and activation
    checkpointing wrap what is called."""
    out: list[str] = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(path.startswith(u + ".") for u in out):
            for name, child in module.named_children():
                out += _called(f"{path}.{name}" if path else name, child)
    return out


def _called(path: str, module: nn.Module) -> list[str]:
    """`path` if `module` has a forward, else its children that hold parameters, the same way."""
    if type(module).forward is not nn.Module.forward:
        return [path]
    return [
        unit
        for name, child in module.named_children()
        if any(True for _ in child.parameters())
        for unit in _called(f"{path}.{name}", child)
    ]


def unit_bytes(
    checked: Checked, model: nn.Module, tp: int, dp: int, elem: int
) -> list[tuple[str, int]]:
    """(unit path, bytes of its all-gathered parameters) for each FSDP unit, the root ("") last.

    A unit's buffer holds its tp-local parameters, each padded on dim 0 to a multiple of dp as FSDP2
    does.
    """
    res = checked.resolution
    local: dict[int, tuple[int, ...]] = {}
    for path, module in model.named_modules():
        placements = res.placements(path)
        for name, p in module.named_parameters(recurse=False):
            local.setdefault(id(p), placements[name].local_shape(tuple(p.shape), tp))
    seen: set[int] = set()
    out = []
    for path in [*units(model), ""]:
        total = 0
        for p in model.get_submodule(path).parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            shape = local[id(p)]
            rows = -(-shape[0] // dp) * dp if shape else 1
            total += rows * int(torch.Size(shape[1:]).numel()) * elem
        out.append((path, total))
    return out
