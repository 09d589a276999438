"""Counting collectives at the dispatcher, plus the bytes each one moves.

A TorchDispatchMode sees every collective DTensor, FSDP2 and user code issue (the functional c10d
ops and the in-place c10d ops) and registers no module hooks: torch's CommDebugMode also tracks
modules with forward and full backward hooks, which changes autograd (an in-place `+=` on a hooked
module's output fails) and crashes on some Hugging Face models. The phase (forward or backward) is
the counter's own: `dtp apply` uses one counter per phase.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.distributed_c10d import ProcessGroup, _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dtp.cost.schedule import sent_bytes

_C10D_NAMES = {
    "allreduce_": "all_reduce",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "broadcast_": "broadcast",
}


def _collective_ops() -> set:
    """The op packets that are collectives (what CommDebugMode counts)."""
    ops: set = set()
    for namespace, names in (
        (
            "_c10d_functional",
            (
                "all_gather_into_tensor",
                "all_gather_into_tensor_coalesced",
                "all_reduce",
                "all_reduce_coalesced",
                "all_to_all_single",
                "broadcast",
                "reduce_scatter_tensor",
                "reduce_scatter_tensor_coalesced",
            ),
        ),
        (
            "c10d_functional",
            (
                "all_gather_into_tensor",
                "all_gather_into_tensor_coalesced",
                "all_reduce",
                "all_reduce_coalesced",
                "all_to_all_single",
                "broadcast",
                "reduce_scatter_tensor",
                "reduce_scatter_tensor_coalesced",
            ),
        ),
        (
            "_c10d_functional_autograd",
            ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor"),
        ),
        (
            "c10d",
            (
                "_allgather_base_",
                "_reduce_scatter_base_",
                "allgather_",
                "allgather_coalesced_",
                "allgather_into_tensor_coalesced_",
                "allreduce_",
                "allreduce_coalesced_",
                "alltoall_",
                "alltoall_base_",
                "broadcast_",
                "gather_",
                "scatter_",
                "reduce_",
                "reduce_scatter_",
                "reduce_scatter_tensor_coalesced_",
            ),
        ),
        ("_dtensor", ("shard_dim_alltoall",)),
    ):
        space = getattr(torch.ops, namespace)
        for name in names:
            try:
                ops.add(getattr(space, name))
            except (AttributeError, RuntimeError):  # not in this torch build
                continue
    return ops


_COLLECTIVES = _collective_ops()


_WAIT = getattr(torch.ops._c10d_functional, "wait_tensor", None)


def is_collective(op: object) -> bool:
    """Whether the aten-level `op` is a collective, or the wait on one (a recomputation policy keeps
    both: dtp's in-place all-reduce run again would reduce twice)."""
    packet = getattr(op, "_overloadpacket", None)
    return packet is not None and (packet in _COLLECTIVES or packet is _WAIT)


def op_name(op: object) -> str:
    """`c10d_functional.all_reduce` → `all_reduce`; FSDP2's `c10d._allgather_base_` → `all_gather`."""
    name = str(op).rsplit(".", 1)[-1]
    return _C10D_NAMES.get(
        name, name.removesuffix("_into_tensor").removesuffix("_tensor").removesuffix("_single")
    )


def group_of(tree: object) -> ProcessGroup | None:
    """The process group a collective's arguments name: the group itself, boxed (c10d ops, FSDP2's)
    or by name (the functional collectives); None when none does."""
    leaves, _ = tree_flatten(tree)
    for leaf in leaves:
        if isinstance(leaf, ProcessGroup):
            return leaf
        if isinstance(leaf, torch.ScriptObject):
            try:
                return ProcessGroup.unbox(leaf)
            except RuntimeError:
                continue
        if isinstance(leaf, str):
            try:
                return _resolve_process_group(leaf)
            except (ValueError, RuntimeError, KeyError):
                continue
    return None


def _group_size(tree: object) -> int:
    group = group_of(tree)
    return group.size() if group is not None else 1


def _bytes(tree: object) -> int:
    leaves, _ = tree_flatten(tree)
    return max(
        (t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)), default=0
    )


class CommCounter(TorchDispatchMode):
    """Counts collectives by op name and sums, per op, the size of each collective's full buffer
    (all-reduce: the tensor; all-gather: the gathered output; reduce-scatter: its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.supports_higher_order_operators = True
        self.counts: dict[str, int] = defaultdict(int)
        self.comm_bytes: dict[str, int] = defaultdict(int)
        # (buffer bytes, group size)
        self.comm_sizes: dict[str, list[tuple[int, int]]] = defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # e.g. DTensor's RNG op: not a collective
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into plain ops (and collectives) first
        out = func(*args, **kwargs)
        if func._overloadpacket in _COLLECTIVES:
            name, size = op_name(func._overloadpacket), max(_bytes((args, kwargs)), _bytes(out))
            self.counts[name] += 1
            self.comm_bytes[name] += size
            self.comm_sizes[name].append((size, _group_size((args, kwargs))))
        return out

    def get_total_counts(self) -> int:
        """Collectives counted so far."""
        return sum(self.counts.values())

    def get_comm_counts(self) -> dict[str, int]:
        """Collectives by op name (`all_reduce`, `all_gather`, ...)."""
        return dict(self.counts)


def merge(phases: dict[str, CommCounter]) -> dict:
    """{"total", "by_op", "forward", "backward", "bytes", "sent_bytes"} over counters keyed by
    phase; the optimizer's collectives (none under tensor parallelism) count as backward."""
    out: dict = {
        "total": 0,
        "by_op": {},
        "forward": {},
        "backward": {},
        "bytes": {},
        "sent_bytes": {},
    }
    for phase, c in phases.items():
        key = "forward" if phase == "forward" else "backward"
        out["total"] += c.get_total_counts()
        for name, count in c.get_comm_counts().items():
            out["by_op"][name] = out["by_op"].get(name, 0) + count
            out[key][name] = out[key].get(name, 0) + count
        for name, nbytes in c.comm_bytes.items():
            out["bytes"][name] = out["bytes"].get(name, 0) + nbytes
        for name, sizes in c.comm_sizes.items():
            out["sent_bytes"][name] = out["sent_bytes"].get(name, 0) + sum(
                sent_bytes(name, b, n) for b, n in sizes
            )
    return out
