"""Counting collectives with torch's CommDebugMode, plus the bytes each one moves and its pass."""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_flatten


_C10D_NAMES = {"allreduce_": "all_reduce", "allgather_": "all_gather", "_allgather_base_": "all_gather",
               "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
               "allgather_into_tensor_coalesced_": "all_gather", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
               "alltoall_base_": "all_to_all", "broadcast_": "broadcast"}


def op_name(op: object) -> str:
    """`c10d_functional.all_reduce` → `all_reduce`; FSDP2's `c10d._allgather_base_` → `all_gather`."""
    name = str(op).rsplit(".", 1)[-1]
    return _C10D_NAMES.get(name, name.removesuffix("_into_tensor").removesuffix("_tensor").removesuffix("_single"))


def _group_size(tree: object) -> int:
    from torch.distributed.distributed_c10d import ProcessGroup, _resolve_process_group

    leaves, _ = tree_flatten(tree)
    for leaf in leaves:
        if isinstance(leaf, ProcessGroup):
            return leaf.size()
        if isinstance(leaf, torch.ScriptObject):  # c10d ops (FSDP2's) carry the group boxed
            try:
                return ProcessGroup.unbox(leaf).size()
            except RuntimeError:
                continue
        if isinstance(leaf, str):
            try:
                return _resolve_process_group(leaf).size()
            except (ValueError, RuntimeError, KeyError):
                continue
    return 1


def _bytes(tree: object) -> int:
    leaves, _ = tree_flatten(tree)
    return max((t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)), default=0)


class CommCounter(CommDebugMode):
    """CommDebugMode that also sums, per op, the size of each collective's full buffer (all-reduce: the
    tensor; all-gather: the gathered output; reduce-scatter: its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.comm_bytes: dict[str, int] = defaultdict(int)
        self.comm_sizes: dict[str, list[tuple[int, int]]] = defaultdict(list)  # (buffer bytes, group size)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and self.get_total_counts() > before:
            name, size = op_name(func._overloadpacket), max(_bytes((args, kwargs)), _bytes(out))
            self.comm_bytes[name] += size
            self.comm_sizes[name].append((size, _group_size((args, kwargs))))
        return out


def merge(phases: dict[str, CommCounter]) -> dict:
    """{"total", "by_op", "forward", "backward", "bytes", "sent_bytes"} over counters keyed by phase; the
    optimizer's collectives (none under tensor parallelism) count as backward."""
    from dtp.schedule import sent_bytes

    out: dict = {"total": 0, "by_op": {}, "forward": {}, "backward": {}, "bytes": {}, "sent_bytes": {}}
    for phase, c in phases.items():
        key = "forward" if phase == "forward" else "backward"
        out["total"] += c.get_total_counts()
        for op, count in c.get_comm_counts().items():
            name = op_name(op)
            out["by_op"][name] = out["by_op"].get(name, 0) + count
            out[key][name] = out[key].get(name, 0) + count
        for name, nbytes in c.comm_bytes.items():
            out["bytes"][name] = out["bytes"].get(name, 0) + nbytes
        for name, sizes in c.comm_sizes.items():
            out["sent_bytes"][name] = out["sent_bytes"].get(name, 0) + sum(sent_bytes(name, b, n) for b, n in sizes)
    return out
