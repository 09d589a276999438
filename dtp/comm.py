"""Counting collectives with torch's CommDebugMode, plus the bytes each one moves and its pass."""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_flatten


def op_name(op: object) -> str:
    """`c10d_functional.all_reduce` → `all_reduce`."""
    return str(op).rsplit(".", 1)[-1].removesuffix("_into_tensor").removesuffix("_tensor")


def _bytes(tree: object) -> int:
    leaves, _ = tree_flatten(tree)
    return max((t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)), default=0)


class CommCounter(CommDebugMode):
    """CommDebugMode that also sums, per op, the size of each collective's full buffer (all-reduce: the
    tensor; all-gather: the gathered output; reduce-scatter: its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.comm_bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and self.get_total_counts() > before:
            self.comm_bytes[op_name(func._overloadpacket)] += max(_bytes((args, kwargs)), _bytes(out))
        return out

    def summary(self) -> dict:
        """This counter's collectives (see `merge`)."""
        return merge([self])


def merge(counters: list[CommCounter]) -> dict:
    """{"total": n, "by_op": {...}, "forward": {...}, "backward": {...}, "bytes": {...}} over several counters."""
    out: dict = {"total": 0, "by_op": {}, "forward": {}, "backward": {}, "bytes": {}}
    for c in counters:
        passes = c.comm_module_counts.get("Global", {})
        out["total"] += c.get_total_counts()
        for key, counts in (("by_op", c.get_comm_counts()), ("forward", passes.get("forward", {})),
                            ("backward", passes.get("backward", {})), ("bytes", c.comm_bytes)):
            for op, n in counts.items():
                name = op if isinstance(op, str) else op_name(op)
                out[key][name] = out[key].get(name, 0) + n
    return out

