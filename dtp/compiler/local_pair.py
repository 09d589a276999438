"""Megatron's column/row-parallel pair on local tensors: DTensor parameters, no DTensor arithmetic.

Between a colwise and a rowwise layer the layout is known when the plan is compiled: the colwise input is
replicated, its output is this rank's features, the rowwise layer's product is a partial sum. torch's styles
still run each Linear as a DTensor op (sharding propagation and wrapping on every call, forward and backward).
`localize` takes a module that torch's style (ColwiseParallel, RowwiseParallel, dtp's Placed* with packed
parts) has already sharded — so checkpoints, gradients, clipping and the optimizer see the same DTensors —
removes that style's input/output hooks and makes the module compute on its parameters' local shards (plain
autograd leaves whose gradients the DTensors' `.grad` wrap: dtp/compiler/local_leaves.py), with Megatron's
conjugate operators as the only communication:

- f (colwise input): identity forward, all-reduce of the input gradient in backward;
- g (rowwise output): all-reduce forward, identity backward.

The collectives are the all-reduces DTensor's own Partial → Replicate redistributions issue, the same c10d
calls, counts and bytes as torch's styles make, made in place as Megatron makes them (a DTensor input from a shared parent keeps DTensor's
own path, so q/k/v siblings' gradients are still summed before one all-reduce); over a one-rank mesh there are
none, as DTensor skips them there. The rowwise bias is added after the sum, on every rank (Megatron's
RowParallelLinear): its gradient is the same everywhere without an all-reduce, and every rank does the same
work before the all-reduce, so none waits for another. The vocabulary-parallel ends are
dtp/compiler/local_vocab.py.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import AllreduceOptions, ProcessGroup
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor import _api as tensor_api
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from dtp.compiler.local_leaves import LocalLeaves, owned_params
from dtp.layout.modules import is_conv1d


def all_reduce(t: torch.Tensor, group: ProcessGroup, op: str = "sum") -> torch.Tensor:
    """`t` reduced over `group` in place (a copy when `t` is not contiguous), as Megatron reduces: the caller
    hands over a tensor nobody else reads. The process group's own call, the `c10d.allreduce_` op torch's
    CommDebugMode and dtp's counter see (op, count and bytes as DTensor's functional all-reduce), without
    `dist.all_reduce`'s argument checks, which cost a third of the call on a small tensor and hold for a
    mesh's own group by construction. While a dispatch mode observes (the trainer's communication timer, a
    counter), the wait goes through the functional `wait_tensor`, where the mode sees the time spent waiting,
    which c10d's own `Work.wait()` would hide; below autograd, whose Python wrapper of that op costs more than
    the wait's own dispatch. The functional all-reduce would copy `t` first."""
    t = t.contiguous()
    work = group.allreduce([t], _REDUCE_OPTIONS[op])
    if not torch._C._len_torch_dispatch_stack() or _REGISTER_WORK is None:
        work.wait()
        return t
    _REGISTER_WORK(t, work)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops._c10d_functional.wait_tensor(t)


def _options(op: dist.ReduceOp) -> AllreduceOptions:
    options = AllreduceOptions()
    options.reduceOp = op
    return options


_REDUCE_OPTIONS = {"sum": _options(dist.ReduceOp.SUM), "max": _options(dist.ReduceOp.MAX)}
# what lets the functional wait_tensor wait on a c10d call's work (torch >= 2.4; older torch: Work.wait())
_REGISTER_WORK = getattr(torch._C._distributed_c10d, "_register_work", None)


class _CopyToRanks(torch.autograd.Function):
    """f: identity forward; the input gradient all-reduced in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # the incoming gradient is the colwise product's own (f's output has that one reader); under
        # create_graph it is part of a graph, which an in-place reduction would corrupt
        return all_reduce(grad.clone() if torch.is_grad_enabled() else grad, ctx.group), None


class _SumOverRanks(torch.autograd.Function):
    """g: all-reduce forward, in place on the partial sum (a fresh product only g reads); identity backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        out = all_reduce(y, group)
        if out is y:
            ctx.mark_dirty(y)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def f(x: object, group: ProcessGroup) -> object:
    """Megatron's f: this rank's copy of a replicated input whose gradient is all-reduced in backward over
    `group`, the 1-D mesh's own."""
    if not isinstance(x, torch.Tensor):
        return x
    if isinstance(x, DTensor):  # a shared input (q/k/v siblings): their Partial gradients are summed first,
        if x.placements != (Replicate(),):  # and reduced once where the parent made the DTensor
            x = x.redistribute(placements=[Replicate()])
        return x.to_local(grad_placements=[Partial()])
    if not x.requires_grad:
        return x
    return _CopyToRanks.apply(x, group)


