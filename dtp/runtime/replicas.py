"""Replica consistency: a tensor that several tensor-parallel ranks hold whole must be the same on
all of them.

A replicated parameter whose gradient is computed from a rank's own shard of an activation (a q/k
norm left under plain `replicate`) gets a different update on every rank: the replicas drift apart
while the run looks normal. Megatron checks parameter hashes across replicas for this; so does dtp,
cheaply: one 2-integer fingerprint of each tensor's bits per rank, one all-gather over the tp group,
and, only for a tensor whose fingerprints differ, one broadcast to measure by how much.

Checked: every parameter replicated over the tp dimension (a DTensor with `Replicate` there, or a
plain tensor) and every buffer, integer and boolean ones included (a step counter, a permutation
drawn in `__init__`, a mask). Sharded parameters have one owner per element: nothing to compare.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_PRIME = 65521  # position weights 1..65521: a swap of two elements changes the fingerprint


@dataclass(frozen=True)
class Divergence:
    """One tensor whose copies differ across the ranks that hold it."""

    name: str
    kind: str  # "parameter" | "buffer"
    max_abs: float  # the largest |copy − the group's first rank's copy| over ranks and elements
    rel: float  # max_abs / max|the first rank's copy|
    ranks: tuple[int, ...]  # global ranks whose copy differs from the first rank's

    def describe(self) -> str:
        """One line for a report."""
        ranks = ", ".join(map(str, self.ranks))
        return (
            f"{self.kind} {self.name} differs across the ranks that replicate it (rank {ranks} vs "
            "the first): "
            f"max |difference| {self.max_abs:.3g} ({self.rel:.3g} of its largest value)"
        )


def _tp_replicated(t: torch.Tensor) -> bool:
    """Whether every tp rank holds `t`'s local block whole: a plain tensor, a DTensor replicated on
    its `tp` dimension, or one on a mesh without a tp dimension (FSDP2 over dp alone, for a
    parameter tp left whole)."""
    if not isinstance(t, DTensor):
        return True
    names = t.device_mesh.mesh_dim_names
    if names and "tp" not in names:
        return True
    return isinstance(t.placements[names.index("tp") if names else 0], Replicate)


def replicated_tensors(model: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(kind, name, local tensor) of everything the tp ranks should hold identically, in a
    rank-independent order."""
    out = [
        ("parameter", n, p.to_local() if isinstance(p, DTensor) else p)
        for n, p in model.named_parameters()
        if _tp_replicated(p)
    ]
    out += [
        ("buffer", n, b.to_local() if isinstance(b, DTensor) else b)
        for n, b in model.named_buffers()
        if _tp_replicated(b)
    ]
    return out


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64s that change with any bit of `t` (sum of its bit patterns, and a position-weighted
    sum)."""
    flat = t.detach().contiguous().view(-1)
    if not flat.numel():
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    bits = flat.view(_INTS[flat.element_size()]).to(torch.int64)
    weights = torch.arange(flat.numel(), device=t.device, dtype=torch.int64) % _PRIME + 1
    # int64 arithmetic wraps: still deterministic
    return torch.stack([bits.sum(), (bits * weights).sum()])


def replica_rtol(device: torch.device, dtype: torch.dtype) -> float:
    """The difference tolerated between replicas: none on CPU (its kernels are bitwise
    deterministic); on CUDA 64 units of `dtype`'s last place, since some kernels (atomics in
    embedding and scatter backward) are not."""
    return 0.0 if device.type != "cuda" else 64 * torch.finfo(dtype).eps


@torch.no_grad()
def check_replicas(
    model: nn.Module, group: dist.ProcessGroup | None, rtol: float = 0.0
) -> list[Divergence]:
    """Every replicated tensor compared across `group` (the tp ranks); the same list on every rank
    of it.

    A divergence is any bitwise difference, or, with `rtol` > 0, one larger than `rtol` ·
    max|tensor| (for kernels that are not bitwise deterministic)."""
    tensors = replicated_tensors(model)
    if group is None or dist.get_world_size(group) == 1 or not tensors:
        return []
    device = tensors[0][2].device
    mine = torch.stack([fingerprint(t).to(device) for _, _, t in tensors])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    ranks = dist.get_process_group_ranks(group)
    found = []
    for i, (kind, name, t) in enumerate(tensors):
        differ = tuple(
            ranks[r] for r, fp in enumerate(gathered) if not torch.equal(fp[i], gathered[0][i])
        )
        if not differ:
            continue
        first = t.detach().clone()
        dist.broadcast(first, src=ranks[0], group=group)
        diff = torch.tensor(
            [(t.double() - first.double()).abs().max().item() if t.numel() else 0.0], device=device
        )
        dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
        scale = first.double().abs().max().item() if first.numel() else 0.0
        max_abs = diff.item()
        rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
        # NaN, too far, or bits only
        if max_abs != max_abs or rel > rtol or (rtol == 0.0 and max_abs == 0.0):
            found.append(Divergence(name, kind, max_abs, rel, differ))
    return found
