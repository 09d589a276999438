"""Parameter bytes per rank: the one function every command uses (explain's totals, apply's and
train's reports, the fuzzer's property, the memory budget), and the measured counterpart it is
tested against.

The table follows the placements `check` resolved: torch.chunk's tp shards (uneven vocabularies
leave the last ranks shorter; packed parts shard part by part), then FSDP2's dim-0 shards over dp
(dim 0 padded to a multiple of dp). A tied parameter counts once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from dtp.checks.checker import Checked
from dtp.layout.placement import ParamPlacement


def _unique(checked: Checked, model: nn.Module) -> Iterator[tuple[ParamPlacement, tuple[int, ...]]]:
    """(placement, full shape) of each parameter once (tied parameters under their first owner)."""
    res = checked.resolution
    seen: set[int] = set()
    for path, module in model.named_modules():
        placements = res.placements(path)
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield placements[name], tuple(p.shape)


def param_bytes_per_rank(
    checked: Checked,
    model: nn.Module,
    tp: int,
    dp: int = 1,
    elem: int = 4,
    *,
    padded: bool = True,
) -> list[int]:
    """Parameter bytes on each rank (rank = dp_index · tp + tp_index) from the placement table;
    `model` may be on meta. `padded` False: each dp rank's own rows of torch.chunk's dim-0 split
    (the last shards shorter or empty), what a tensor shaped like its shard holds (an optimizer's
    state), instead of FSDP2's padded allocation."""
    out = []
    for rank in range(tp * dp):
        total = 0
        for placement, shape in _unique(checked, model):
            local = placement.local_shape(shape, tp, rank % tp)
            rows = local[0] if local else 1
            if dp > 1 and local:
                chunk = -(-rows // dp)
                rows = chunk if padded else max(0, min(chunk, rows - chunk * (rank // tp)))
            total += rows * int(torch.Size(local[1:]).numel()) * elem
        out.append(total)
    return out


def ideal_param_bytes(
    checked: Checked, model: nn.Module, tp: int, dp: int = 1, elem: int = 4
) -> int:
    """Megatron's ideal per rank: (replicated + sharded / tp) / dp."""
    replicated = sharded = 0
    for placement, shape in _unique(checked, model):
        nbytes = int(torch.Size(shape).numel()) * elem
        if placement.shard_dim is None:
            replicated += nbytes
        else:
            sharded += nbytes
    return (replicated + sharded // tp) // dp


def replicated_fraction(checked: Checked, model: nn.Module) -> float:
    """The share of the model's parameter bytes that every rank holds whole (tied parameters once)."""
    whole = total = 0
    for placement, shape in _unique(checked, model):
        n = int(torch.Size(shape).numel())
        total += n
        whole += n if placement.shard_dim is None else 0
    return whole / total if total else 0.0


def local_param_bytes(model: nn.Module) -> int:
    """The bytes of this rank's local shards (tied parameters once). Equal to the table under tp;
    under FSDP2 a short last dp shard is a view of a padded allocation, which the table counts and
    this does not."""
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for p in model.parameters()
    )
