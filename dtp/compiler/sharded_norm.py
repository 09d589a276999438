"""`sharded_norm`: an RMS norm over a feature dimension that a colwise layer shards (OLMo2's q_norm
and k_norm normalise the whole q and k projections, every head together).

Each rank holds its slice x_r of the features and the matching slice w_r of the norm's weight. The
only cross-rank quantity is the sum of squares over all F features, so each rank computes

    y_r = w_r · x_r / sqrt(Σ_ranks Σ x_r² / F + eps)

with one all-reduce of a (batch, seq, 1) buffer in the forward pass and one of its gradient in the
backward pass (every rank's output depends on every rank's sum: Megatron's f and g around a scalar
per token). The weight's gradient needs no reduction: each rank's slice is its own. Statistics are
kept in at least float32, as Hugging Face's RMSNorms keep them.

A part list (`sharded_norm(packed=[repeat(kv)])`) lays the weight out as the colwise projection
before it: with key/value heads repeated over ranks (tp a multiple of them), each head is held by
tp/H ranks, so the all-reduced sum counts every head tp/H times over tp·F_local = (tp/H)·F features:
the mean is exact, and the repeated weight rows' gradient is summed over the ranks that share them
(dtp/compiler/placed.py).

What the module computes is not assumed: `check` runs its own forward on a probe input and compares
it with the formula above, so a norm with another formula (Gemma's 1 + weight, a LayerNorm's mean)
is refused.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from dtp.compiler.layer import TensorParallelGroup, become
from dtp.compiler.placed import all_reduce_grad, distribute_param
from dtp.layout.norms import epsilon, rms_norm
from dtp.layout.placement import ParamPlacement


class _SumOverRanks(torch.autograd.Function):
    """All-reduce forward; all-reduce of the gradient backward (every rank's output reads the sum)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return all_reduce_grad(t.contiguous(), mesh)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_grad(grad.contiguous(), ctx.mesh), None


class ShardedRMSNorm:
    """The forward of an RMS norm over this rank's features: one input (however it is passed), local
    slices."""

    _tp: TensorParallelGroup

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:  # noqa: D102 - the class says it
        tp = self._tp
        x = args[0] if args else next(iter(kwargs.values()))
        if isinstance(x, DTensor):
            x = x.redistribute(placements=[Shard(-1)]).to_local()
        reduce = (lambda t: _SumOverRanks.apply(t, tp.mesh)) if tp.size > 1 else (lambda t: t)
        return rms_norm(x, self.weight.to_local(), epsilon(self), x.shape[-1] * tp.size, reduce)


class ShardedNorm(ParallelStyle):
    """An RMS norm on this rank's slice of a colwise-sharded feature dimension: weight sharded like
    the features (`placement`), the sum of squares all-reduced; reads and hands on local slices."""

    def __init__(self, placement: ParamPlacement):
        super().__init__()
        self.placement = placement

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_param(module, "weight", self.placement, device_mesh)
        return become(module, ShardedRMSNorm, TensorParallelGroup.of(device_mesh, None))

    def __repr__(self) -> str:
        return f"ShardedNorm({self.placement})"
