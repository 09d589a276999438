"""`slice_input`: per-head tensors a module receives from outside, cut to this rank's heads;
`slice_params`: per-head parameters an attention module holds itself (GPT-OSS's learnt `sinks`, one
logit per head).

Some models build a per-head tensor once, for every head, outside attention and hand it to each
attention module as an input. Bloom's ALiBi bias is laid out (batch · heads, 1, keys): the heads at
dimension 0, folded with the batch in front of them. Falcon's ALiBi bias is (batch, heads, 1, keys),
and the 4-D causal mask Falcon folds that bias into is (batch, heads, queries, keys): heads at
dimension 1. With attention sharded by heads each rank must read its own heads' part. Every rank
holds the whole tensor already, so the cut needs no communication. A size of 1 at the heads
dimension is a value broadcast over every head (a causal mask without per-head bias) and is kept
whole.

A tensor whose gradient is needed is refused: each rank's gradient would cover its own heads only,
and the sum over ranks that would make it whole is not part of this layout. A sliced parameter needs
no such sum: each rank's gradient covers its own heads' values, which are all it holds (Shard at the
heads dim).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle
from torch.nn.utils.stateless import _reparametrize_module

from dtp.compiler.layer import TensorParallelGroup, become
from dtp.compiler.placed import distribute_param
from dtp.layout.modules import forward_params
from dtp.layout.placement import ParamPlacement


def cut_heads(
    x: torch.Tensor, heads: int, dim: int, rank: int, tp: int, what: str = "input"
) -> torch.Tensor:
    """Rank `rank`'s `heads // tp` heads of `x`, whose dimension `dim` holds every head (any
    dimension folded in front of them: (batch · heads) at 0) or 1 (broadcast over heads: kept
    whole)."""
    if x.requires_grad:
        raise ValueError(
            f"slice_input: {what} requires a gradient; each rank's would cover its own heads only, "
            f"so slice_input cuts only tensors built without one (ALiBi biases, masks)"
        )
    if x.dim() <= dim:
        raise ValueError(
            f"slice_input: {what} has shape {tuple(x.shape)}, which has no dimension {dim} to cut "
            f"into {heads} heads"
        )
    size = x.shape[dim]
    if size == 1:
        return x
    if size % heads:
        other = [d for d, n in enumerate(x.shape) if n == heads]
        hint = f"; dimension {other[0]} holds {heads}: dim={other[0]}?" if other else ""
        raise ValueError(
            f"slice_input: {what} has shape {tuple(x.shape)}: dimension {dim} ({size}) holds "
            "neither "
            f"the {heads} heads (nor a batch folded with them) nor 1 (a value broadcast over "
            f"heads){hint}"
        )
    per = heads // tp
    split = x.unflatten(dim, (size // heads, heads))  # (…, folded, heads, …)
    return split.narrow(dim + 1, rank * per, per).flatten(dim, dim + 1).contiguous()


def input_positions(module: nn.Module, names: tuple[str, ...]) -> dict[str, int | None]:
    """Where each named input of `module.forward` may come positionally (None: keyword only or
    unknown)."""
    params = forward_params(module)
    if params is None:  # no Python signature: keywords only
        return dict.fromkeys(names)
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {n: positional.index(n) if n in positional else None for n in names}


class SliceHeadsInput(ParallelStyle):
    """Cut the inputs `names` (given by keyword or position) of a module, each holding every head at
    dimension `dim`, to this rank's heads; None and non-tensor values pass through. No
    communication."""

    def __init__(self, names: tuple[str, ...], heads: int, dim: int = 0):
        super().__init__()
        self.names, self.heads, self.dim = tuple(names), heads, dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        where = input_positions(module, self.names)
        owner = type(module).__name__

        def cut(name: str, x: object) -> object:
            if not isinstance(x, torch.Tensor):
                return x
            return cut_heads(x, self.heads, self.dim, rank, tp, f"{owner}'s input {name!r}")

        def hook(mod, args, kwargs):
            if tp == 1:
                return args, kwargs
            args, kwargs = list(args), dict(kwargs)
            for name, index in where.items():
                if name in kwargs:
                    kwargs[name] = cut(name, kwargs[name])
                elif index is not None and index < len(args):
                    args[index] = cut(name, args[index])
            return tuple(args), kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"SliceHeadsInput({', '.join(self.names)}, heads={self.heads}, dim={self.dim})"


class SlicedHeads:
    """The forward of a module holding this rank's heads of its own per-head parameters: its own
    forward, on their local tensors."""

    _sliced_params: tuple[str, ...]

    def forward(self, *args, **kwargs):  # noqa: D102 - the class says it
        local = {n: getattr(self, n).to_local() for n in self._sliced_params}
        with _reparametrize_module(self, local):
            return super().forward(*args, **kwargs)


class SliceHeadsParams(ParallelStyle):
    """The module's own parameters `names`, each holding every head at dimension `dim`, kept as
    Shard(dim) DTensors (this rank's heads) and handed to its forward as local tensors. No
    communication."""

    def __init__(self, names: tuple[str, ...], dim: int = 0):
        super().__init__()
        self.names, self.dim = tuple(names), dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            distribute_param(module, name, ParamPlacement(self.dim), device_mesh)
        module._sliced_params = self.names
        return become(module, SlicedHeads, TensorParallelGroup.of(device_mesh, None))