def colwise_input(x: object, group: ProcessGroup) -> object:
    """A colwise layer's input as this rank's local tensor: through f, or as it is over a one-rank mesh (tp 1
    under FSDP2), where there is nothing to reduce. `group` is the 1-D mesh's own."""
    if group.size() == 1:
        return x.to_local() if isinstance(x, DTensor) else x
    return f(x, group)


def g(y: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Megatron's g: the sum of every rank's partial output over the mesh's `group` (forward all-reduce;
    identity backward)."""
    return _SumOverRanks.apply(y, group)


def _sharded_last(x: object) -> object:
    """A rowwise input as this rank's features (a DTensor sharded on the last dim, or already local)."""
    if not isinstance(x, DTensor):
        return x
    if x.placements != (Shard(x.ndim - 1),) and x.placements != (Shard(-1),):
        x = x.redistribute(placements=[Shard(x.ndim - 1)])
    return x.to_local()


def _run(module: nn.Module, x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    weight, bias = params["weight"], params.get("bias")
    if type(module) is nn.Linear:
        return F.linear(x, weight, bias)
    # transformers' Conv1D: weight (in, out); its forward reads the global width from `nf`, so it is written here
    y = x.reshape(-1, x.shape[-1]) @ weight
    y = y if bias is None else y + bias
    return y.view(*x.shape[:-1], weight.shape[-1])


def pair_side(style: ParallelStyle, module: nn.Module) -> str | None:
    """'colwise' or 'rowwise' when `style` is torch's column- or row-parallel style on a Linear or Conv1D with
    Megatron's layouts (replicated input → local output features; local input features → replicated local
    output); else None (sequence parallelism, DTensor outputs, partial outputs keep torch's style)."""
    if type(module) is not nn.Linear and not is_conv1d(module) or not getattr(style, "use_local_output", False):
        return None
    layouts = (tuple(style.input_layouts), tuple(style.output_layouts))
    last = (Shard(-1),)
    if isinstance(style, ColwiseParallel) and layouts == ((Replicate(),), last):
        return "colwise"
    if isinstance(style, RowwiseParallel) and layouts == (last, (Replicate(),)):
        return "rowwise"
    return None


def hook_ids(module: nn.Module) -> tuple[set[int], set[int]]:
    """The module's forward pre-hooks and hooks now (taken before its style is applied)."""
    return set(module._forward_pre_hooks), set(module._forward_hooks)


def _from_distribute_module(hook: object) -> bool:
    return getattr(hook, "__module__", None) == tensor_api.__name__  # its input/output lambdas


def drop_style_hooks(module: nn.Module, before: tuple[set[int], set[int]]) -> None:
    """Drop the input/output hooks the style's distribute_module added since `before` (hooks of dtp's own, such
    as replicated packed rows' gradient reduction, stay)."""
    pre, post = before
    for key in [k for k, h in module._forward_pre_hooks.items() if k not in pre and _from_distribute_module(h)]:
        del module._forward_pre_hooks[key]
        module._forward_pre_hooks_with_kwargs.pop(key, None)
    for key in [k for k, h in module._forward_hooks.items() if k not in post and _from_distribute_module(h)]:
        del module._forward_hooks[key]
        module._forward_hooks_with_kwargs.pop(key, None)
        module._forward_hooks_always_called.pop(key, None)


def bind_forward(module: nn.Module, forward) -> None:
    """Make `forward(self, ...)` the module's own forward: a bound method, so that a deep copy of the model
    (an EMA copy, say) computes with its own parameters, where a closure over `module` would read the original's
    (the copy's parameters are not the ones `owned_params` recorded, so they take `to_local()`)."""
    module.forward = types.MethodType(forward, module)


def localize(module: nn.Module, side: str, mesh: DeviceMesh, before: tuple[set[int], set[int]],
             leaves: LocalLeaves) -> None:
    """Drop the style's input/output hooks (see `drop_style_hooks`) and compute `module` on local tensors (`side`),
    its parameters read through `leaves`."""
    drop_style_hooks(module, before)
    owned = owned_params(module)
    group = mesh.get_group(0)  # looked up once: the mesh's groups are fixed when it is made
    alone = mesh.size() == 1  # tp 1 under FSDP2: nothing to communicate
    if side == "colwise":
        def forward(self, x):
            return _run(self, colwise_input(x, group), leaves.params(self, owned))
    else:
        def forward(self, x):
            params = leaves.params(self, owned)
            bias = params.pop("bias", None)
            y = _run(self, _sharded_last(x), params)
            y = y if alone else g(y, group)
            return y if bias is None else y + bias  # a new tensor either way: it may be updated in place
    bind_forward(module, forward)
