"""FSDP2's units over the dp dimension and the bytes each all-gathers, counted statically: each
block of the model's top-level ModuleLists is one unit and the model itself the root."""

from __future__ import annotations

import torch
import torch.nn as nn

from dtp.checks.checker import Checked


def units(model: nn.Module) -> list[str]:
    """Paths of the FSDP units below the root: the elements of ModuleLists not nested in another
    unit."""
    out: list[str] = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(path.startswith(u + ".") for u in out):
            out += [f"{path}.{name}" if path else name for name, _ in module.named_children()]
    return out


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
