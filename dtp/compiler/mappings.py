"""Megatron's conjugate communication operators (Megatron-LM's `tensor_parallel/mappings.py`), on
local tensors.

- f, `copy_to_ranks`: identity forward, all-reduce of the input gradient in backward (a
  column-parallel input);
- g, `sum_over_ranks`: all-reduce forward, identity backward (a row-parallel output's partial sums).

They issue the same c10d all-reduces (op, count and bytes) as DTensor's Partial → Replicate
redistributions, made in place as Megatron makes them; over a one-rank group there are none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import AllreduceOptions, ProcessGroup
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


def all_reduce(t: torch.Tensor, group: ProcessGroup, op: str = "sum") -> torch.Tensor:
    """`t` reduced over `group` in place (a copy when `t` is not contiguous): the caller hands over
    a tensor nobody else reads.

    The process group's own call, the `c10d.allreduce_` op that CommDebugMode and dtp's counter see,
    without `dist.all_reduce`'s argument checks (a third of the call on a small tensor; they hold
    for a mesh's own group by construction). While a dispatch mode observes (a timer, a counter),
    the wait goes through the functional `wait_tensor`, where the mode sees the time spent waiting,
    which `Work.wait()` would hide. The functional all-reduce would copy `t` first, which is what
    torch.compile traces (the in-place call is opaque to it), and what runs under torch's selective
    activation checkpointing (`dtp train --recompute selective|op`), which caches the product this
    would reduce in place and refuses a cached tensor mutated later."""
    if torch.compiler.is_compiling() or _selective_checkpointing():
        return funcol.all_reduce(t, op, group)
    t = t.contiguous()
    work = group.allreduce([t], _REDUCE_OPTIONS[op])
    if not torch._C._len_torch_dispatch_stack() or _REGISTER_WORK is None:
        work.wait()
        return t
    _REGISTER_WORK(t, work)
    # the wait's own dispatch, below autograd's Python wrapper
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops._c10d_functional.wait_tensor(t)


# torch's selective checkpointing modes (the forward caching outputs, the recompute reading them)
_SAC_MODES = tuple(
    getattr(torch_checkpoint, name)
    for name in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")
    if hasattr(torch_checkpoint, name)
)


def _selective_checkpointing() -> bool:
    """Whether a selective activation checkpoint is recording or replaying this op."""
    return bool(torch._C._len_torch_dispatch_stack()) and any(
        isinstance(mode, _SAC_MODES) for mode in _get_current_dispatch_mode_stack()
    )


def _options(op: dist.ReduceOp) -> AllreduceOptions:
    options = AllreduceOptions()
    options.reduceOp = op
    return options


_REDUCE_OPTIONS = {"sum": _options(dist.ReduceOp.SUM), "max": _options(dist.ReduceOp.MAX)}
# what lets the functional wait_tensor wait on a c10d call's work (torch >= 2.4; older torch:
# Work.wait())
_REGISTER_WORK = getattr(torch._C._distributed_c10d, "_register_work", None)


class _CopyToRanks(torch.autograd.Function):
    """f: identity forward; the input gradient all-reduced in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # the incoming gradient is the column-parallel product's own (f's output has that one
        # reader); under create_graph it is part of a graph, which an in-place reduction would
        # corrupt
        return all_reduce(grad.clone() if torch.is_grad_enabled() else grad, ctx.group), None


class _SumOverRanks(torch.autograd.Function):
    """g: all-reduce forward, in place on the partial sum (a fresh product only g reads); identity
    backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        out = all_reduce(y, group)
        if out is y:
            ctx.mark_dirty(y)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_ranks(x: object, group: ProcessGroup) -> object:
    """Megatron's f: this rank's copy of a replicated input, its gradient all-reduced over `group`
    in backward.

    A DTensor input comes from a parent that redistributed it once for several column-parallel
    children (q/k/v, gate/up: dtp.compiler.styles.SharedInput): its `Partial` gradients add up first
    and are reduced once, where the parent made it. Over a one-rank group the input passes as it is."""
    if isinstance(x, DTensor):
        if group.size() > 1 and x.placements != (Replicate(),):
            x = x.redistribute(placements=[Replicate()])
        return x.to_local(grad_placements=[Partial()]) if group.size() > 1 else x.to_local()
    if not isinstance(x, torch.Tensor) or not x.requires_grad or group.size() == 1:
        return x
    return _CopyToRanks.apply(x, group)


def sum_over_ranks(y: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Megatron's g: the sum of every rank's partial output over `group` (forward all-reduce,
    identity backward); a one-rank group's output as it is."""
    return y if group.size() == 1 else _SumOverRanks.apply(y, group)


def features_of_rank(x: object) -> object:
    """A row-parallel input as this rank's features (a DTensor sharded on its last dimension, or
    local)."""
    if not isinstance(x, DTensor):
        return x
    if x.placements != (Shard(x.ndim - 1),) and x.placements != (Shard(-1),):
        x = x.redistribute(placements=[Shard(x.ndim - 1)])
    return x.to_local()


f = copy_to_ranks  # the paper's names (Shoeybi et al., 2019, figure 3)
g = sum_over_ranks
